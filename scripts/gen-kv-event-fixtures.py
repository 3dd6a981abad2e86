#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate tests/kv_events_vectors/: KV-event payloads and ZMQ frame sequences encoded by msgspec,
the encoder vLLM and SGLang publish with, using the event struct definitions of successive vLLM
versions, plus expected.json with what the decoder (include/kvmatch/kv_events.h) must return.
The expectations are computed here in Python, independently of the C decoder.

Install the dependency with:  python3 -m pip install msgspec
Regenerate with:              python3 scripts/gen-kv-event-fixtures.py [OUTPUT_DIR]  (from the repo root)
The output is deterministic: regenerating gives the same files byte for byte.

Files:
  <name>.msgpack   one payload (the last frame of a message)
  <name>.frames    a whole multipart message: per frame, a u32 big-endian length then the bytes
  expected.json    {"fixtures": [{name, file, source: payload|live|replay, batch | kind/seq/topic,
                   error?, error_mentions?}]}; hashes as 16 hex digits (u64 ids, rule below)

Hash rule (kv_events.h): an int is taken modulo 2^64 (negative -> two's complement), bytes as
int.from_bytes(b, "big") modulo 2^64, which is what vLLM publishes with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
"""
import json
import os
import struct
import sys
from typing import Any, Optional, Union

import msgspec

MASK = (1 << 64) - 1
OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/kv_events_vectors"


# ---- vLLM's struct definitions, version by version (vllm/distributed/kv_events.py) ------------

def v08_types():
    """Early v1 events: no medium, no data_parallel_rank."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list
        parent_block_hash: Optional[int]
        token_ids: list
        block_size: int
        lora_id: Optional[int]

    class BlockRemoved(KVCacheEvent):
        block_hashes: list

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def v010_types():
    """medium on both events; data_parallel_rank on the batch."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list
        parent_block_hash: Union[int, bytes, None]
        token_ids: list
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]

    class BlockRemoved(KVCacheEvent):
        block_hashes: list
        medium: Optional[str]

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def v02x_types(array_like=True, newer_fields=False):
    """lora_name, extra_keys, group_idx, kv_cache_spec_*; trailing defaults omitted.
    array_like=False is the v0.26+ map form ({"type": ..., field: value}); newer_fields adds the
    fields later builds carry (locality, ownership, session_id) and one more event type."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    if newer_fields:
        class BlockStored(KVCacheEvent):
            block_hashes: list
            parent_block_hash: Union[int, bytes, None]
            token_ids: list
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None
            locality: Optional[str] = None
            ownership: Optional[str] = None
            session_id: Optional[str] = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list
            medium: Optional[str]
            group_idx: Optional[int] = None
            locality: Optional[str] = None
            ownership: Optional[str] = None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list
            parent_block_hash: Union[int, bytes, None]
            token_ids: list
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list
            medium: Optional[str]
            group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class BlockTransferred(KVCacheEvent):  # a type this decoder does not know: skipped, counted
        block_hashes: list
        src_medium: str
        dst_medium: str

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared, BlockTransferred


# ---- expectations, computed independently of the C decoder -----------------------------------

def hash_id(h):
    if isinstance(h, (bytes, bytearray)):
        return "%016x" % (int.from_bytes(h, "big") & MASK)
    return "%016x" % (h & MASK)


def medium_enum(m):
    if m is None:
        return "GPU"
    up = m.upper() if m.isascii() else m
    if up == "STORAGE":  # vLLM's offloading connector's storage tier
        return "DISK"
    return up if up in ("GPU", "CPU", "DISK") else "other"


def expect_event(ev, position):
    name = type(ev).__name__
    x = {"kind": name, "position": position}
    if name == "AllBlocksCleared":
        return x
    x["block_hashes"] = [hash_id(h) for h in ev.block_hashes]
    medium = getattr(ev, "medium", None)
    x["medium"] = medium_enum(medium)
    x["medium_name"] = medium
    x["group_idx"] = getattr(ev, "group_idx", None)
    if name == "BlockRemoved":
        return x
    p = ev.parent_block_hash
    x["parent_block_hash"] = None if p is None else hash_id(p)
    x["token_ids"] = list(ev.token_ids)
    x["block_size"] = ev.block_size
    x["lora_id"] = ev.lora_id
    x["lora_name"] = getattr(ev, "lora_name", None)
    extra = getattr(ev, "extra_keys", None)
    x["extra_keys_present"] = None if extra is None else [
        0 if e is None or (isinstance(e, (list, tuple)) and len(e) == 0) else 1 for e in extra]
    x["kv_cache_spec_kind"] = getattr(ev, "kv_cache_spec_kind", None)
    x["kv_cache_spec_sliding_window"] = getattr(ev, "kv_cache_spec_sliding_window", None)
    x["placeholder"] = placeholder(ev)
    return x


def placeholder(ev):
    """vLLM's OffloadingConnector store without self-describing events: block_size 0, no
    tokens, no parent, off the GPU."""
    return (ev.block_size == 0 and len(ev.token_ids) == 0 and ev.parent_block_hash is None
            and medium_enum(getattr(ev, "medium", None)) != "GPU")


def consistent(ev):
    if type(ev).__name__ != "BlockStored":
        return True
    extra = getattr(ev, "extra_keys", None)
    return ((placeholder(ev) or ev.block_size >= 1)
            and len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
            and (extra is None or len(extra) == len(ev.block_hashes)))


def expect_batch(batch, known):
    x = {"ts": batch.ts, "data_parallel_rank": getattr(batch, "data_parallel_rank", None),
         "events": [], "rejected_positions": [], "unknown_events": 0}
    for i, ev in enumerate(batch.events):
        if type(ev).__name__ not in known:
            x["unknown_events"] += 1
        elif consistent(ev):
            x["events"].append(expect_event(ev, i))
        else:
            x["rejected_positions"].append(i)
    return x


KNOWN = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
fixtures = []
os.makedirs(OUT, exist_ok=True)


def write(name, ext, data):
    with open(os.path.join(OUT, name + ext), "wb") as f:
        f.write(data)
    return name + ext


def add_payload(name, batch):
    fixtures.append({"name": name, "file": write(name, ".msgpack", msgspec.msgpack.encode(batch)),
                     "source": "payload", "batch": expect_batch(batch, KNOWN)})


def frames_bytes(frames):
    return b"".join(struct.pack(">I", len(f)) + f for f in frames)


def add_frames(name, source, frames, kind=None, seq=None, topic=None, batch=None, error=None,
               mentions=None):
    fx = {"name": name, "file": write(name, ".frames", frames_bytes(frames)), "source": source}
    if error:
        fx["error"] = error
        fx["error_mentions"] = mentions
    else:
        fx.update({"kind": kind, "seq": "%016x" % seq, "topic": topic})
        if batch is not None:
            fx["batch"] = expect_batch(batch, KNOWN)
    fixtures.append(fx)


def seq_frame(seq):
    return struct.pack(">Q", seq & MASK)


TOKENS = list(range(1000, 1032))
SHA = bytes(range(0x20, 0x40))       # 32 bytes: sha256-sized
XXH128 = bytes(range(0x80, 0x90))    # 16 bytes: xxh3-128-sized

# v0.8: positional, lora_id only, no rank.
Batch, Stored, Removed, Cleared = v08_types()
add_payload("v0.8_positional_no_rank", Batch(ts=1717000000.125, events=[
    Stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS[:32], block_size=16,
           lora_id=None),
    Stored(block_hashes=[(1 << 64) - 5], parent_block_hash=2, token_ids=TOKENS[:16], block_size=16,
           lora_id=3),
    Removed(block_hashes=[1]),
    Cleared(),
]))

