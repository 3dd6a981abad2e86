#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# make check-engines: fetch vLLM's and SGLang's wheels (pip download --no-deps, into the git-ignored
# .engine-wheels/), run vLLM's own KVCacheManager and ZmqEventPublisher through request sequences
# and encode KV-event scenarios with the engines' own event classes and encoders
# (scripts/check-engines.py), and check that kvmatch predicts, prompt by prompt, the engine's own
# prefix-cache hit, and ends with exactly the index the encoding scenarios predict (the
# engine_fixtures suite of build/kvmatch-tests). The fixtures are written to tests/engine_fixtures/,
# which `make test` checks on every run; a difference from the committed ones is reported.
#
# VLLM_VERSION / SGLANG_VERSION pick other versions (default 0.33.0 and 0.5.23);
# KM_TESTS names the test binary (default build/kvmatch-tests).
set -eu
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
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
if ! "$CACHE/venv/bin/python" -c 'import msgspec, xxhash, zmq, pydantic, cbor2' 2>/dev/null; then
    "$CACHE/venv/bin/pip" install -q msgspec xxhash pyzmq pydantic cbor2
fi
# Only the requested versions' wheels are read.
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
ln -s "$PWD/$CACHE"/vllm-"$VLLM_VERSION"-*.whl "$PWD/$CACHE"/sglang-"$SGLANG_VERSION"-*.whl "$WHEELS"/
"$CACHE/venv/bin/python" scripts/check-engines.py "$WHEELS" tests/engine_fixtures
"$KM_TESTS" --filter 'engine_fixtures/*'
if ! git diff --quiet -- tests/engine_fixtures; then
    echo "check-engines: tests/engine_fixtures differ from the committed ones (git diff shows how)"
fi
echo "check-engines: vLLM $VLLM_VERSION and SGLang $SGLANG_VERSION: ok"
