#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Download (not install) the Debian packages kvmatch needs to build and run its tests on a machine
# that has CUDA but none of our libraries and no network: the lent GPU machine. Run it here, where
# apt works; scripts/gpu-check.sh unpacks the files there with `dpkg -x` into a private prefix.
#
#   scripts/fetch-gpu-debs.sh .deps/debs     # DIR is git-ignored (.deps/)
#
# The list is the build-time packages (headers, link symlinks) plus the runtime closure of
# libcriterion3 as `apt-cache depends` gives it on Debian 12, minus the base system (libc6, libgcc-s1,
# gcc-12-base), which every Linux machine with nvcc has. gpu-check.sh only puts a library on the
# loader path when the machine lacks its soname, so carrying one the machine has is harmless.
# The script also copies the Mooncake trace (../shared/data/mooncake) next to DIR, in
# DIR/../mooncake, when it exists: ../shared beside the checkout does not travel to that machine.
set -euo pipefail

dir=${1:?usage: fetch-gpu-debs.sh DIR}
packages=(
    # build: headers and link-time symlinks
    libxxhash-dev libjansson-dev libcriterion-dev libmsgpack-dev libmsgpuck-dev libzmq3-dev libuv1-dev libmicrohttpd-dev
    # runtime: our direct libraries
    libxxhash0 libjansson4 libcriterion3 libmsgpackc2 libzmq5 libuv1 libmicrohttpd12
    # runtime closure of libcriterion3 (libffi8, libgit2-1.5, libnanomsg5 and what they need)
    libffi8 libnanomsg5 libgit2-1.5 libhttp-parser2.9 libmbedcrypto7 libmbedtls14 libmbedx509-1
    libpcre2-8-0 libssh2-1 zlib1g libssl3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
    libcom-err2 libkeyutils1
    # runtime closure of libzmq5 and libmsgpackc2
    libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0
    # runtime closure of libmicrohttpd12 (GnuTLS)
    libgnutls30 libgmp10 libhogweed6 libnettle8 libidn2-0 libp11-kit0 libtasn1-6 libunistring2
)
base_system=(libc6 libgcc-s1 gcc-12-base libstdc++6 debconf)

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# Warn about any runtime dependency the list above misses (a newer Debian may add one).
deps=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances libcriterion3 libxxhash0 libjansson4 libmsgpackc2 libzmq5 libuv1 libmicrohttpd12 2>/dev/null |
       grep -v '^ ' | grep -v '^<' | sort -u || true)
for d in $deps; do
    case " ${packages[*]} ${base_system[*]} " in
        *" $d "*) ;;
        *) echo "fetch-gpu-debs: note: $d is a dependency not in the list (add it if the GPU machine lacks it)" >&2 ;;
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
