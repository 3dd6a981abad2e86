#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build and test one client of `kvmatch serve` against the real daemon: python, go or rust.
#   scripts/test-clients.sh LANGUAGE [KVMATCH_BINARY]
# Exits 0 when the client's tests pass, 77 when the toolchain or a Debian package it needs is
# absent (the last line says which; scripts/install-deps.sh --clients installs them), anything
# else when a test fails. Everything is built offline in a temporary directory:
#   python: a venv (Debian's python3, its system site packages for msgpack), the package installed
#           into it with `pip install --no-index` from a copy of clients/python, then its tests and the fake-server
#           test tests/test_python_client.py, run by the venv's python outside the source tree.
#   go:     Debian's Go toolchain (/usr/bin/go) and Debian's msgpack package for Go, in GOPATH mode
#           (the module linked into a temporary GOPATH beside /usr/share/gocode, where Debian
#           installs Go sources), GOPROXY=off; gofmt and go vet must be clean.
#   rust:   Debian's cargo, rustc and rustdoc against Debian's packaged crates
#           (/usr/share/cargo/registry as a directory source replacing crates.io), --offline, on a
#           copy of clients/rust (the tests, the doc example and examples/ are built).
set -uo pipefail
lang=${1:?usage: test-clients.sh python|go|rust [KVMATCH_BINARY]}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${2:-${KM_BIN:-}}
if [ -z "$bin" ]; then
    for b in "$root/build/kvmatch" "$root/build-cpu/kvmatch"; do
        [ -x "$b" ] && { bin=$b; break; }
    done
fi
[ -n "$bin" ] && [ -x "$bin" ] || { echo "test-clients: no kvmatch binary (make, or pass one)"; exit 1; }
export KM_BIN=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
work=$(mktemp -d /tmp/kvmatch-clients-XXXXXX)
trap 'rm -rf "$work"' EXIT

skip() { echo "skipped: $*"; exit 77; }
has_deb() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

case "$lang" in
python)
    py=/usr/bin/python3
    [ -x "$py" ] || skip "Debian's python3 is not installed"
    "$py" -c 'import venv, ensurepip' 2>/dev/null || skip "python3-venv is not installed"
    "$py" -c 'import msgpack' 2>/dev/null || skip "python3-msgpack is not installed"
    "$py" -m venv --system-site-packages "$work/venv" || exit 1
    # Installed from a copy, so the build leaves nothing in the source tree.
    cp -r "$root/clients/python" "$work/package" && rm -rf "$work/package/tests" || exit 1
    "$work/venv/bin/pip" install -q --no-index --no-build-isolation "$work/package" || exit 1
    cd "$work" || exit 1
    "$work/venv/bin/python" -c 'import kvmatch_client, sys; sys.exit(not kvmatch_client.__file__.startswith(sys.prefix))' \
        || { echo "test-clients: kvmatch_client was not imported from the venv"; exit 1; }
    timeout 180 "$work/venv/bin/python" "$root/clients/python/tests/test_server.py" || exit 1
    timeout 120 "$work/venv/bin/python" "$root/tests/test_python_client.py" || exit 1
    ;;
go)
    has_deb golang-go || skip "golang-go (Debian's Go toolchain) is not installed"
    has_deb golang-github-vmihailenco-msgpack.v5-dev \
        || skip "golang-github-vmihailenco-msgpack.v5-dev (msgpack for Go) is not installed"
    export GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH="$work/gopath:/usr/share/gocode" \
        GOCACHE="$work/gocache" KM_ROOT="$root"
    mkdir -p "$work/gopath/src/kvmatch/clients" || exit 1
    ln -s "$root/clients/go" "$work/gopath/src/kvmatch/clients/go" || exit 1
    cd "$work/gopath/src/kvmatch/clients/go" || exit 1
    unformatted=$(/usr/bin/gofmt -l .)
    [ -z "$unformatted" ] || { echo "test-clients: gofmt would change: $unformatted"; exit 1; }
    /usr/bin/go vet ./... || exit 1
    timeout 400 /usr/bin/go test -count=1 -v ./... 2>&1 | grep -v -E '^(=== RUN|=== PAUSE|=== CONT)'
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    ;;
rust)
    for p in cargo rustc librust-rmp-serde-dev librust-serde-dev; do
        has_deb "$p" || skip "$p (Debian's Rust toolchain and crates) is not installed"
    done
    mkdir -p "$work/cargo-home" || exit 1
    printf '%s\n' '[source.crates-io]' 'replace-with = "debian"' '[source.debian]' \
        'directory = "/usr/share/cargo/registry"' '[net]' 'offline = true' > "$work/cargo-home/config.toml"
    cp -r "$root/clients/rust" "$work/rust" && rm -rf "$work/rust/target" "$work/rust/Cargo.lock" || exit 1
    export CARGO_HOME="$work/cargo-home" CARGO_TARGET_DIR="$work/target" RUSTC=/usr/bin/rustc \
        RUSTDOC=/usr/bin/rustdoc KM_ROOT="$root"
    cd "$work/rust" || exit 1
    timeout 500 /usr/bin/cargo test --offline --all-targets 2>&1 | grep -v -E '^test .* \.\.\. ok$'
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    timeout 300 /usr/bin/cargo test --offline --doc 2>&1 | tail -n 3
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    ;;
*)
    echo "test-clients: unknown language $lang (python, go, rust)"; exit 2 ;;
esac
