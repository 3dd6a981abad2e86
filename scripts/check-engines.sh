#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# make check-engines: fetch vLLM's and SGLang's wheels (pip download --no-deps, into the git-ignored
# .engine-wheels/), run vLLM's own KVCacheManager and ZmqEventPublisher through request sequences
# and encode KV-event scenarios with the engines' own event classes and encoders
# (scripts/check-engines.py), and check that kvmatch predicts, prompt by prompt, the engine's own
# prefix-cache hit (with the OffloadingConnector's CPU tier too: the GPU hit, then the connector's
# CPU hit from there), and ends with exactly the index the encoding scenarios predict (the
# engine_fixtures suite of build/kvmatch-tests). The fixtures are written to tests/engine_fixtures/,
# which `make test` checks on every run; a difference from the committed ones is reported.
#
# SGLang's own RadixCache needs torch: its wheel (the version SGLang pins) and the four NVIDIA
# wheels whose libraries `import torch` loads and the CUDA toolkit lacks are fetched the same way
# (--no-deps) into a venv of their own, .engine-wheels/torch-venv; the CUDA 13 toolkit's libraries,
# a C++ compiler, ninja, Python's headers and OpenSSL's (SGLang compiles its native block hash)
# must be on the host. When torch cannot be imported or that scenario fails, it is reported as
# skipped, with the reason, and its committed fixture stays as it is. SGLang's host tier (HiCache)
# runs in the same venv and is skipped the same way.
#
# VLLM_VERSION / SGLANG_VERSION / TORCH_VERSION pick other versions (default 0.33.0, 0.5.23 and
# 2.14.1); KM_TESTS names the test binary (default build/kvmatch-tests).
set -eu
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
KM_TESTS=${KM_TESTS:-build/kvmatch-tests}
CACHE=.engine-wheels

mkdir -p "$CACHE"
if ! ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl >/dev/null 2>&1 ||
   ! ls "$CACHE"/sglang-"$SGLANG_VERSION"-*.whl >/dev/null 2>&1; then
    python3 -m pip download --no-deps -d "$CACHE" "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
fi
if [ ! -x "$CACHE/venv/bin/python" ]; then
    python3 -m venv "$CACHE/venv"
fi
# pip through the venv's python: a venv's pip script names the path it was created at.
if ! "$CACHE/venv/bin/python" -c \
        'import msgspec, xxhash, zmq, pydantic, cbor2, numpy, prometheus_client' 2>/dev/null; then
    "$CACHE/venv/bin/python" -m pip install -q msgspec xxhash pyzmq pydantic cbor2 numpy \
        prometheus_client
fi
# Only the requested versions' wheels are read.
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
ln -s "$PWD/$CACHE"/vllm-"$VLLM_VERSION"-*.whl "$PWD/$CACHE"/sglang-"$SGLANG_VERSION"-*.whl "$WHEELS"/
"$CACHE/venv/bin/python" scripts/check-engines.py "$WHEELS" tests/engine_fixtures
# vLLM's OffloadingConnector (the CPU tier) orders a transfer job's blocks by Python's set order:
# a fixed hash seed makes its fixtures repeat.
PYTHONHASHSEED=0 "$CACHE/venv/bin/python" scripts/check-engines.py --vllm-offload "$WHEELS" \
    tests/engine_fixtures

# SGLang's RadixCache, in a venv with torch.
TORCH_WHEELS="torch==$TORCH_VERSION nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.1
nvidia-nvshmem-cu13==3.4.5 nvidia-nccl-cu13==2.30.7"
sglang_radix() {
    if [ ! -x "$CACHE/torch-venv/bin/python" ]; then
        python3 -m venv "$CACHE/torch-venv" || return 1
    fi
    if ! "$CACHE/torch-venv/bin/python" -c 'import torch' 2>/dev/null; then
        # shellcheck disable=SC2086 # one requirement per word
        python3 -m pip download -q --no-deps -d "$CACHE" $TORCH_WHEELS || return 1
        "$CACHE/torch-venv/bin/python" -m pip install -q --no-deps \
            "$CACHE"/torch-"$TORCH_VERSION"-*.whl "$CACHE"/nvidia_*.whl || return 1
        "$CACHE/torch-venv/bin/python" -m pip install -q filelock typing-extensions setuptools \
            sympy networkx jinja2 fsspec numpy msgspec xxhash pyzmq pydantic cbor2 || return 1
    fi
    "$CACHE/torch-venv/bin/python" -c 'import torch' || return 1
    "$CACHE/torch-venv/bin/python" scripts/check-engines.py --sglang-radix "$WHEELS" \
        tests/engine_fixtures
}
if ! sglang_radix; then
    echo "check-engines: SGLang's RadixCache: skipped (torch or the native hash could not be" \
         "loaded: see the lines above); tests/engine_fixtures/sglang_engine_*.txt unchanged"
    git checkout -q -- tests/engine_fixtures/sglang_engine_radix.txt \
        tests/engine_fixtures/sglang_engine_salt.txt 2>/dev/null || true
fi
# SGLang's host tier (HiCache), in the same venv: its cache classes with stand-ins for the parts
# that move bytes (the controller, the host and device pools).
if ! { "$CACHE/torch-venv/bin/python" -c 'import torch' 2>/dev/null &&
        "$CACHE/torch-venv/bin/python" scripts/check-engines.py --sglang-hicache "$WHEELS" \
            tests/engine_fixtures; }; then
    echo "check-engines: SGLang's HiCache: skipped (torch or the native hash could not be" \
         "loaded, or the run failed: see the lines above);" \
         "tests/engine_fixtures/sglang_engine_hicache*.txt unchanged"
    git checkout -q -- 'tests/engine_fixtures/sglang_engine_hicache*.txt' 2>/dev/null || true
fi
"$KM_TESTS" --filter 'engine_fixtures/*'
if ! git diff --quiet -- tests/engine_fixtures; then
    echo "check-engines: tests/engine_fixtures differ from the committed ones (git diff shows how)"
fi
echo "check-engines: vLLM $VLLM_VERSION and SGLang $SGLANG_VERSION: ok"
