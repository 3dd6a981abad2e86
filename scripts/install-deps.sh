#!/usr/bin/env bash
# Install the Debian packages kvmatch needs, only those missing. Called by `make run` / `make test`.
# (chromium: the headless render check of `kvmatch analyze --html`; python3-*: test tooling.)
# With --clients, also what the client tests need (scripts/test-clients.sh; without these they
# are reported skipped): python3-venv for the Python package, Debian's Go toolchain and msgpack
# package for Go, Debian's Rust toolchain and the rmp-serde / serde crates for Rust.
# Uses apt-get as root, or through sudo when available. Prints nothing when all are present.
set -euo pipefail
packages=(build-essential pkg-config libxxhash-dev libjansson-dev libmsgpack-dev libzmq3-dev libuv1-dev libmicrohttpd-dev libcriterion-dev python3 python3-msgpack python3-jsonschema chromium)
client_packages=(python3-venv golang-go golang-github-vmihailenco-msgpack.v5-dev cargo rustc librust-rmp-serde-dev librust-serde-dev)
if [ "${1:-}" = "--clients" ]; then
    packages+=("${client_packages[@]}")
fi
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
