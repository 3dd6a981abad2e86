#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Drive vLLM's and SGLang's own KV-cache and event code, and write what they published with what
kvmatch must conclude from it (tests/engine_fixtures/*.txt, read by tests/test_engine_fixtures.c
in `make test`).

usage: check-engines.py WHEEL_DIR [OUT_DIR]
       check-engines.py --vllm-offload WHEEL_DIR OUT_DIR   (with PYTHONHASHSEED set)
       check-engines.py --sglang-radix WHEEL_DIR OUT_DIR   (in a Python that has torch)
       check-engines.py --sglang-hicache WHEEL_DIR OUT_DIR (in a Python that has torch)

WHEEL_DIR holds the vLLM and SGLang wheels (`pip download --no-deps`; scripts/check-engines.sh
fetches them). Two kinds of fixture:

* Engine runs (vllm_engine_*.txt). vLLM's own KVCacheManager (vllm/v1/core/kv_cache_manager.py,
  its coordinator, BlockPool and kv_cache_utils, and vllm/v1/request.py's Request with its block
  hasher) serves request sequences on a small block pool, so that stores, prefix hits and
  evictions all happen; its events are published by vLLM's own ZmqEventPublisher (msgspec
  encoder, sequence numbers, replay buffer and ROUTER replay service) on inproc endpoints, and
  received here on a SUB socket. Each prompt's line carries the engine's own prefix-cache hit
  (get_computed_blocks) taken when the request arrived, after every message published before it.
  Scenarios: plain; second copies (prompts ending on a block boundary: the engine recomputes and
  caches their cached last block again); cache salts and LoRA adapters (tenants and adapters
  sending the prompt texts of unsalted base-model requests); lookahead hashing
  (num_hash_lookahead_tokens 1 and 2, configured as vLLM's Scheduler does for EAGLE, prompts
  diverging right after a block boundary); hybrid models
  (HybridKVCacheCoordinator: a full-attention and a two-block sliding-window group, a
  full-attention group with two- and three-block sliding-window groups, and a full-attention and
  a Mamba group in align mode, its blocks cached through BlockPool.cache_full_blocks as the
  Scheduler's checkpoint planning would leave them); two DP ranks (one
  engine and publisher per rank, data_parallel_size 2); live messages dropped inside and beyond
  the publisher's replay buffer (the publisher's own replay answers recorded); a prefix-cache
  reset (AllBlocksCleared) and an engine restart (a new manager and publisher, seq from 0).
* The CPU tier (vllm_engine_offload_cpu*.txt). The same KVCacheManager with the
  OffloadingConnector's scheduler side (offloading/scheduler.py's OffloadingConnectorScheduler,
  offloading/events.py's self-describing KV events, vllm/v1/kv_offload's CPUOffloadingManager with
  its LRU policy) on a GPU pool and a CPU cache both small enough to evict, driven step by step
  as vLLM's Scheduler drives them (get_num_new_matched_tokens after get_computed_blocks,
  update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
  take_events); this script plays the worker, reporting each store job finished 1 to 3 steps
  after it was scheduled and each load at the next step. Each prompt's line carries the
  engine's hit (the GPU hit plus the connector's CPU hit from there) and how much of it the CPU
  gave; offloaded chunks of 1 and of 2 blocks, with self-describing CPU events and with vLLM's
  default placeholder ones (vllm_engine_offload_cpu_placeholders*.txt), compared exactly (a
  prompt is a bound while the engine's CPU holds a chunk whose placeholder kvmatch could not
  place in full).
* Event encodings (vllm_lookahead.txt, vllm_lora_offload.txt, vllm_salt.txt,
  sglang_salt_tiers.txt): events built with the engines' event classes and encoders, with the
  index content computed here from docs/HASHING.md with Python's xxhash.

vLLM's modules are executed from the wheel as they are. The imports they make that these runs
never use are placeholders whose every call raises (so a use would fail the run, never change
it); the list of placeholders actually bound is printed at the end. Replaced with a stand-in:
  vllm.envs                         VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True (vLLM's default)
  vllm.logger.init_logger           logging.getLogger
  vllm.sampling_params.SamplingParams  the four fields Request reads (max_tokens, extra_args,
                                    structured_outputs, skip_reading_prefix_cache), all unset
  vllm.config.get_current_vllm_config_or_none  None (no engine config is current; the KV-cache
                                    spec registry, its caller, passes it on unused)
  vllm.config.kv_events.KVEventsConfig  types.SimpleNamespace (the publisher only records its
                                    settings in one)
  vllm.platforms.current_platform   register_custom_kv_cache_specs does nothing (as vLLM's base
                                    Platform, which every in-tree platform inherits it from)
  vllm.v1.metrics.stats.PrefillStats  types.SimpleNamespace (statistics a Request carries for
                                    the scheduler's logging, never read here)
  vllm.v1.utils.ConstantList        vLLM's own class, its source taken from vllm/v1/utils.py
                                    (the rest of that module needs torch)
  vllm.utils.network_utils          not needed: inproc endpoints bind without them
For the CPU tier, also:
  VllmConfig                        types.SimpleNamespace with the five attributes the connector
                                    reads (cache_config.prefix_cache_retention_interval None,
                                    cache_config.enable_prefix_caching True, speculative_config
                                    None, parallel_config.world_size 1,
                                    parallel_config.decode_context_parallel_size 1)
  CPUOffloadingSpec                 a subclass of vLLM's OffloadingSpec whose get_manager returns
                                    vLLM's CPUOffloadingManager (the real spec's module loads the
                                    GPU worker's transfer code); built from vLLM's OffloadingConfig
  SchedulerOutput, KVConnectorOutput  types.SimpleNamespace with the fields the connector reads
                                    (its jobs reported in vLLM's OffloadingWorkerMetadata)
  kv_connector.utils.yield_req_data  vLLM's own function, its source taken from the wheel (the
                                    rest of that module needs torch)
  get_dtype_size                    2 (float16): only the connector's synchronous-load budget,
                                    off here, uses it
numpy and prometheus_client are the real packages (the CPU tier's transfer specs hold numpy
arrays; the connector's statistics classes are Prometheus's). It runs in a process of its own
(--vllm-offload): vLLM orders a transfer job's blocks by Python's set order, so
scripts/check-engines.sh sets PYTHONHASHSEED for it and its fixtures repeat (vLLM also derives
its block hashes' seed from PYTHONHASHSEED when set, which the other runs leave at vLLM's
default).
SGLang: sglang/srt/disaggregation/kv_events.py (its event classes and encoder), with
sglang.srt.runtime_context.get_parallel and sglang.srt.utils.network.NetworkAddress as
placeholders. With --sglang-radix (a separate process, in a Python that has torch): SGLang's own
RadixCache (sglang/srt/mem_cache: radix_cache, base_prefix_cache, cache_init_params, events,
utils, evict_policy, its native block hash compiled from the wheel's C++ source, and
sglang/srt/utils/cpp_extension_loader) serves prompts through match_prefix, insert and evict,
and its KV-event recorder's events are published as engine runs (sglang_engine_radix.txt, and
sglang_engine_salt.txt with cache-salted and LoRA requests);
every other sglang module is a placeholder (the list is printed), the token-to-KV allocator a
stand-in whose free_segment does nothing (create_simulated has no memory pools).
With --sglang-hicache (the same kind of process): SGLang's host tier, UnifiedRadixCache with
HiCache (sglang/srt/mem_cache: unified_radix_cache, unified_cache's tree core, FULL component,
cache actions, registry, session-ref tracker and storage attachment, hicache_storage's transfer
records, buffer_mode/storage_existence_cache, storage_prefetch, session/streaming_session,
sglang/srt/environ and utils/rank_consensus_checker, with the RadixCache modules above): its
tree, write policy (write_through, write_through_selective, write_back), device and host
eviction, match_prefix's host part, init_load_back and KV-event recorder run as they are.
Replaced with a stand-in:
  HybridCacheController             _HiCacheController: the queues and calls the cache uses
                                    (write, start_writing, load, start_loading, the write and
                                    load ack queues, reset, write_policy), moving no bytes; a
                                    write is acknowledged 1 to 3 steps after it was submitted
                                    (seeded, never before an earlier write), a load at once
  HiCacheAck and its device events  _HiCacheAck, _TransferEvent: query() true once the driver's
                                    step reaches the transfer's, synchronize() completes it
  the host pool group (pinned host  _HostSlots: host slot numbers in whole pages from a free
  KV tensors)                       list, the anchor entry without a shared allocation domain
  the token-to-KV allocator and its _DeviceSlots: device slot numbers from a free list (a slot
  device KV pool                    freed twice fails the run)
  hybrid_pool_assembler's           sets the cache's host pool group, its controller and the
  attach_hybrid_pool_to_unified_    FULL component's host pool (the group's KV pool), as the
  cache                             assembler's _apply_stack_result does; no sidecar pools
  runtime_context                   get_memory: host memory mode "cache", no storage backend,
                                    the run's write policy; get_observability: no metric labels;
                                    get_disagg: not disaggregated
  allocator.page_interleave         page_interleave_shard_size 1 (a stock allocator)
The driver plays the scheduler: each step it calls check_hicache_events (submitting the queued
backups and taking the acknowledged writes), matches the prompt without its last token, loads
the host part back with init_load_back (the host match pinned, as the scheduler's admission
does), runs the request on its locked prefix and newly allocated slots (evict_for_alloc when
the device pool is short, and a step more while what is left is locked by unacknowledged
writes), then inserts prompt and output with prev_prefix_len set, as SGLang caches a finished
request. At the end every device and host slot must be free or held by the tree.
msgspec, pyzmq, pydantic and cbor2 are the real packages.

Fixture format, one line each:
  config <block_size> <hash_lookahead_tokens> [<offload_chunk_blocks>]
                                            the pool's settings (offload_chunk_blocks: 1 when
                                            left out)
  worker <id> <replay: 0|1>                 add a worker (index worker id)
  offload <worker> <blocks per chunk>       the worker's engine offloads to host memory through
                                            vLLM's OffloadingConnector, in chunks of that many
                                            blocks (its hit rule: docs/EVENTS.md)
  hicache <worker> <min host blocks>        the worker's engine is SGLang with HiCache: it loads
                                            a host hit back only when it holds at least that
                                            many blocks (load_back_threshold), else recomputes it
  live <worker> <seq> <hex payload>         a message as the live SUB socket received it
  replay <worker> <start_seq> <n>           the publisher's answer to a replay request from
  item <seq> <hex payload>                  start_seq: n items follow
  prompt <worker> <hit blocks> <check> [salt=<s>] [lora=<name>] [host=<blocks>] <tokens, ...>
                                            the engine's hit for a prompt, in blocks, the
                                            request's cache salt and LoRA adapter, and how many
                                            blocks of the hit came from host memory; check is
                                            exact (kvmatch's capped depth must equal it),
                                            bound (it must not exceed it) or
                                            unseen (messages missing, or the engine restarted
                                            and has published nothing yet: not compared)
  state <worker> <state> <lost>             the worker's feed state and lost count here
  expect <chain hash, 16 hex digits> <tier> (event encodings) the worker's whole index content;
                                            tier is device, host or disk
  refused <reason> <count>                  events skipped or refused for that reason (any
                                            reason not listed: none)
"""
import ast
import glob
import importlib.abc
import importlib.machinery
import logging
import os
import random
import struct
import sys
import time
import types
import zipfile

import msgspec
import xxhash

MASK = (1 << 64) - 1
SEED = 1337


def module_source(wheel_glob, path):
    wheels = glob.glob(wheel_glob)
    if not wheels:
        sys.exit(f"check-engines: no wheel matches {wheel_glob}")
    with zipfile.ZipFile(wheels[0]) as z:
        return z.read(path).decode("utf-8"), os.path.basename(wheels[0])


def stub(name, **attrs):
    """A stand-in module: the given attributes; under vLLM, placeholders for any other name."""
    m = _PlaceholderModule(name) if name.startswith("vllm") else types.ModuleType(name)
    m.__path__ = []
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    return m


def load(name, source):
    m = types.ModuleType(name)
    m.__file__ = name.replace(".", "/") + ".py"
    sys.modules[name] = m
    exec(compile(source, m.__file__, "exec"), m.__dict__)
    return m


# ---- vLLM from its wheel -----------------------------------------------------------------------

PLACEHOLDERS = set()


class _PlaceholderType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls  # class-level constants in annotations and defaults (an enum member)

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"check-engines: {cls.__module__}.{cls.__name__} is a placeholder, "
                           "but the run used it")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in sys.modules:  # a stand-in submodule
            return sys.modules[f"{self.__name__}.{name}"]
        PLACEHOLDERS.add(f"{self.__name__}.{name}")
        t = _PlaceholderType(name, (), {"__module__": self.__name__})
        setattr(self, name, t)
        return t


class _WheelImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules named in `real` execute from the wheel; every other module under `roots` is a
    placeholder module."""

    def __init__(self, wheel, real, roots):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self.real, self.roots = set(real), set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name) if spec.name in self.real else _PlaceholderModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        if m.__name__ not in self.real:
            return
        path = m.__name__.replace(".", "/") + ".py"
        if path not in self.names:
            path = m.__name__.replace(".", "/") + "/__init__.py"
        m.__file__ = path
        exec(compile(self.zip.read(path).decode("utf-8"), path, "exec"), m.__dict__)


VLLM_REAL = [
    "vllm.utils", "vllm.utils.math_utils", "vllm.utils.hashing",
    "vllm.distributed.kv_events",
    "vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator", "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.request", "vllm.v1.structured_output.request", "vllm.lora.request",
]


class SamplingParams:
    """The fields vllm.v1.request.Request reads, for a plain generation request."""

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens
        self.extra_args = None
        self.structured_outputs = None
        self.skip_reading_prefix_cache = None


def load_vllm(wheel_dir):
    wheels = glob.glob(os.path.join(wheel_dir, "vllm-*.whl"))
    if not wheels:
        sys.exit(f"check-engines: no vLLM wheel in {wheel_dir}")
    stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.sampling_params", SamplingParams=SamplingParams)
    stub("vllm.config", get_current_vllm_config_or_none=lambda: None)
    stub("vllm.config.kv_events", KVEventsConfig=types.SimpleNamespace)
    stub("vllm.v1.metrics.stats", PrefillStats=types.SimpleNamespace)
    stub("vllm.platforms", current_platform=types.SimpleNamespace(
        register_custom_kv_cache_specs=lambda vllm_config: None))
    roots = {"vllm", "torch", "PIL", "uvloop"}
    try:
        import numpy  # noqa: F401 (the CPU tier's transfer specs hold numpy arrays)
    except ImportError:
        roots.add("numpy")
    importer = _WheelImporter(wheels[0], VLLM_REAL, roots)
    sys.meta_path.insert(0, importer)
    utils_src = importer.zip.read("vllm/v1/utils.py").decode("utf-8")
    const = next(n for n in ast.parse(utils_src).body
                 if isinstance(n, ast.ClassDef) and n.name == "ConstantList")
    v1_utils = stub("vllm.v1.utils")
    exec("from collections.abc import Sequence\nfrom typing import Generic, TypeVar, overload\n"
         "T = TypeVar('T')\n" + ast.get_source_segment(utils_src, const), v1_utils.__dict__)
    import importlib
    v = types.SimpleNamespace(
        kv=importlib.import_module("vllm.distributed.kv_events"),
        manager=importlib.import_module("vllm.v1.core.kv_cache_manager"),
        block_pool=importlib.import_module("vllm.v1.core.block_pool"),
        utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
        spec=importlib.import_module("vllm.v1.kv_cache_interface"),
        request=importlib.import_module("vllm.v1.request"),
        lora=importlib.import_module("vllm.lora.request"),
        hashing=importlib.import_module("vllm.utils.hashing"),
        wheel=os.path.basename(wheels[0]), importer=importer)
    return v


def load_sglang(wheel_dir):
    for pkg in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
        stub(pkg)
    stub("sglang.srt.runtime_context", get_parallel=None)
    stub("sglang.srt.utils.network", NetworkAddress=object)
    src, wheel = module_source(os.path.join(wheel_dir, "sglang-*.whl"),
                               "sglang/srt/disaggregation/kv_events.py")
    return load("sglang.srt.disaggregation.kv_events", src), wheel


# ---- docs/HASHING.md, independently ------------------------------------------------------------

def xxh3(data, seed):
    return xxhash.xxh3_64_intdigest(data, seed=seed & MASK)


def remap(v):
    return {0: 0x9E3779B97F4A7C15, 1: 0xC2B2AE3D27D4EB4F}.get(v, v)


def chains(tokens, block_size, lookahead=0, lora=None, salt=None):
    lora_seed = SEED if not lora else (SEED + xxh3(lora.encode(), 0)) & MASK
    seed0 = (lora_seed + xxh3(salt.encode(), 1)) & MASK if salt else lora_seed
    n = (len(tokens) - lookahead) // block_size if len(tokens) >= lookahead else 0
    out, chain = [], None
    for i in range(n):
        window = tokens[i * block_size:(i + 1) * block_size + lookahead]
        local = xxh3(struct.pack("<%dI" % len(window), *window), seed0 if i == 0 else lora_seed)
        chain = remap(local) if i == 0 else remap(xxh3(struct.pack("<QQ", chain, local), SEED))
        out.append(chain)
    return out


# ---- scenarios ---------------------------------------------------------------------------------

def write(out_dir, name, block_size, lookahead, payloads, expect, comment, refused=()):
    with open(os.path.join(out_dir, name + ".txt"), "w", encoding="ascii") as f:
        f.write(f"# {comment}\n# GENERATED by scripts/check-engines.py; do not edit.\n")
        f.write(f"config {block_size} {lookahead}\n")
        for p in payloads:
            f.write("payload " + p.hex() + "\n")
        for chain, tier in expect:
            f.write(f"expect {chain:016x} {tier}\n")
        for reason, count in refused:
            f.write(f"refused {reason} {count}\n")


def vllm_scenarios(v, out_dir):
    kv, wheel = v.kv, v.wheel
    enc = msgspec.msgpack.Encoder()
    B = 4
    toks = list(range(100, 113))  # 3 blocks and one lookahead token

    def batch(*events):
        return enc.encode(kv.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=None))

    # Lookahead hashing (EAGLE, L = 1): two variants of block 1, one evicted.
    p0 = batch(kv.BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None,
                              token_ids=toks[:12], block_size=B, lora_id=None, medium="GPU",
                              lora_name=None, lookahead_token_ids=[[toks[4]], [toks[8]], [toks[12]]]))
    p1 = batch(kv.BlockStored(block_hashes=[22], parent_block_hash=11, token_ids=toks[4:8],
                              block_size=B, lora_id=None, medium="GPU", lora_name=None,
                              lookahead_token_ids=[[7777]]))
    p2 = batch(kv.BlockRemoved(block_hashes=[12, 13], medium="GPU"))
    first = chains(toks, B, 1)
    other = chains(toks[:8] + [7777], B, 1)
    write(out_dir, "vllm_lookahead", B, 1, [p0, p1, p2],
          [(first[0], "device"), (other[1], "device")],
          f"{wheel}: BlockStored / BlockRemoved with lookahead_token_ids")

    # LoRA under Dynamo's seed rule, CPU offload of its first block, then the GPU copy evicted.
    ek = [("sql-adapter",)] * 2
    p0 = batch(kv.BlockStored(block_hashes=[31, 32], parent_block_hash=None, token_ids=toks[:8],
                              block_size=B, lora_id=3, medium="GPU", lora_name="sql-adapter",
                              extra_keys=ek))
    p1 = batch(kv.BlockStored(block_hashes=[31], parent_block_hash=None, token_ids=toks[:4],
                              block_size=B, lora_id=None, medium="CPU", lora_name=None))
    p2 = batch(kv.BlockRemoved(block_hashes=[31], medium="GPU"))
    c = chains(toks[:8], B, lora="sql-adapter")
    write(out_dir, "vllm_lora_offload", B, 0, [p0, p1, p2], [(c[0], "host"), (c[1], "device")],
          f"{wheel}: LoRA blocks, CPU offload, GPU eviction")

    # The salt in block 0's extra keys, a continuation without it.
    p0 = batch(kv.BlockStored(block_hashes=[41, 42], parent_block_hash=None, token_ids=toks[:8],
                              block_size=B, lora_id=None, medium=None, lora_name=None,
                              extra_keys=[("tenant-a",), None]))
    p1 = batch(kv.BlockStored(block_hashes=[43], parent_block_hash=42, token_ids=toks[8:12],
                              block_size=B, lora_id=None, medium=None, lora_name=None))
    c = chains(toks[:12], B, salt="tenant-a")
    write(out_dir, "vllm_salt", B, 0, [p0, p1], [(x, "device") for x in c],
          f"{wheel}: cache_salt in extra_keys")


def vllm_hybrid_scenario(v, out_dir):
    """A hybrid model's groups caching blocks through vLLM's own BlockPool.cache_full_blocks: the
    full-attention group (0) every block, a Mamba group (1) in align mode only the state blocks
    (block_mask, as MambaManager leaves interior blocks null). vLLM then publishes the Mamba
    group's token_ids for the whole range with the hash of the kept block only."""
    B = 4
    pool = v.block_pool.BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=B,
                                  enable_kv_cache_events=True)
    v.utils.init_none_hash(v.hashing.sha256_cbor)
    hasher = v.utils.get_request_block_hasher(B, v.hashing.sha256_cbor, 0)
    enc = msgspec.msgpack.Encoder()
    payloads = []
    a = list(range(300, 313))  # 3 full blocks: the Mamba group keeps block 2's state only
    b = list(range(400, 405))  # 1 full block, kept by both groups
    for tokens, mask in ((a, [False, False, True]), (b, [True])):
        r = v.request.Request(f"h{tokens[0]}", tokens, SamplingParams(1), None,
                              block_hasher=hasher)
        n = len(tokens) // B
        pool.cache_full_blocks(r, pool.get_new_blocks(n), 0, n, B, kv_cache_group_id=0)
        pool.cache_full_blocks(r, pool.get_new_blocks(n), 0, n, B, kv_cache_group_id=1,
                               block_mask=mask)
        payloads.append(enc.encode(v.kv.KVEventBatch(ts=1.0, events=pool.take_events(),
                                                     data_parallel_rank=None)))
    # Block 2 of `a` is held by both groups, but which block the Mamba event names is not on the
    # wire: no block of `a` counts. Block 0 of `b` does.
    write(out_dir, "vllm_hybrid_mamba", B, 0, payloads, [(chains(b, B)[0], "device")],
          f"{v.wheel}: BlockPool.cache_full_blocks of a full-attention and a Mamba group",
          refused=[("partial_block", 1)])


def sglang_scenarios(kv, wheel, out_dir):
    enc = msgspec.msgpack.Encoder()
    B = 4
    toks = list(range(200, 212))

    def batch(*events):
        return enc.encode(kv.KVEventBatch(ts=1.0, events=list(events), attn_dp_rank=0))

    gpu, cpu, ext = (kv.StorageMedium.GPU.value, kv.StorageMedium.CPU.value,
                     kv.StorageMedium.EXTERNAL.value)
    p0 = batch(kv.BlockStored(block_hashes=[-5, 6], parent_block_hash=None, token_ids=toks[:8],
                              block_size=B, lora_id=None, medium=gpu, cache_salt="tenant-a",
                              session_id="s1"))
    p1 = batch(kv.BlockStored(block_hashes=[7], parent_block_hash=6, token_ids=toks[8:12],
                              block_size=B, lora_id=None, medium=gpu, cache_salt="tenant-a"))
    p2 = batch(kv.BlockStored(block_hashes=[-5, 6], parent_block_hash=None, token_ids=toks[:8],
                              block_size=B, lora_id=None, medium=cpu, cache_salt="tenant-a"))
    p3 = batch(kv.BlockStored(block_hashes=[7], parent_block_hash=6, token_ids=toks[8:12],
                              block_size=B, lora_id=None, medium=ext, cache_salt="tenant-a"))
    p4 = batch(kv.BlockRemoved(block_hashes=[-5, 6, 7], medium=gpu))
    c = chains(toks, B, salt="tenant-a")
    write(out_dir, "sglang_salt_tiers", B, 0, [p0, p1, p2, p3, p4],
          [(c[0], "host"), (c[1], "host"), (c[2], "disk")],
          f"{wheel}: top-level cache_salt, CPU_PINNED and EXTERNAL media")


# ---- vLLM's KVCacheManager and ZmqEventPublisher -----------------------------------------------

class VllmEngine:
    """One vLLM engine core (one DP rank): its KVCacheManager configured as vLLM's Scheduler does
    (vllm/v1/core/sched/scheduler.py: with lookahead hashes EAGLE drops no block), one
    full-attention KV-cache group (and, for a hybrid model, one sliding-window group per entry of
    `windows`, its window in tokens, or a Mamba group in align mode), events published by its own
    ZmqEventPublisher."""

    def __init__(self, v, name, block_size, num_blocks, lookahead=0, dp_rank=0, buffer_steps=64,
                 windows=(), mamba=False):
        import zmq
        self.v, self.block_size = v, block_size
        specs = [v.spec.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                          dtype=None)]
        # A hybrid model's sliding-window KV-cache groups.
        for window in windows:
            specs.append(v.spec.SlidingWindowSpec(block_size=block_size, num_kv_heads=1,
                                                  head_size=8, dtype=None,
                                                  sliding_window=window))
        if mamba:
            specs.append(v.spec.MambaSpec(block_size=block_size, shapes=((8,),), dtypes=(None,),
                                          mamba_cache_mode="align"))
        config = v.spec.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[v.spec.KVCacheGroupSpec([f"layer.{i}"], s)
                             for i, s in enumerate(specs)])
        self.manager = v.manager.KVCacheManager(
            config, max_model_len=4096, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=True, use_eagle=False,
            num_hash_lookahead_tokens=lookahead, enable_kv_cache_events=True)
        v.utils.init_none_hash(v.hashing.sha256_cbor)
        self.hasher = v.utils.get_request_block_hasher(block_size, v.hashing.sha256_cbor, lookahead)
        self.publisher = v.kv.ZmqEventPublisher(
            dp_rank, endpoint=f"inproc://{name}", replay_endpoint=f"inproc://{name}-replay",
            buffer_steps=buffer_steps)
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, 5000)
        self.sub.connect(self.publisher._endpoint)
        self.replay_endpoint = self.publisher._replay_endpoint
        time.sleep(0.2)  # the subscription reaches the PUB socket
        self.n_requests = self.n_batches = 0

    def serve(self, tokens, n_output, salt=None, lora=None):
        """One request: its prefix hit (tokens), allocation, n_output decoded tokens, free. salt is
        the request's cache_salt, lora its adapter (a vLLM LoRARequest), both optional."""
        v = self.v
        self.n_requests += 1
        r = v.request.Request(f"r{self.n_requests}", list(tokens), SamplingParams(n_output), None,
                              lora_request=lora, cache_salt=salt, block_hasher=self.hasher)
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        if self.manager.allocate_slots(r, len(tokens) - hit, hit, blocks) is None:
            raise RuntimeError("check-engines: the block pool is too small for one request")
        r.num_computed_tokens = len(tokens)
        for i in range(n_output):
            r.append_output_token_ids(7000 + (self.n_requests * 31 + i) % 97)
            if self.manager.allocate_slots(r, 1) is None:
                raise RuntimeError("check-engines: the block pool is too small for one request")
            r.num_computed_tokens += 1
        self.manager.free(r)
        return hit, r.all_token_ids[:]

    def serve_checkpoints(self, tokens, rng):
        """One prompt of a full-attention + Mamba (align mode) model: its prefix hit (tokens), then
        its full blocks cached through vLLM's own BlockPool.cache_full_blocks as the scheduler's
        checkpoint planning would leave them: full attention the blocks after its own cached
        prefix, the Mamba group the state of the last full block and of about a third of the
        others (block_mask, as MambaManager keeps only checkpointed states), a state it holds
        already not again. vLLM would cache a second copy of the full-attention blocks between the
        hybrid hit and the full-attention prefix; this run leaves them out (vllm_engine_copies
        makes second copies).
        The hit's blocks are touched and every block is freed at the end, each group's tail
        first, as KVCacheManager.free does, so later prompts evict them in vLLM's LRU order."""
        v, B, pool = self.v, self.block_size, self.manager.block_pool
        self.n_requests += 1
        r = v.request.Request(f"r{self.n_requests}", list(tokens), SamplingParams(1), None,
                              block_hasher=self.hasher)
        computed, hit, _ = self.manager.get_computed_blocks(r)
        hit_blocks = [[b for b in group if not b.is_null] for group in computed.blocks]
        for group in hit_blocks:
            pool.touch(group)
        n = len(tokens) // B
        hashes = r.block_hashes[:n]
        owned = [list(g) for g in hit_blocks]
        held = 0  # full attention: the blocks after its own cached prefix, in one run
        while held < n and pool.get_cached_block(hashes[held], [0]):
            held += 1
        if held < n:
            new = pool.get_new_blocks(n - held)
            pool.cache_full_blocks(r, [pool.null_block] * held + new, held, n, B,
                                   kv_cache_group_id=0)
            owned[0] += new
        keep = [(i == n - 1 or rng.random() < 0.35) and not pool.get_cached_block(hashes[i], [1])
                for i in range(n)]
        if any(keep):
            new = iter(pool.get_new_blocks(sum(keep)))
            blocks = [next(new) if k else pool.null_block for k in keep]
            pool.cache_full_blocks(r, blocks, 0, n, B, kv_cache_group_id=1, block_mask=keep)
            owned[1] += [b for b in blocks if not b.is_null]
        for group in owned:
            pool.free_blocks(reversed(group))
        return hit, list(tokens)

    def publish(self):
        """Publish the events taken from the manager; return the (seq, payload) the SUB received,
        or None when there were none."""
        events = self.manager.take_events()
        if not events:
            return None
        self.n_batches += 1  # a step counter for ts keeps the fixtures reproducible
        self.publisher.publish(self.v.kv.KVEventBatch(ts=float(self.n_batches), events=events))
        topic, seq, payload = self.sub.recv_multipart()
        return int.from_bytes(seq, "big"), payload

    def replay(self, start_seq):
        """The publisher's own answer to a replay request from start_seq: [(seq, payload)]."""
        import zmq
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        items = []
        while True:
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            if seq == MASK:
                break
            items.append((seq, frames[-1]))
        dealer.close(linger=0)
        return items

    def shutdown(self):
        self.publisher.shutdown()
        self.sub.close(linger=0)


class EngineFixture:
    def __init__(self, out_dir, name, block_size, lookahead, comment, offload_chunk_blocks=1):
        self.f = open(os.path.join(out_dir, name + ".txt"), "w", encoding="ascii")
        self.f.write(f"# {comment}\n# GENERATED by scripts/check-engines.py; do not edit.\n")
        self.f.write(f"config {block_size} {lookahead}"
                     + (f" {offload_chunk_blocks}" if offload_chunk_blocks != 1 else "") + "\n")
        self.prompts = self.hits = self.hit_blocks = self.stored = self.removed = self.clears = 0
        # Copies per (worker, engine hash, group) in the messages delivered, for the summary.
        self.copies, self.held = 0, {}
        self.cpu_stored = self.cpu_removed = self.cpu_again = 0  # the CPU medium's
        # Placeholder CPU stores (self-describing events off) whose chunk the feed cannot walk in
        # full through the blocks held in the messages delivered: kvmatch places part of it or
        # nothing (refused unplaced_placeholder), and while such a chunk is on the engine's CPU,
        # kvmatch's prediction is only a bound.
        self.unplaced = 0
        self.unknown_cpu = set()
        # The feed's walk of a placeholder chunk (docs/EVENTS.md, "Placeholder stores"): each
        # held block's parent as the store that made it held named it, the chunk size, and
        # whether the worker announces its chunks by placeholders (its CPU removals name keys).
        self.offload_chunk_blocks = offload_chunk_blocks
        self.parent = {}
        self.placeholder_workers = set()

    def line(self, text):
        self.f.write(text + "\n")

    def prompt(self, worker, hit_tokens, block_size, tokens, check="exact", salt=None, lora=None,
               host=None):
        assert hit_tokens % block_size == 0
        self.prompts += 1
        self.hits += hit_tokens > 0
        self.hit_blocks += hit_tokens // block_size
        keys = "".join(f"{k}={val} " for k, val in (("salt", salt), ("lora", lora)) if val)
        keys += f"host={host} " if host is not None else ""
        self.line(f"prompt {worker} {hit_tokens // block_size} {check} {keys}"
                  + ",".join(str(t) for t in tokens))

    def is_held(self, worker, h):
        return any(n for k, n in self.held.items() if k[0] == worker and k[1] == h)

    def chunk_of(self, worker, key):
        """The blocks of the chunk keyed by `key` the feed finds: from the key back through
        held parents, at most offload_chunk_blocks."""
        blocks, h = [], key
        while h is not None and len(blocks) < self.offload_chunk_blocks and self.is_held(worker, h):
            blocks.append(h)
            h = self.parent.get((worker, h))
        return blocks

    def count(self, worker, payload):
        for e in msgspec.msgpack.decode(payload)[1]:
            kind = e["type"] if isinstance(e, dict) else e[0]
            hashes = (e["block_hashes"] if isinstance(e, dict) else e[1]) if kind != "AllBlocksCleared" else []
            self.stored += len(hashes) if kind == "BlockStored" else 0
            self.removed += len(hashes) if kind == "BlockRemoved" else 0
            self.clears += kind == "AllBlocksCleared"
            if kind == "AllBlocksCleared":
                self.forget(worker)
            group = e.get("group_idx", 0) if isinstance(e, dict) else 0
            medium = None
            if kind != "AllBlocksCleared":
                medium = (e.get("medium") if isinstance(e, dict)
                          else e[6] if kind == "BlockStored" else e[2])
            placeholder = kind == "BlockStored" and medium not in (None, "GPU") and (
                e["block_size"] if isinstance(e, dict) else e[4]) == 0
            if placeholder:
                self.placeholder_workers.add(worker)
            by_key = placeholder or (kind == "BlockRemoved" and medium not in (None, "GPU")
                                     and worker in self.placeholder_workers)
            previous = None
            if kind == "BlockStored" and not placeholder:
                previous = e.get("parent_block_hash") if isinstance(e, dict) else e[2]
            for h in hashes:
                if kind == "BlockRemoved" and medium == "CPU":
                    self.unknown_cpu.discard((worker, h))
                if kind == "BlockStored" and not placeholder:
                    if not self.is_held(worker, h):
                        self.parent[(worker, h)] = previous
                    previous = h
                blocks = self.chunk_of(worker, h) if by_key else [h]
                if placeholder and len(blocks) < self.offload_chunk_blocks:
                    self.unplaced += 1
                    self.unknown_cpu.add((worker, h))
                for b in blocks:
                    if medium in ("CPU", "CPU_PINNED"):
                        self.cpu_stored += kind == "BlockStored"
                        self.cpu_removed += kind == "BlockRemoved"
                    key = (worker, b, group, medium or "GPU")
                    if kind == "BlockStored" and self.held.get(key):
                        if medium == "CPU":
                            self.cpu_again += 1  # in a second offloaded chunk
                        else:
                            self.copies += 1  # cached again while a copy is still cached
                    delta = 1 if kind == "BlockStored" else -1
                    self.held[key] = max(0, self.held.get(key, 0) + delta)

    def forget(self, worker):
        """The worker's engine holds nothing any more (cleared, or a new process)."""
        self.held = {k: n for k, n in self.held.items() if k[0] != worker}
        self.parent = {k: p for k, p in self.parent.items() if k[0] != worker}
        self.unknown_cpu = {k for k in self.unknown_cpu if k[0] != worker}

    def live(self, worker, message):
        if message is not None:
            self.count(worker, message[1])
            self.line(f"live {worker} {message[0]} {message[1].hex()}")

    def replay(self, worker, start_seq, items):
        self.line(f"replay {worker} {start_seq} {len(items)}")
        for seq, payload in items:
            self.line(f"item {seq} {payload.hex()}")

    def close(self):
        if self.unplaced:
            self.line(f"refused unplaced_placeholder {self.unplaced}")
        self.f.close()
        return (f"{self.prompts} prompts, {self.hits} with a hit ({self.hit_blocks} blocks in "
                f"all); {self.stored} blocks stored ({self.copies} of them a second copy), "
                f"{self.removed} removed, {self.clears} AllBlocksCleared"
                + (f"; CPU: {self.cpu_stored} stored ({self.cpu_again} of them held in another "
                   f"chunk already), {self.cpu_removed} removed" if self.cpu_stored else "")
                + (f"; {self.unplaced} placeholder stores of blocks no medium held"
                   if self.unplaced else ""))


class Workload:
    """Chat-like prompts: a few shared system prompts, conversations that come back with the
    previous turn's prompt and output, and prompts that share a prefix up to a block boundary and
    differ in the tokens right after it (where lookahead hashing decides the hit)."""

    def __init__(self, seed, block_size):
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.systems = [[1000 * (s + 1) + i for i in range(self.rng.randrange(2, 6) * block_size)]
                        for s in range(3)]
        self.conversations = []

    def _user(self, n):
        return [self.rng.randrange(1, 900) for _ in range(n)]

    def next(self):
        kind = self.rng.random()
        if self.conversations and kind < 0.35:
            i = self.rng.randrange(len(self.conversations))
            tokens = self.conversations.pop(i) + self._user(self.rng.randrange(1, 9))
        elif kind < 0.6:
            system = self.rng.choice(self.systems)
            cut = self.rng.randrange(1, len(system) // self.block_size + 1) * self.block_size
            tokens = system[:cut] + self._user(self.rng.randrange(1, 4))
        else:
            tokens = self.rng.choice(self.systems) + self._user(self.rng.randrange(1, 12))
        return tokens

    def done(self, all_tokens):
        if len(all_tokens) < 120 and self.rng.random() < 0.6:
            self.conversations.append(all_tokens)


def run_requests(fixture, engine, worker, workload, n, first="exact", rest="exact"):
    """n requests; the first prompt's check is `first`, the others' `rest`."""
    for i in range(n):
        tokens = workload.next()
        hit, all_tokens = engine.serve(tokens, workload.rng.randrange(1, 7))
        fixture.prompt(worker, hit, engine.block_size, tokens, first if i == 0 else rest)
        fixture.live(worker, engine.publish())
        workload.done(all_tokens)


def vllm_engine_scenarios(v, out_dir):
    B = 4
    made = []

    # Plain, and lookahead hashing with L = 1 (EAGLE) and L = 2.
    for name, lookahead in (("vllm_engine_plain", 0), ("vllm_engine_lookahead1", 1),
                            ("vllm_engine_lookahead2", 2)):
        fx = EngineFixture(out_dir, name, B, lookahead,
                           f"{v.wheel}: KVCacheManager, num_hash_lookahead_tokens {lookahead}, "
                           "48 blocks, 60 requests")
        fx.line("worker 0 1")
        engine = VllmEngine(v, name, B, 48, lookahead)
        run_requests(fx, engine, 0, Workload(lookahead + 1, B), 60)
        engine.shutdown()
        made.append((name, fx.close()))

    # Cache salts and LoRA adapters: tenants and adapters send the same prompt texts, interleaved
    # with unsalted base-model requests, on a pool small enough to evict. vLLM keys every block of
    # an adapter's request and the first block of a salted one apart (its extra keys); kvmatch
    # must predict each prompt's hit when routed with the same salt and adapter name.
    name = "vllm_engine_salt_lora"
    fx = EngineFixture(out_dir, name, B, 0,
                       f"{v.wheel}: KVCacheManager, cache_salt and LoRA requests sharing prompt "
                       "texts with base requests, 48 blocks, 90 requests")
    fx.line("worker 0 1")
    engine = VllmEngine(v, name, B, 48)
    adapters = {n: v.lora.LoRARequest(n, i + 1, f"/adapters/{n}")
                for i, n in enumerate(("sql-adapter", "chat-adapter"))}
    namespaces = [(None, None), ("tenant-a", None), ("tenant-b", None), (None, "sql-adapter"),
                  (None, "chat-adapter"), ("tenant-a", "sql-adapter")]
    work = Workload(61, B)
    conversation_space = {}
    for i in range(90):
        tokens = work.next()
        # A conversation coming back keeps its tenant and adapter, mostly.
        turn = next((k for k in conversation_space if tuple(tokens[:len(k)]) == k), None)
        space = conversation_space.pop(turn) if turn else None
        if space is None or work.rng.random() < 0.2:
            space = work.rng.choice(namespaces)
        salt, lora = space
        hit, all_tokens = engine.serve(tokens, work.rng.randrange(1, 7), salt,
                                       adapters[lora] if lora else None)
        fx.prompt(0, hit, B, tokens, salt=salt, lora=lora)
        fx.live(0, engine.publish())
        work.done(all_tokens)
        conversation_space[tuple(all_tokens)] = space
    engine.shutdown()
    made.append((name, fx.close()))

    # Second copies: prompts that end on a block boundary. The engine recomputes a prompt's last
    # token, so a cached last block is computed again and BlockPool caches that copy beside the
    # first; each copy is evicted with its own BlockRemoved of the same hash, and the engine hits
    # the block while either is cached.
    name = "vllm_engine_copies"
    fx = EngineFixture(out_dir, name, B, 0,
                       f"{v.wheel}: KVCacheManager, prompts ending on a block boundary (second "
                       "copies of their last block), 32 blocks, 80 requests")
    fx.line("worker 0 1")
    engine = VllmEngine(v, name, B, 32)
    work = Workload(71, B)
    for i in range(80):
        tokens = work.next()
        if len(tokens) > B and work.rng.random() < 0.7:
            tokens = tokens[:len(tokens) // B * B]
        hit, all_tokens = engine.serve(tokens, work.rng.randrange(1, 7))
        fx.prompt(0, hit, B, tokens)
        fx.live(0, engine.publish())
        work.done(all_tokens)
    engine.shutdown()
    made.append((name, fx.close()))

    # Hybrid models: a full-attention group and sliding-window groups. kvmatch scores them under
    # vLLM's window rule, so every prompt must equal the engine's hit; the second model's two
    # windows (2 and 3 blocks) make the coordinator iterate between its groups. Mamba groups are
    # not driven: their prefix caching (align mode) needs the Scheduler's checkpoint planning.
    for name, windows, blocks in (("vllm_engine_hybrid_swa", (2 * B,), 96),
                                  ("vllm_engine_hybrid_swa2", (2 * B, 3 * B + 1), 160)):
        fx = EngineFixture(out_dir, name, B, 0,
                           f"{v.wheel}: HybridKVCacheCoordinator, full attention + sliding "
                           f"windows of {', '.join(map(str, windows))} tokens, {blocks} blocks, "
                           "60 requests")
        fx.line("worker 0 1")
        engine = VllmEngine(v, name, B, blocks, windows=windows)
        run_requests(fx, engine, 0, Workload(31, B), 60)
        engine.shutdown()
        made.append((name, fx.close()))

    # A full-attention and a Mamba group in align mode: the Mamba group keeps states at some block
    # boundaries only (published as sparse_blocks, placed by their engine hashes), and the engine
    # hits as far as the last state at or below the full-attention prefix.
    name = "vllm_engine_hybrid_mamba"
    fx = EngineFixture(out_dir, name, B, 0,
                       f"{v.wheel}: HybridKVCacheCoordinator, full attention + Mamba (align), "
                       "64 blocks, 60 requests")
    fx.line("worker 0 1")
    engine = VllmEngine(v, name, B, 64, mamba=True)
    work = Workload(47, B)
    for i in range(60):
        tokens = work.next()
        hit, all_tokens = engine.serve_checkpoints(tokens, work.rng)
        fx.prompt(0, hit, B, tokens)
        fx.live(0, engine.publish())
        work.done(all_tokens)
    engine.shutdown()
    made.append((name, fx.close()))

    # Data-parallel ranks: two engine cores, two publishers, requests spread over both.
    name = "vllm_engine_dp2"
    fx = EngineFixture(out_dir, name, B, 1,
                       f"{v.wheel}: data_parallel_size 2, one KVCacheManager and "
                       "ZmqEventPublisher per rank, lookahead 1")
    fx.line("worker 0 1")
    fx.line("worker 1 1")
    engines = [VllmEngine(v, name, B, 40, 1, dp_rank=r) for r in range(2)]
    work = Workload(11, B)
    for i in range(60):
        rank = work.rng.randrange(2)
        run_requests(fx, engines[rank], rank, work, 1)
    for e in engines:
        e.shutdown()
    made.append((name, fx.close()))

    # Live messages dropped inside the replay buffer (replayed), then beyond it (lost: DEGRADED
    # until the engine's prefix-cache reset), then an engine restart.
    name = "vllm_engine_gaps_restart"
    fx = EngineFixture(out_dir, name, B, 1,
                       f"{v.wheel}: replay buffer of 8 messages, gaps inside and beyond it, "
                       "reset_prefix_cache (AllBlocksCleared), a new engine process")
    fx.line("worker 0 1")
    engine = VllmEngine(v, name, B, 40, 1, buffer_steps=8)
    work = Workload(21, B)
    run_requests(fx, engine, 0, work, 10)

    def dropped_then_next(n_dropped):
        """Serve requests until n_dropped messages were published and not delivered; the next
        message is delivered after the publisher's answer to the replay the feed will ask for."""
        first = None
        while n_dropped:
            tokens = work.next()
            hit, all_tokens = engine.serve(tokens, 2)
            work.done(all_tokens)
            msg = engine.publish()
            if msg is not None:
                first = msg[0] if first is None else first
                n_dropped -= 1
        msg = None
        while msg is None:
            tokens = work.next()
            hit, all_tokens = engine.serve(tokens, 2)
            fx.prompt(0, hit, B, tokens, "unseen")  # kvmatch misses the dropped messages here
            work.done(all_tokens)
            msg = engine.publish()
        items = engine.replay(first)
        fx.replay(0, first, items)
        fx.live(0, msg)
        return items[0][0] - first  # seqs the publisher no longer buffered: lost

    lost = dropped_then_next(3)     # inside the buffer: replayed, exact again
    assert lost == 0
    fx.line("state 0 LIVE 0")
    run_requests(fx, engine, 0, work, 10)
    lost = dropped_then_next(12)    # beyond it
    assert lost > 0
    fx.line(f"state 0 DEGRADED {lost}")

    # DEGRADED: kvmatch missed stores and removals; not compared until the engine's reset.
    run_requests(fx, engine, 0, work, 5, "unseen", "unseen")
    if not engine.manager.reset_prefix_cache():
        raise RuntimeError("check-engines: reset_prefix_cache refused (a request still runs)")
    fx.live(0, engine.publish())     # AllBlocksCleared: complete again
    fx.line(f"state 0 LIVE {lost}")
    run_requests(fx, engine, 0, work, 10)
    engine.shutdown()
    engine = VllmEngine(v, name + "-restarted", B, 40, 1, buffer_steps=8)
    fx.forget(0)
    # The new process's first request arrives before it has published anything: kvmatch still
    # holds the old process's blocks for it, so that one is not compared.
    run_requests(fx, engine, 0, work, 15, "unseen")
    fx.line(f"state 0 LIVE {lost}")
    engine.shutdown()
    made.append((name, fx.close()))
    for name, n in made:
        print(f"check-engines: {name}: {n}")


# ---- vLLM's OffloadingConnector: the CPU tier ---------------------------------------------------

OFFLOAD = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
VLLM_OFFLOAD_REAL = [
    OFFLOAD + ".scheduler", OFFLOAD + ".common", OFFLOAD + ".events", OFFLOAD + ".metrics",
    OFFLOAD + ".config",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.v1.kv_offload.base", "vllm.v1.kv_offload.config", "vllm.v1.kv_offload.factory",
    "vllm.v1.kv_offload.cpu.manager", "vllm.v1.kv_offload.cpu.common",
    "vllm.v1.kv_offload.cpu.policies.base", "vllm.v1.kv_offload.cpu.policies.factory",
    "vllm.v1.kv_offload.cpu.policies.lru", "vllm.v1.kv_offload.cpu.policies.arc",
    "vllm.v1.metrics.cache_hit_source",
]


def load_vllm_offload(v):
    """The OffloadingConnector's scheduler side and the CPU manager, from the same wheel."""
    import importlib
    v.importer.real.update(VLLM_OFFLOAD_REAL)
    # kv_connector/utils.py needs torch and the model executor; the scheduler side calls only its
    # yield_req_data, whose source is taken from the wheel.
    src = v.importer.zip.read("vllm/distributed/kv_transfer/kv_connector/utils.py").decode()
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "yield_req_data")
    # The connector sizes a token's KV (for its synchronous-load budget, which is off) from the
    # spec's dtype: the specs here name none, taken as 2 bytes (float16).
    for m in ("vllm.utils.torch_utils", "vllm.v1.kv_cache_interface"):
        importlib.import_module(m).get_dtype_size = lambda dtype: 2
    utils = stub("vllm.distributed.kv_transfer.kv_connector.utils")
    exec("from collections.abc import Iterator\n" + ast.get_source_segment(src, fn),
         utils.__dict__)
    return types.SimpleNamespace(
        scheduler=importlib.import_module(OFFLOAD + ".scheduler"),
        common=importlib.import_module(OFFLOAD + ".common"),
        base=importlib.import_module("vllm.v1.kv_offload.base"),
        config=importlib.import_module("vllm.v1.kv_offload.config"),
        cpu=importlib.import_module("vllm.v1.kv_offload.cpu.manager"))


class OffloadEngine(VllmEngine):
    """One vLLM engine core with the OffloadingConnector (CPU tier): its KVCacheManager and the
    connector's scheduler side (OffloadingConnectorScheduler with vLLM's CPUOffloadingManager,
    LRU, `cpu_chunks` chunks of one block each) driven step by step as vLLM's Scheduler drives
    them, one request at a time. This driver plays the worker: a store job submitted in one step
    is reported finished `store_delay(rng)` steps later (at least 1: the worker submits a step's
    stores at the start of the next) and never before an earlier store, a job the scheduler asks
    to flush (and the stores before it) in that step, and a load job in the step after it was
    scheduled. Every step's events (the KVCacheManager's, then the
    connector's take_events, as Scheduler.update_from_output collects them) go out in one
    message of the engine's ZmqEventPublisher."""

    def __init__(self, v, o, name, block_size, num_blocks, cpu_chunks, rng, blocks_per_chunk=1,
                 self_describing=True):
        super().__init__(v, name, block_size, num_blocks)
        self.o, self.rng = o, rng
        c = o.config
        config = c.OffloadingConfig(
            groups=(c.OffloadingGroupConfig(tokens_per_block=block_size,
                                            layer_names=("layer.0",), group_id=0),),
            worker_kv_bytes_per_block=2 * block_size * 8 * 2, enable_kv_cache_events=True,
            extra_config={"self_describing_kv_events": self_describing},
            engine_id=name, model=c.OffloadingModelConfig(name="check-engines", dtype="float16"),
            cache=c.OffloadingCacheConfig(tokens_per_hash=block_size,
                                          blocks_per_chunk=blocks_per_chunk),
            parallel=c.OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False))
        manager = o.cpu.CPUOffloadingManager(num_chunks=cpu_chunks, cache_policy="lru",
                                             enable_events=True)

        class CPUSpec(o.base.OffloadingSpec):
            """CPUOffloadingSpec's scheduler half: its manager (the worker half, which moves
            the KV, is this driver)."""
            def get_manager(self):
                return manager

            def get_worker(self, kv_caches):
                raise RuntimeError("check-engines: no worker side")

        # The attributes of VllmConfig the connector's scheduler side reads, as vLLM's defaults
        # set them for one GPU with prefix caching.
        vllm_config = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(prefix_cache_retention_interval=None,
                                               enable_prefix_caching=True),
            speculative_config=None,
            parallel_config=types.SimpleNamespace(world_size=1, decode_context_parallel_size=1))
        self.connector = o.scheduler.OffloadingConnectorScheduler(
            CPUSpec(config), vllm_config, self.manager.kv_cache_config)
        self.jobs = {}          # job id -> the step the worker reports it finished
        self.last_store_due = 0
        self.waiting = {}       # request id -> a request whose load is planned
        self.loads = {}         # load job id -> its request
        self.steps = 0
        self.messages = []

    @staticmethod
    def store_delay(rng):
        return rng.choice((1, 1, 2, 3))

    def step(self, new=(), cached=(), finished=()):
        """One engine step: `new` requests scheduled with their whole block table, `cached` ones
        with the blocks allocated this step ((request, n_tokens, new block ids)), `finished` ones
        done. The connector builds its metadata, the worker reports the jobs due, the step's
        events are published. Returns the requests whose load finished."""
        out = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(
                req_id=r.request_id, block_ids=self.manager.get_block_ids(r.request_id))
                for r, _ in new],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[r.request_id for r, _, _ in cached],
                new_block_ids=[ids for _, _, ids in cached], resumed_req_ids=set()),
            num_scheduled_tokens={r.request_id: n for r, n, *_ in list(new) + list(cached)},
            finished_req_ids={r.request_id for r in finished}, preempted_req_ids=set(),
            kv_cache_block_copies=None, kv_connector_block_state=None)
        meta = self.connector.build_connector_meta(out)
        self.steps += 1
        # vLLM's CPU worker runs each direction's transfers in the order submitted and reports
        # them in that order (SingleDirectionOffloadingHandler): a store finishes no earlier than
        # the stores before it, and waiting for a flushed one finishes those too.
        for job in sorted(meta.store_jobs):
            self.last_store_due = max(self.last_store_due, self.steps + self.store_delay(self.rng))
            self.jobs[job] = self.last_store_due
        for job, transfer in meta.load_jobs.items():
            self.jobs[job] = self.steps + 1
            self.loads[job] = self.waiting.pop(transfer.req_id)
        if meta.jobs_to_flush:
            flushed = max(meta.jobs_to_flush)
            for job in self.jobs:
                if job <= flushed and job not in self.loads:
                    self.jobs[job] = self.steps
        for r, n, *_ in list(new) + list(cached):
            r.num_computed_tokens += n
        done = sorted(j for j, due in self.jobs.items() if due <= self.steps)
        loaded = []
        for j in done:
            del self.jobs[j]
            if j in self.loads:
                loaded.append(self.loads.pop(j))
        worker_meta = self.o.common.OffloadingWorkerMetadata(completed_jobs={j: 1 for j in done})
        self.connector.update_connector_output(
            types.SimpleNamespace(kv_connector_worker_meta=worker_meta))
        for r in loaded:  # Scheduler._update_waiting_for_remote_kv
            self.manager.cache_blocks(r, r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:
                r.num_computed_tokens -= 1
        events = self.manager.take_events() or []
        events.extend(self.connector.take_events())
        if events:
            self.n_batches += 1
            self.publisher.publish(self.v.kv.KVEventBatch(ts=float(self.n_batches), events=events))
            topic, seq, payload = self.sub.recv_multipart()
            self.messages.append((int.from_bytes(seq, "big"), payload))
        return loaded

    def take_messages(self):
        out, self.messages = self.messages, []
        return out

    def admit(self, tokens, n_output):
        """A new request arrives: returns its admission (request, GPU hit blocks, GPU hit and
        connector hit in tokens, whether the connector loads asynchronously), the engine's own
        hit as Scheduler.schedule takes it (get_computed_blocks, then the connector's
        get_num_new_matched_tokens from there)."""
        v = self.v
        self.n_requests += 1
        r = v.request.Request(f"r{self.n_requests}", list(tokens), SamplingParams(n_output), None,
                              block_hasher=self.hasher)
        self.connector.on_new_request(r)
        blocks, local, _ = self.manager.get_computed_blocks(r)
        external, load_async = self.connector.get_num_new_matched_tokens(r, local)
        if external is None:
            raise RuntimeError("check-engines: the connector deferred a lookup")
        return types.SimpleNamespace(request=r, blocks=blocks, local=local, external=external,
                                     load_async=load_async)

    def serve_admitted(self, admission):
        """Serve an admitted request to its end: the load from the CPU if the connector hit, the
        prefill, one decode step per output token, the finish."""
        r, blocks, local = admission.request, admission.blocks, admission.local
        external, n = admission.external, admission.request.num_tokens
        if external:
            assert admission.load_async
            if self.manager.allocate_slots(r, 0, local, blocks,
                                           num_external_computed_tokens=external,
                                           delay_cache_blocks=True) is None:
                raise RuntimeError("check-engines: the block pool is too small for one request")
            self.connector.update_state_after_alloc(r, self.manager.get_blocks(r.request_id),
                                                    external)
            r.num_computed_tokens = local + external
            self.waiting[r.request_id] = r
            self.step()
            while r in self.loads.values():
                self.step()
            new = self.manager.allocate_slots(r, n - r.num_computed_tokens)
        else:
            new = self.manager.allocate_slots(r, n - local, local, blocks)
        if new is None:
            raise RuntimeError("check-engines: the block pool is too small for one request")
        self.connector.update_state_after_alloc(r, self.manager.get_blocks(r.request_id), 0)
        self.step(new=[(r, n - r.num_computed_tokens)])
        n_output = r.sampling_params.max_tokens
        for i in range(n_output):
            r.append_output_token_ids(7000 + (self.n_requests * 31 + i) % 97)
            if i == n_output - 1:
                break
            new = self.manager.allocate_slots(r, 1)
            if new is None:
                raise RuntimeError("check-engines: the block pool is too small for one request")
            self.step(cached=[(r, 1, new.get_block_ids(allow_none=True))])
        r.status = self.v.request.RequestStatus.FINISHED_LENGTH_CAPPED
        self.connector.request_finished(r)
        self.manager.free(r)
        self.step(finished=[r])
        return r.all_token_ids[:]

    def drain(self):
        """Steps without requests until the worker has reported every job."""
        while self.jobs:
            self.step()


def vllm_offload_scenarios(v, out_dir):
    """vLLM's OffloadingConnector with the CPU tier: the engine's hit (the GPU prefix hit, then
    the connector's CPU hit from there) against kvmatch's depth from the events both published."""
    o = load_vllm_offload(v)
    B = 4
    made = []
    # self_describing False is vLLM's default: each CPU store is a placeholder BlockStored (the
    # chunk's key hash, block_size 0), each removal a BlockRemoved of that hash.
    for name, gpu_blocks, cpu_chunks, per_chunk, seed, self_describing in (
            ("vllm_engine_offload_cpu", 24, 40, 1, 81, True),
            ("vllm_engine_offload_cpu_chunk2", 24, 20, 2, 83, True),
            ("vllm_engine_offload_cpu_placeholders", 24, 40, 1, 81, False),
            ("vllm_engine_offload_cpu_placeholders_chunk2", 24, 20, 2, 83, False)):
        rng = random.Random(seed)
        fx = EngineFixture(out_dir, name, B, 0,
                           f"{v.wheel}: KVCacheManager ({gpu_blocks} blocks) and the "
                           f"OffloadingConnector's scheduler side (CPUOffloadingManager, LRU, "
                           f"{cpu_chunks} chunks of {per_chunk} block{'s' if per_chunk > 1 else ''}"
                           f", {'self-describing' if self_describing else 'placeholder'} CPU "
                           "events), stores reported finished 1-3 steps late, 80 requests",
                           offload_chunk_blocks=per_chunk)
        fx.line("worker 0 1")
        fx.line(f"offload 0 {per_chunk}")
        engine = OffloadEngine(v, o, name, B, gpu_blocks, cpu_chunks, rng, per_chunk,
                               self_describing)
        work = Workload(seed, B)
        host_hits = 0
        for i in range(80):
            tokens = work.next()
            admission = engine.admit(tokens, work.rng.randrange(1, 7))
            local, external = admission.local, admission.external
            # vLLM recomputes a prompt's last token even after loading it
            # (Scheduler._update_waiting_for_remote_kv): the hit is what it does not compute.
            total = min(local + external, (len(tokens) - 1) // B * B)
            # Exact unless the engine's CPU holds a block whose placeholder store named no block
            # kvmatch held (it could not place it).
            exact = not fx.unknown_cpu
            fx.prompt(0, total, B, tokens, "exact" if exact else "bound",
                      host=(total - local) // B)
            host_hits += total > local
            all_tokens = engine.serve_admitted(admission)
            for m in engine.take_messages():
                fx.live(0, m)
            work.done(all_tokens)
        engine.drain()
        for m in engine.take_messages():
            fx.live(0, m)
        engine.shutdown()
        made.append((name, fx.close() + f"; {host_hits} prompts hit the CPU tier"))
    for name, n in made:
        print(f"check-engines: {name}: {n}")


# ---- SGLang's RadixCache (a separate process: it needs torch) ----------------------------------

SGLANG_REAL = [
    "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params", "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.cpp_utils.native_hash", "sglang.srt.utils.cpp_extension_loader",
    "sglang.srt.disaggregation.kv_events",
]


class _SglangImporter(_WheelImporter):
    """As _WheelImporter, from files extracted to `root`: the native hash's C++ source is compiled
    from its module's directory (torch.utils.cpp_extension)."""

    def __init__(self, wheel, root, real=SGLANG_REAL):
        super().__init__(wheel, real, {"sglang"})
        self.root = root
        self.zip.extractall(root, [n for n in self.names if n.startswith("sglang/srt/")])

    def exec_module(self, m):
        if m.__name__ not in self.real:
            return
        m.__file__ = os.path.join(self.root, m.__name__.replace(".", "/") + ".py")
        if not os.path.exists(m.__file__):  # a package
            m.__file__ = os.path.join(self.root, m.__name__.replace(".", "/"), "__init__.py")
        with open(m.__file__, encoding="utf-8") as f:
            exec(compile(f.read(), m.__file__, "exec"), m.__dict__)


class _NoKvPool:
    """The token-to-KV allocator RadixCache.create_simulated takes: evict() hands back the evicted
    node's slots, which a simulated cache has nowhere to put."""
    device = "cpu"

    def free_segment(self, value, start_pos=0):
        pass


def sglang_radix_scenario(wheel_dir, out_dir):
    """SGLang's own RadixCache (create_simulated: the tree, its eviction and its KV-event recorder,
    without memory pools) serves prompts on a capacity of 160 tokens: each prompt's hit is
    match_prefix over the prompt without its last token (the scheduler always computes that
    one), then the prompt and its output are inserted and the least recently used leaves evicted
    down to the capacity; the recorded events are encoded with SGLang's own KVEventBatch."""
    import tempfile
    from array import array
    wheels = glob.glob(os.path.join(wheel_dir, "sglang-*.whl"))
    if not wheels:
        sys.exit(f"check-engines: no SGLang wheel in {wheel_dir}")
    root = tempfile.mkdtemp(prefix="check-engines-sglang-")
    sys.meta_path.insert(0, _SglangImporter(wheels[0], root))
    import importlib
    import torch
    rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    kv = importlib.import_module("sglang.srt.disaggregation.kv_events")
    ev = importlib.import_module("sglang.srt.mem_cache.events")
    B, capacity = 4, 160
    enc = msgspec.msgpack.Encoder()

    def run(name, seed, namespaces, what):
        """60 prompts, each in a namespace (cache_salt, LoRA adapter name) drawn from namespaces
        (a conversation coming back keeps its own, mostly)."""
        names = ev.KvEventLoraNames()
        cache = rc.RadixCache.create_simulated(mock_allocator=_NoKvPool(), page_size=B,
                                               enable_kv_cache_events=True,
                                               kv_event_lora_names=names)
        fx = EngineFixture(out_dir, name, B, 0,
                           f"{os.path.basename(wheels[0])}: RadixCache, page size {B}, "
                           f"{capacity} tokens, 60 requests{what}")
        fx.line("worker 0 1")
        seq = 0

        def publish():
            nonlocal seq
            events = cache.take_events()
            if events:
                fx.live(0, (seq, enc.encode(kv.KVEventBatch(ts=float(seq), events=events))))
                seq += 1

        def extra_key(lora):
            """SGLang's Req ends a LoRA request's extra_key with its 32-character lora_id and
            names the namespace in the KV-event LoRA table when the request is admitted."""
            if not lora:
                return None
            lora_id = lora.encode().hex().ljust(32, "0")[:32]
            key = "engine-extra-" + lora_id
            names.register(types.SimpleNamespace(extra_key=key, lora_id=lora_id), lora)
            return key

        publish()  # the AllBlocksCleared of the tree's reset
        work = Workload(seed, B)
        conversation_space = {}
        for i in range(60):
            tokens = work.next()
            turn = next((k for k in conversation_space if tuple(tokens[:len(k)]) == k), None)
            space = conversation_space.pop(turn) if turn else namespaces[0]
            if len(namespaces) > 1 and (turn is None or work.rng.random() < 0.2):
                space = work.rng.choice(namespaces)
            salt, lora = space
            key = rc.RadixKey(array("q", tokens[:-1]), extra_key(lora), cache_salt=salt)
            hit = cache.match_prefix(base.MatchPrefixParams(key=key)).device_prefix_len
            fx.prompt(0, hit, B, tokens, salt=salt, lora=lora)
            output = [7000 + (i * 31 + k) % 97 for k in range(work.rng.randrange(1, 7))]
            everything = list(tokens) + output
            cache.insert(base.InsertParams(
                key=rc.RadixKey(array("q", everything), extra_key(lora), cache_salt=salt),
                value=torch.arange(len(everything))))
            if cache.total_size() > capacity:
                cache.evict(base.EvictParams(num_tokens=cache.total_size() - capacity))
            publish()
            work.done(everything)
            conversation_space[tuple(everything)] = space
        print(f"check-engines: {name}: {fx.close()}")

    run("sglang_engine_radix", 53, [(None, None)], "")
    run("sglang_engine_salt", 59,
        [(None, None), ("tenant-a", None), ("tenant-b", None), (None, "sql-adapter"),
         ("tenant-a", "sql-adapter")],
        ", cache_salt and LoRA requests sharing prompt texts with plain ones")
    print("check-engines: placeholders bound (never called): " + ", ".join(sorted(PLACEHOLDERS)))
    import shutil
    shutil.rmtree(root, ignore_errors=True)


# ---- SGLang's host tier, HiCache (a separate process: it needs torch) -------------------------

SGLANG_HICACHE_REAL = SGLANG_REAL + [
    "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.mem_cache.unified_cache",
    "sglang.srt.mem_cache.unified_cache.cache_action",
    "sglang.srt.mem_cache.unified_cache.components",
    "sglang.srt.mem_cache.unified_cache.components.base",
    "sglang.srt.mem_cache.unified_cache.components.full",
    "sglang.srt.mem_cache.unified_cache.component_type",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface",
    "sglang.srt.mem_cache.unified_cache.tree_core_registry",
    "sglang.srt.mem_cache.unified_cache.session_ref_tracker",
    "sglang.srt.mem_cache.unified_cache.storage_attachment",
    "sglang.srt.mem_cache.buffer_mode.storage_existence_cache",
    "sglang.srt.mem_cache.storage_prefetch", "sglang.srt.session.streaming_session",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.environ", "sglang.srt.utils.rank_consensus_checker",
]


class _HiCacheClock:
    """The driver's step counter: a transfer is done once the step it is due at is reached."""
    step = 0


class _TransferEvent:
    """Stands in for a device event: query() is true once the driver's clock reaches `due`;
    synchronize() (a blocking wait in SGLang) completes it there and then."""

    def __init__(self, clock, due):
        self.clock, self.due = clock, due

    def query(self):
        return self.clock.step >= self.due

    def synchronize(self):
        self.due = min(self.due, self.clock.step)

    def record(self, *args):
        pass


class _DeviceSlots:
    """The token-to-KV allocator: device slot numbers from a free list (no KV tensors)."""
    device = "cpu"

    def __init__(self, size):
        import torch
        self.torch, self.size, self.size_full = torch, size, size
        self.free_slots = list(range(size))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return self.torch.tensor(taken, dtype=self.torch.int64)

    def free(self, indices):
        freed = [int(i) for i in indices]
        assert not set(freed) & set(self.free_slots), "a device slot freed twice"
        self.free_slots.extend(freed)

    def free_segment(self, indices, start_pos=0):
        self.free(indices)

    def mamba_full_cache_donor(self):
        return None  # no Mamba pool


class _HostSlots:
    """The host pool group (mem_pool_host) and its one pool, the KV pool: host slot numbers from a
    free list, allocated in whole pages as SGLang's host pool allocates them (no host tensors,
    nothing pinned; a slot freed twice fails the run)."""
    size_per_token = 0

    def __init__(self, size, page_size):
        import torch
        self.torch, self.size, self.page_size = torch, size, page_size
        self.anchor_entry = types.SimpleNamespace(
            host_pool=types.SimpleNamespace(shared_allocation_domain=None), host_evict_fn=None)
        self.entry_map, self.entries = {}, []
        self.clear()

    def clear(self):
        self.free_slots = list(range(self.size))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n, reclaim=None, start_owner=None):
        assert n % self.page_size == 0
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return self.torch.tensor(taken, dtype=self.torch.int64)

    def free(self, indices, pool=None):
        freed = [int(i) for i in indices]
        assert not set(freed) & set(self.free_slots), "a host slot freed twice"
        self.free_slots.extend(freed)
        return len(indices)

    def get_pool(self, name):
        return self  # the group's only pool, its KV pool

    def resolve_host_transfers(self, extra_pools, primary_device_indices, primary_host_indices):
        assert not extra_pools
        return None

    def destroy(self):
        pass


class _HiCacheAck(types.SimpleNamespace):
    """managers/cache_controller.py's HiCacheAck, with the fields the cache reads."""


class _HiCacheController:
    """Stands in for HybridCacheController: the same queues and calls, moving no bytes. write()
    allocates host slots and queues the operation; start_writing() merges the queue into one ack
    whose event is done `store_delay()` steps later, never before an earlier ack's (SGLang's
    device-to-host stream runs its copies in order); load() allocates device slots and queues;
    start_loading() acks at once (the forward waits for the loaded layers before using them)."""
    enable_storage = False
    storage_backend = None
    layer_done_counter = None
    transfer_layer_id_max = 0

    def __init__(self, write_policy, host, device, clock, store_delay):
        self.write_policy, self.mem_pool_host, self.device = write_policy, host, device
        self.clock, self.store_delay = clock, store_delay
        self.reset()

    def reset(self):
        self.write_queue, self.load_queue = [], []
        self.ack_write_queue, self.ack_load_queue = [], []
        self.last_write_due = 0

    def write(self, device_indices, priority=None, node_id=-1, extra_pools=None, flush=True,
              start_owner=None):
        assert not extra_pools
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.write_queue.append((node_id, len(device_indices)))
        if flush:
            self.start_writing()
        return host_indices

    def start_writing(self):
        if not self.write_queue:
            return
        self.last_write_due = max(self.last_write_due, self.clock.step + self.store_delay())
        event = _TransferEvent(self.clock, self.last_write_due)
        self.ack_write_queue.append(_HiCacheAck(
            start_event=event, finish_event=event, node_ids=[n for n, _ in self.write_queue],
            num_tokens=sum(t for _, t in self.write_queue), timing_enabled=False,
            num_tokens_by_pool=None, num_bytes=0))
        self.write_queue = []

    def load(self, host_indices, priority=None, node_id=-1, extra_pools=None, *,
             device_indices=None, anchor_indices=None):
        assert not extra_pools and device_indices is None
        device_indices = self.device.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append((node_id, len(host_indices)))
        return device_indices

    def start_loading(self):
        if not self.load_queue:
            return -1
        event = _TransferEvent(self.clock, self.clock.step)
        self.ack_load_queue.append(_HiCacheAck(
            start_event=event, finish_event=event, node_ids=[n for n, _ in self.load_queue],
            num_tokens=sum(t for _, t in self.load_queue), timing_enabled=False,
            num_tokens_by_pool=None, num_bytes=0))
        self.load_queue = []
        return 0


def sglang_hicache_scenario(wheel_dir, out_dir):
    """SGLang's own host tier: UnifiedRadixCache with HiCache (its tree core, write policy, device
    and host eviction, match_prefix's host part, load_back and KV-event recorder) on a device pool
    small enough to evict and a host pool small enough to evict too; the byte-moving parts are
    stand-ins (_HiCacheController, _HostSlots, _DeviceSlots). Each prompt's hit is match_prefix's
    device part plus what init_load_back then loads from the host part, as the scheduler admits
    a request; the recorded events are encoded with SGLang's own KVEventBatch."""
    import tempfile
    from array import array
    wheels = glob.glob(os.path.join(wheel_dir, "sglang-*.whl"))
    if not wheels:
        sys.exit(f"check-engines: no SGLang wheel in {wheel_dir}")
    root = tempfile.mkdtemp(prefix="check-engines-sglang-")
    sys.meta_path.insert(0, _SglangImporter(wheels[0], root, SGLANG_HICACHE_REAL))
    import importlib
    import torch
    settings = {}
    stub("sglang.srt.runtime_context",
         get_memory=lambda: types.SimpleNamespace(
             hicache_host_memory_mode="cache", hicache_storage_backend=None,
             hicache_write_policy=settings["policy"],
             hicache_storage_prefetch_policy="best_effort"),
         get_observability=lambda: types.SimpleNamespace(extra_metric_labels=None),
         get_disagg=lambda: types.SimpleNamespace(disaggregation_mode="null"),
         get_parallel=None, get_model=None, get_serving=None)

    def attach(cache, params, server_args, **kwargs):
        """hybrid_pool_assembler's attach_hybrid_pool_to_unified_cache for a FULL-only tree, as
        its _apply_stack_result: the host pool group, the controller and the FULL component's
        host pool (the group's KV pool); no sidecar pools."""
        cache.host_pool_group = settings["host"]
        cache.cache_controller = settings["controller"]
        cache.full_kv_pool_host = cache.host_pool_group.get_pool("kv")
        cache.components[ct.ComponentType.FULL]._full_kv_pool_host = cache.full_kv_pool_host

    # A stock allocator: no page-interleaved shard groups.
    stub("sglang.srt.mem_cache.allocator.page_interleave",
         page_interleave_shard_size=lambda allocator: 1)
    stub("sglang.srt.mem_cache.hybrid_cache")
    stub("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
         attach_hybrid_pool_to_unified_cache=attach)
    urc = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    ct = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    kv = importlib.import_module("sglang.srt.disaggregation.kv_events")
    B = 4
    enc = msgspec.msgpack.Encoder()

    def run(name, policy, seed, device_slots, host_slots, n_requests, max_delay):
        rng = random.Random(seed)
        clock = _HiCacheClock()
        device = _DeviceSlots(device_slots)
        host = _HostSlots(host_slots, B)
        settings.update(policy=policy, host=host, controller=_HiCacheController(
            policy, host, device, clock, lambda: rng.randrange(1, max_delay + 1)))
        params = cip.CacheInitParams(disable=False, req_to_token_pool=None,
                                     token_to_kv_pool_allocator=device, page_size=B,
                                     enable_kv_cache_events=True,
                                     tree_components=(ct.ComponentType.FULL,),
                                     tree_core_backend="python")
        cache = urc.UnifiedRadixCache(params)
        cache.init_hicache(types.SimpleNamespace(file_storage_path=None), params)
        fx = EngineFixture(out_dir, name, B, 0,
                           f"{os.path.basename(wheels[0])}: UnifiedRadixCache with HiCache "
                           f"({policy}), page size {B}, {device_slots} device and {host_slots} "
                           f"host slots, writes acknowledged 1-{max_delay} steps late, "
                           f"{n_requests} requests")
        fx.line("worker 0 1")
        # SGLang loads a host hit back only from load_back_threshold tokens on.
        fx.line(f"hicache 0 {-(-cache.load_back_threshold // B)}")
        seq = 0

        def publish():
            nonlocal seq
            events = cache.take_events()
            if events:
                fx.live(0, (seq, enc.encode(kv.KVEventBatch(ts=float(seq), events=events))))
                seq += 1

        work = Workload(seed, B)
        root_id = cache.root_node_handle()
        loads = declined = waits = 0
        publish()  # the AllBlocksCleared of the tree's reset
        for i in range(n_requests):
            # A scheduler step: submit the queued backups, take the acknowledged transfers.
            clock.step += 1
            cache.check_hicache_events()
            publish()
            tokens = work.next()
            # The scheduler matches all but the prompt's last token, which it always computes.
            m = cache.match_prefix(base.MatchPrefixParams(
                key=rc.RadixKey(array("q", tokens[:-1]))))
            req = types.SimpleNamespace(rid=str(i), last_node=m.last_device_node,
                                        swa_host_hit_length=0, mamba_host_hit_length=0,
                                        kv=types.SimpleNamespace(mamba_pool_idx=None))
            loaded = 0
            if m.host_hit_length > 0:
                # As the scheduler's admission: the host match pinned while loading back.
                host_lock = cache.inc_host_lock_ref(m.best_match_node).to_dec_params()
                loaded, req.last_node = cache.init_load_back(base.InitLoadBackParams(
                    best_match_node=m.best_match_node, host_hit_length=m.host_hit_length,
                    req=req))
                cache.dec_host_lock_ref(m.best_match_node, host_lock)
                # These runs' pools always fit a load back: only the threshold declines one.
                assert loaded > 0 or m.host_hit_length < cache.load_back_threshold
                declined += loaded == 0
                loads += loaded > 0
                cache.ready_to_load_host_cache()
            hit = m.device_prefix_len + loaded
            fx.prompt(0, hit, B, tokens, host=loaded // B)
            # The request runs on its prefix (locked) and new slots, then is cached: the tree
            # frees the slots of what it already held past the prefix.
            lock = cache.inc_lock_ref(req.last_node).to_dec_params()
            waits_now = 0
            prefix = cache.tree_core.collect_full_device_indices(req.last_node, root_id)
            assert len(prefix) == hit, (len(prefix), hit)
            output = [7000 + (i * 31 + k) % 97 for k in range(work.rng.randrange(1, 7))]
            everything = list(tokens) + output
            need = len(everything) - hit
            while device.available_size() < need:
                cache.evict_for_alloc(base.EvictParams(
                    num_tokens=need - device.available_size()))
                if device.available_size() >= need:
                    break
                # What is left is locked by writes not yet acknowledged: wait a step for them,
                # as the scheduler waits to admit the request.
                assert waits_now < max_delay, "the device pool is too small for a request"
                waits_now += 1
                clock.step += 1
                cache.check_hicache_events()
            waits += waits_now > 0
            new = device.alloc(need)
            value = torch.cat([prefix, new])
            aligned = len(everything) // B * B
            cache.insert(base.InsertParams(key=rc.RadixKey(array("q", everything[:aligned])),
                                           value=value[:aligned], prev_prefix_len=hit))
            device.free(value[aligned:])
            cache.dec_lock_ref(req.last_node, lock)
            publish()
            work.done(everything)
        # Every slot is free or held by the tree: the stand-ins lost none.
        held = {"value": 0, "host_value": 0}
        nodes = list(cache.tree_core.root_node.children.values())
        while nodes:
            node = nodes.pop()
            nodes.extend(node.children.values())
            for field in held:
                part = getattr(node.component_data[ct.ComponentType.FULL], field)
                held[field] += 0 if part is None else len(part)
        assert held["value"] + device.available_size() == device_slots, "device slots lost"
        assert held["host_value"] + host.available_size() == host_slots, "host slots lost"
        print(f"check-engines: {name}: {fx.close()}; {loads} prompts loaded host blocks back, "
              f"{declined} host hits below the load-back threshold, {waits} requests waited for "
              "writes to free device slots")

    run("sglang_engine_hicache", "write_through", 61, 128, 320, 200, 3)
    run("sglang_engine_hicache_selective", "write_through_selective", 67, 128, 320, 100, 3)
    run("sglang_engine_hicache_write_back", "write_back", 71, 128, 320, 200, 3)
    print("check-engines: placeholders bound (never called): " + ", ".join(sorted(PLACEHOLDERS)))
    import shutil
    shutil.rmtree(root, ignore_errors=True)

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--sglang-radix":
        if len(sys.argv) < 4:
            sys.exit(__doc__)
        sglang_radix_scenario(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--sglang-hicache":
        if len(sys.argv) < 4:
            sys.exit(__doc__)
        sglang_hicache_scenario(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-offload":
        if len(sys.argv) < 4:
            sys.exit(__doc__)
        vllm_offload_scenarios(load_vllm(sys.argv[2]), sys.argv[3])
        print("check-engines: placeholders bound (never called): "
              + ", ".join(sorted(PLACEHOLDERS)))
        return
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    wheel_dir = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) > 2 else "tests/engine_fixtures"
    os.makedirs(out_dir, exist_ok=True)
    v = load_vllm(wheel_dir)
    vllm_scenarios(v, out_dir)
    vllm_hybrid_scenario(v, out_dir)
    vllm_engine_scenarios(v, out_dir)
    kv, wheel = load_sglang(wheel_dir)
    sglang_scenarios(kv, wheel, out_dir)
    print(f"check-engines: fixtures written to {out_dir}")
    print("check-engines: placeholders bound (never called): " + ", ".join(sorted(PLACEHOLDERS)))


if __name__ == "__main__":
    main()