# v0.10: medium and rank; hashes above 2^63 and a negative one (signed publishers).
Batch, Stored, Removed, Cleared = v010_types()
add_payload("v0.10_medium_and_rank", Batch(ts=1717000001.5, data_parallel_rank=2, events=[
    Stored(block_hashes=[0x8000000000000000, 0xFFFFFFFFFFFFFFFF], parent_block_hash=-3,
           token_ids=TOKENS[:8], block_size=4, lora_id=None, medium="GPU"),
    Removed(block_hashes=[0x8000000000000000, -1], medium="cpu"),
    Removed(block_hashes=[], medium=None),
]))
add_payload("v0.10_rank_nil", Batch(ts=12.0, data_parallel_rank=None, events=[Cleared()]))
# Bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): sha256 and xxh3-128 sizes.
add_payload("v0.10_bytes_hashes", Batch(ts=1717000002.0, data_parallel_rank=0, events=[
    Stored(block_hashes=[SHA, bytes(range(32))], parent_block_hash=XXH128, token_ids=TOKENS[:4],
           block_size=2, lora_id=None, medium="DISK"),
    Removed(block_hashes=[XXH128, SHA], medium="Disk"),
]))

# v0.2x positional: lora_name, extra_keys, group_idx, hybrid spec fields; trailing defaults omitted
# by msgspec (omit_defaults), so events have different lengths.
Batch, Stored, Removed, Cleared, Transferred = v02x_types(array_like=True)
v02x_batch = Batch(ts=1717000003.25, data_parallel_rank=1, events=[
    Stored(block_hashes=[11, 12], parent_block_hash=10, token_ids=TOKENS[:4], block_size=2,
           lora_id=None, medium="GPU", lora_name=None),
    Stored(block_hashes=[21, 22, 23], parent_block_hash=None, token_ids=TOKENS[:3], block_size=1,
           lora_id=5, medium="GPU", lora_name="sql-lora",
           extra_keys=[("sql-lora", "salt-1"), None, ("sql-lora", ("mm-hash", 0))], group_idx=0,
           kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None),
    Stored(block_hashes=[31], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16,
           lora_id=None, medium="CPU", lora_name=None, extra_keys=None, group_idx=1,
           kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096),
    Transferred(block_hashes=[31], src_medium="GPU", dst_medium="CPU"),
    Removed(block_hashes=[11], medium="GPU", group_idx=2),
    # inconsistent: 5 tokens for 2 blocks of 2 -> rejected alone
    Stored(block_hashes=[41, 42], parent_block_hash=None, token_ids=TOKENS[:5], block_size=2,
           lora_id=None, medium=None, lora_name=None),
    Cleared(),
])
add_payload("v0.2x_positional_hybrid", v02x_batch)

