#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Make sure what kvmatch needs is present, installing only the Debian packages that are missing.
#   scripts/install-deps.sh          what `make` and `make run` need: a C compiler, pkg-config and
#                                    the libraries (found through pkg-config)
#   scripts/install-deps.sh --test   that, and what `make test` adds: Criterion, python3 with
#                                    msgpack and jsonschema (the Python client, the records
#                                    schema check), nats-server (the cluster tests), chromium (the headless check of
#                                    `kvmatch analyze --html`)
#   scripts/install-deps.sh --clients  that, and what the client tests need
#                                    (scripts/test-clients.sh; without these they are reported
#                                    skipped): python3-venv for the Python package, Debian's Go
#                                    toolchain and msgpack package for Go, Debian's Rust toolchain
#                                    and the rmp-serde / serde crates for Rust
# The libraries are looked up with pkg-config first, so a host that has them all (built from
# source, another distribution) needs no apt at all; apt-get runs (as root, or through sudo) only
# for what is missing. Prints nothing when everything is present.
set -euo pipefail
test_tools=0
client_tools=0
for arg in "$@"; do
    case "$arg" in
        --test) test_tools=1 ;;
        --clients) test_tools=1; client_tools=1 ;;
        *) echo "usage: scripts/install-deps.sh [--test] [--clients]" >&2; exit 2 ;;
    esac
done

missing=()
have_command() { command -v "$1" >/dev/null 2>&1; }
have_package() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# need PKG-CONFIG-NAME DEBIAN-PACKAGE: the library, through pkg-config, else its package
need_library() {
    if have_command pkg-config && pkg-config --exists "$1"; then return; fi
    have_package "$2" || missing+=("$2")
}
need_command() { have_command "$1" || missing+=("$2"); }

need_command cc build-essential
need_command make build-essential
need_command pkg-config pkg-config
need_library libxxhash libxxhash-dev
need_library jansson libjansson-dev
need_library msgpack libmsgpack-dev
# msgpuck (the KV-event decoder's direct path) is one header, without a pkg-config file
[ -f /usr/include/msgpuck.h ] || have_package libmsgpuck-dev || missing+=(libmsgpuck-dev)
need_library libzmq libzmq3-dev
need_library libuv libuv1-dev
need_library libmicrohttpd libmicrohttpd-dev
need_library libnats libnats-dev
need_library libcurl libcurl4-openssl-dev
# the kvmatch executable's allocator (the Makefile links it when pkg-config finds it)
need_library jemalloc libjemalloc-dev
if [ "$test_tools" = 1 ]; then
    need_library criterion libcriterion-dev
    have_command nats-server || have_package nats-server || missing+=(nats-server)
    need_command python3 python3
    # The tests run Debian's interpreter (/usr/bin/python3), which a python3 earlier on PATH (a
    # pyenv or venv with its own modules) does not stand for.
    [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import msgpack' 2>/dev/null || have_package python3-msgpack || missing+=(python3-msgpack)
    [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import jsonschema' 2>/dev/null || have_package python3-jsonschema || missing+=(python3-jsonschema)
    have_command chromium || have_package chromium || missing+=(chromium)
fi
if [ "$client_tools" = 1 ]; then
    for p in python3-venv golang-go golang-github-vmihailenco-msgpack.v5-dev cargo rustc \
             librust-rmp-serde-dev librust-serde-dev; do
        have_package "$p" || missing+=("$p")
    done
fi
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if ! have_command apt-get; then
    echo "install-deps: missing ${missing[*]} (Debian package names); install them, or their" \
         "libraries with pkg-config files, and run make again" >&2
    exit 1
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    have_command sudo || { echo "install-deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
