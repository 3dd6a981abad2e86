#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `kvmatch bench ipc` with a row per client language: builds the Go and Rust drivers offline (as
# scripts/test-clients.sh builds the clients: Debian's toolchains and packaged crates) and the
# Python one's venv into a temporary directory, then runs
#   KVMATCH_BINARY bench ipc --clients DIR [bench ipc options...]
# where DIR holds one executable per language that runs its driver (clients/python/bench.py,
# clients/go/cmd/kvmatch-bench, clients/rust/examples/bench.rs). A language whose toolchain is
# missing is left out, saying so on stderr.
#   scripts/bench-clients.sh [KVMATCH_BINARY] [--json] [--quick] [--seconds S]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${KM_BIN:-$root/build/kvmatch}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then bin=$1; shift; fi
[ -x "$bin" ] || bin=$root/build-cpu/kvmatch
[ -x "$bin" ] || { echo "bench-clients: no kvmatch binary (make)" >&2; exit 1; }
work=$(mktemp -d /tmp/kvmatch-bench-clients-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/drivers"
has_deb() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

if /usr/bin/python3 -c 'import msgpack' 2>/dev/null; then
    printf '#!/bin/sh\nPYTHONPATH=%s exec /usr/bin/python3 %s "$@"\n' "$root/clients/python" \
        "$root/clients/python/bench.py" > "$work/drivers/python"
    chmod +x "$work/drivers/python"
else
    echo "bench-clients: python left out: python3-msgpack is not installed" >&2
fi

if has_deb golang-go && has_deb golang-github-vmihailenco-msgpack.v5-dev; then
    mkdir -p "$work/gopath/src/kvmatch/clients"
    ln -s "$root/clients/go" "$work/gopath/src/kvmatch/clients/go"
    if (cd "$work/gopath/src/kvmatch/clients/go" && GO111MODULE=off GOPROXY=off GOFLAGS= \
            GOPATH="$work/gopath:/usr/share/gocode" GOCACHE="$work/gocache" \
            /usr/bin/go build -o "$work/drivers/go" ./cmd/kvmatch-bench); then :
    else echo "bench-clients: go left out: the driver did not build" >&2; fi
else
    echo "bench-clients: go left out: golang-go or its msgpack package is not installed" >&2
fi

if has_deb cargo && has_deb rustc && has_deb librust-rmp-serde-dev && has_deb librust-serde-dev; then
    mkdir -p "$work/cargo-home"
    printf '%s\n' '[source.crates-io]' 'replace-with = "debian"' '[source.debian]' \
        'directory = "/usr/share/cargo/registry"' '[net]' 'offline = true' > "$work/cargo-home/config.toml"
    cp -r "$root/clients/rust" "$work/rust" && rm -rf "$work/rust/target" "$work/rust/Cargo.lock"
    if (cd "$work/rust" && CARGO_HOME="$work/cargo-home" CARGO_TARGET_DIR="$work/target" \
            RUSTC=/usr/bin/rustc /usr/bin/cargo build --offline --release --example bench -q); then
        cp "$work/target/release/examples/bench" "$work/drivers/rust"
    else echo "bench-clients: rust left out: the driver did not build" >&2; fi
else
    echo "bench-clients: rust left out: Debian's cargo, rustc or the rmp-serde / serde crates are missing" >&2
fi

"$bin" bench ipc --clients "$work/drivers" "$@"