# v0.26+: map events, with and without the newer fields.
for newer in (False, True):
    Batch, Stored, Removed, Cleared, Transferred = v02x_types(array_like=False, newer_fields=newer)
    extra = {"locality": "LOCAL", "ownership": "owned", "session_id": "s-1"} if newer else {}
    extra_removed = {"locality": "REMOTE"} if newer else {}
    add_payload("v0.26_map" + ("_newer_fields" if newer else ""), Batch(
        ts=1717000004.0, data_parallel_rank=3, events=[
            Stored(block_hashes=[51, 52], parent_block_hash=50, token_ids=TOKENS[:32], block_size=16,
                   lora_id=None, medium="GPU", lora_name="adapter-a", extra_keys=[None, ()],
                   **extra),
            Stored(block_hashes=[SHA], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16,
                   lora_id=None, medium=None, lora_name=None),
            Transferred(block_hashes=[51], src_medium="GPU", dst_medium="DISK"),
            Removed(block_hashes=[51, 52], medium="REMOTE", group_idx=0, **extra_removed),
            Cleared(),
        ]))

# v0.33: the OffloadingConnector's placeholder stores and their removals (self-describing events
# off, vLLM's default), positional and map; the same shape on the GPU medium or with a parent is
# rejected.
for array_like in (True, False):
    Batch, Stored, Removed, Cleared, Transferred = v02x_types(array_like=array_like,
                                                              newer_fields=True)
    add_payload("v0.33_offload_placeholders" + ("" if array_like else "_map"), Batch(
        ts=1717000006.5, data_parallel_rank=0, events=[
            Stored(block_hashes=[71, 72], parent_block_hash=None, token_ids=TOKENS[:32],
                   block_size=16, lora_id=None, medium="GPU", lora_name=None),
            Stored(block_hashes=[71], parent_block_hash=None, token_ids=[], block_size=0,
                   lora_id=None, medium="CPU", lora_name=None, group_idx=0, locality="LOCAL"),
            Stored(block_hashes=[SHA], parent_block_hash=None, token_ids=[], block_size=0,
                   lora_id=None, medium="STORAGE", lora_name=None, group_idx=0),
            Stored(block_hashes=[72], parent_block_hash=None, token_ids=[], block_size=0,
                   lora_id=None, medium="GPU", lora_name=None, group_idx=0),
            Stored(block_hashes=[72], parent_block_hash=71, token_ids=[], block_size=0,
                   lora_id=None, medium="CPU", lora_name=None, group_idx=0),
            Removed(block_hashes=[71], medium="CPU", group_idx=0, locality="LOCAL"),
        ]))

# Frames: live (custom and default topic), replay in both forms, end markers in both forms.
Batch, Stored, Removed, Cleared, Transferred = v02x_types(array_like=True)
live_batch = Batch(ts=1717000005.0, data_parallel_rank=0, events=[
    Stored(block_hashes=[61], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16,
           lora_id=None, medium="GPU", lora_name=None)])
payload = msgspec.msgpack.encode(live_batch)
add_frames("live_topic", "live", [b"kv@pod-7@llama", seq_frame(5), payload], "live", 5,
           "kv@pod-7@llama", live_batch)
add_frames("live_default_topic", "live", [b"", seq_frame(0), payload], "live", 0, "", live_batch)
# A ROUTER sends [identity, b"", seq, payload]; the DEALER sees the rest.
add_frames("replay_v0.25", "replay", [b"", seq_frame(123), payload], "replay_item", 123, None,
           live_batch)
add_frames("replay_v0.26", "replay", [b"", b"kv@pod-7@llama", seq_frame(124), payload],
           "replay_item", 124, "kv@pod-7@llama", live_batch)
add_frames("replay_end_v0.25", "replay", [b"", b"\xff" * 8, b""], "replay_end", MASK, None)
add_frames("replay_end_v0.26", "replay", [b"", b"", b"\xff" * 8, b""], "replay_end", MASK, "")
add_frames("error_seq_7_bytes", "live", [b"", b"\x00" * 7, payload],
           error="KM_ERR_PARSE", mentions="has 7 bytes, expected 8")
add_frames("error_live_4_frames", "live", [b"", b"", seq_frame(1), payload],
           error="KM_ERR_PARSE", mentions="live message has 4 frames")
add_frames("error_replay_end_with_payload", "replay", [b"", b"\xff" * 8, payload],
           error="KM_ERR_PARSE", mentions="end marker")

with open(os.path.join(OUT, "expected.json"), "w") as f:
    json.dump({"generator": "scripts/gen-kv-event-fixtures.py", "msgspec": msgspec.__version__,
               "fixtures": fixtures}, f, indent=1, sort_keys=True)
    f.write("\n")
print("wrote %d fixtures to %s" % (len(fixtures), OUT))
