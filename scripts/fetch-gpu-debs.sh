#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Download (not install) the Debian packages kvmatch needs to build and run its tests on a machine
# that has CUDA but none of our libraries and no network: the lent GPU machine. Run it here, where
# apt works; scripts/gpu-check.sh unpacks the files there with `dpkg -x` into a private prefix.
#
#   scripts/fetch-gpu-debs.sh .deps/debs     # DIR is git-ignored (.deps/)
#
# The list is the build-time packages (headers, link symlinks) plus the runtime closure of every
# library the binaries name as NEEDED, as `apt-cache depends --recurse` gives it, minus the base
# system (libc6, libgcc-s1, gcc-12-base, libstdc++6), which every Linux machine with nvcc has.
# gpu-check.sh only puts a library on the loader path when the machine lacks its soname, so
# carrying one the machine has is harmless.
# The script also copies the Mooncake trace (../shared/data/mooncake) next to DIR, in
# DIR/../mooncake, when it exists: ../shared beside the checkout does not travel to that machine.
set -euo pipefail

dir=${1:?usage: fetch-gpu-debs.sh DIR}
# Build time: headers and link-time symlinks.
build_packages=(libxxhash-dev libjansson-dev libcriterion-dev libmsgpack-dev libmsgpuck-dev
    libzmq3-dev libuv1-dev libmicrohttpd-dev libnats-dev libcurl4-openssl-dev libjemalloc-dev)
# Run time: the package of each NEEDED library of build/kvmatch and build/kvmatch-tests.
runtime_roots=(libxxhash0 libjansson4 libcriterion3 libmsgpackc2 libzmq5 libuv1 libmicrohttpd12
    libnats3.4 libcurl4 libjemalloc2)
base_system=(libc6 libgcc-s1 gcc-12-base libstdc++6 debconf)

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# The roots' closure: real package names only (apt-cache prints virtual ones as <name>).
closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "${runtime_roots[@]}" | grep -v '^ ' | grep -v '^<' | sort -u)
[ -n "$closure" ] || { echo "fetch-gpu-debs: apt-cache gave no dependencies" >&2; exit 1; }
packages=("${build_packages[@]}")
for d in $closure; do
    case " ${base_system[*]} " in
        *" $d "*) ;;
        *) packages+=("$d") ;;
    esac
done

# apt-get download writes into the current directory; as root it warns that _apt cannot write
# there (harmless).
(
    cd "$dir"
    apt-get download "${packages[@]}" 2>&1 | { grep -v "couldn't be accessed by user '_apt'" || true; }
)

missing=0
for p in "${packages[@]}"; do
    if ! ls "$dir"/"${p}"_*.deb >/dev/null 2>&1; then
        echo "fetch-gpu-debs: $p was not downloaded" >&2
        missing=1
    fi
done
[ "$missing" -eq 0 ] || exit 1

trace_src="$(cd "$(dirname "$0")/.." && pwd)/../shared/data/mooncake"
if [ -f "$trace_src/conversation_trace.jsonl" ]; then
    mkdir -p "$dir/../mooncake"
    cp -f "$trace_src/conversation_trace.jsonl" "$dir/../mooncake/"
    echo "fetch-gpu-debs: trace copied to $(cd "$dir/../mooncake" && pwd)"
fi
echo "fetch-gpu-debs: ${#packages[@]} packages in $dir ($(du -sh "$dir" | cut -f1))"
