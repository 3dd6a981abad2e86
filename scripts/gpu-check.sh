#!/usr/bin/env bash
# The GPU checks, for a lent machine with an NVIDIA GPU, nvcc and (ideally) compute-sanitizer but
# no network and none of our Debian libraries. Builds with CUDA=1, runs the CUDA test suite under
# compute-sanitizer, then the whole test binary, then the index benchmark, and writes what it saw
# into OUTDIR (at most 8 files, flat: the device tool returns no more).
#
# Here, once (needs apt and network):   scripts/fetch-gpu-debs.sh .deps/debs
# There (device tool):                  run(command="scripts/gpu-check.sh $OUT", carry=[".deps"],
#                                           timeout_s=360)
#
# The .deb files are unpacked with `dpkg -x` into a private prefix (never into /). Headers and link
# libraries come from it through CPATH / LIBRARY_PATH; at run time only the sonames the machine
# lacks are put on LD_LIBRARY_PATH, so system tools never load our copies. Each step has its own
# time limit (KM_T_BUILD 90 s, KM_T_CUDA 60 s per suite, KM_T_TESTS 60 s, KM_T_BENCH 75 s: under
# 5 minutes in all; the full bench took 60 s on 2 CPU cores here); a failed step does not stop the
# next. The exit status is 0 only when every step passed. Outputs:
#   summary.txt  one line per step with its status and seconds
#   env.txt      nvidia-smi, nvcc and compute-sanitizer versions, the prefix's libraries
#   build.log    make CUDA=1
#   cuda.log     the CUDA suite(s) under compute-sanitizer (or plain, if it is missing)
#   tests.log    the whole test binary
#   bench.json   build/kvmatch bench index --json (stdout); bench.log its stderr
set -uo pipefail
shopt -s nullglob

out=${1:?usage: gpu-check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1

debs=${KM_DEBS:-$root/.deps/debs}
prefix=${KM_PREFIX:-/tmp/kvmatch-prefix}
jobs=${KM_JOBS:-16}
t_build=${KM_T_BUILD:-90}
t_cuda=${KM_T_CUDA:-60}
t_tests=${KM_T_TESTS:-60}
t_bench=${KM_T_BENCH:-75}

summary="$out/summary.txt"
: >"$summary"
failed=0
step() { # step NAME STATUS SECONDS [NOTE]
    printf '%-8s %-6s %4ss %s\n' "$1" "$2" "$3" "${4:-}" | tee -a "$summary"
    [ "$2" = ok ] || [ "$2" = skip ] || failed=1
}

# ---- environment --------------------------------------------------------------------------------
{
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
    echo "== nvcc"; command -v nvcc && nvcc --version 2>&1 | tail -2
    echo "== compute-sanitizer"; command -v compute-sanitizer && compute-sanitizer --version 2>&1 | head -2
    echo "== cc"; cc --version 2>&1 | head -1
    echo "== os"; head -2 /etc/os-release 2>/dev/null
} >"$out/env.txt" 2>&1

if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
    done
fi
if command -v nvcc >/dev/null; then
    export CUDA_HOME=${CUDA_HOME:-$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)}
fi

# ---- private prefix from the carried .deb files -------------------------------------------------
t0=$SECONDS
rm -rf "$prefix"
mkdir -p "$prefix" "$prefix/runlib"
n_debs=0
for f in "$debs"/*.deb; do
    [ -e "$f" ] || continue
    if command -v dpkg >/dev/null; then
        dpkg -x "$f" "$prefix"
    else # no dpkg: a .deb is an ar archive holding data.tar.*
        (tmp=$(mktemp -d) && cd "$tmp" && ar x "$f" && tar -xf data.tar.* -C "$prefix" && rm -rf "$tmp")
    fi
    n_debs=$((n_debs + 1))
done
libdirs=""
for d in "$prefix/usr/lib/x86_64-linux-gnu" "$prefix/lib/x86_64-linux-gnu"; do
    [ -d "$d" ] && libdirs="$libdirs $d"
done
# Only sonames the system lacks go on the loader path.
system_sonames=$(ldconfig -p 2>/dev/null | awk '{print $1}' | sort -u)
for d in $libdirs; do
    for lib in "$d"/lib*.so.*; do
        [ -e "$lib" ] || continue
        soname=$(basename "$lib")
        case "$soname" in *.so.*.*) continue ;; esac # versioned file; the soname link is enough
        if ! grep -qxF "$soname" <<<"$system_sonames"; then
            ln -sf "$lib" "$prefix/runlib/$soname"
        fi
    done
done
if [ "$n_debs" -gt 0 ]; then
    export CPATH="$prefix/usr/include${CPATH:+:$CPATH}"
    ldflags=""
    for d in $libdirs; do
        export LIBRARY_PATH="$d${LIBRARY_PATH:+:$LIBRARY_PATH}"
        ldflags="$ldflags -L$d -Wl,-rpath-link,$d"
    done
    export LDFLAGS="${LDFLAGS:-}$ldflags"
    run_ld_path="$prefix/runlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    step prefix ok $((SECONDS - t0)) "$n_debs .deb files; private sonames: $(cd "$prefix/runlib" && printf '%s ' *)"
else
    run_ld_path="${LD_LIBRARY_PATH:-}"
    step prefix skip $((SECONDS - t0)) "no .deb files in $debs (using the system's libraries)"
fi
{ echo "== private runtime libraries"; ls -l "$prefix/runlib"; } >>"$out/env.txt" 2>&1

# ---- build --------------------------------------------------------------------------------------
t0=$SECONDS
if timeout "$t_build" make CUDA=1 -j"$jobs" build/kvmatch build/kvmatch-tests build/libkvmatch.a \
        >"$out/build.log" 2>&1; then
    step build ok $((SECONDS - t0))
else
    step build FAIL $((SECONDS - t0)) "see build.log"
fi

# ---- the trace ----------------------------------------------------------------------------------
if [ -z "${KM_MOONCAKE_TRACE:-}" ]; then
    for t in ../shared/data/mooncake/conversation_trace.jsonl shared/data/mooncake/conversation_trace.jsonl \
             .deps/mooncake/conversation_trace.jsonl; do
        if [ -f "$t" ]; then
            export KM_MOONCAKE_TRACE="$root/$t"
            break
        fi
    done
fi

# ---- CUDA suite under compute-sanitizer ---------------------------------------------------------
tests=build/kvmatch-tests
t0=$SECONDS
if [ ! -x "$tests" ]; then
    step cuda FAIL 0 "no test binary"
    step tests FAIL 0 "no test binary"
else
    suites=$(LD_LIBRARY_PATH="$run_ld_path" "$tests" --list 2>/dev/null |
             sed -n 's/^\([A-Za-z0-9_]*cuda[A-Za-z0-9_]*\): [0-9]* tests\{0,1\}$/\1/p')
    if [ -z "$suites" ]; then
        step cuda FAIL 0 "no test suite named *cuda* in $tests --list"
    else
        sanitizer=()
        if command -v compute-sanitizer >/dev/null; then
            sanitizer=(compute-sanitizer --tool memcheck --target-processes all --error-exitcode 86)
        fi
        status=ok
        for s in $suites; do
            echo "== suite $s ${sanitizer[*]:-(no compute-sanitizer)}" >>"$out/cuda.log"
            LD_LIBRARY_PATH="$run_ld_path" timeout "$t_cuda" "${sanitizer[@]}" "$tests" \
                --filter "$s/*" --jobs 1 --verbose >>"$out/cuda.log" 2>&1
            rc=$?
            echo "== suite $s exit $rc" >>"$out/cuda.log"
            [ "$rc" -eq 0 ] || status=FAIL
        done
        step cuda "$status" $((SECONDS - t0)) "suites: ${suites//$'\n'/ } ${sanitizer[0]:-(no compute-sanitizer)}"
    fi

    # ---- everything ----------------------------------------------------------------------------
    t0=$SECONDS
    LD_LIBRARY_PATH="$run_ld_path" timeout "$t_tests" "$tests" --jobs "$jobs" >"$out/tests.log" 2>&1
    rc=$?
    synth=$(grep -a "Synthesis" "$out/tests.log" | tail -1)
    if [ "$rc" -eq 0 ]; then step tests ok $((SECONDS - t0)) "$synth"; else step tests FAIL $((SECONDS - t0)) "exit $rc; $synth"; fi
fi

# ---- benchmark ----------------------------------------------------------------------------------
t0=$SECONDS
if [ -x build/kvmatch ]; then
    LD_LIBRARY_PATH="$run_ld_path" timeout "$t_bench" build/kvmatch bench index --json \
        >"$out/bench.json" 2>"$out/bench.log"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        step bench ok $((SECONDS - t0)) "trace: ${KM_MOONCAKE_TRACE:-default path}"
    elif [ -z "${KM_MOONCAKE_TRACE:-}" ]; then
        step bench skip $((SECONDS - t0)) "exit $rc; no trace carried (see bench.log)"
    else
        step bench FAIL $((SECONDS - t0)) "exit $rc (see bench.log)"
    fi
else
    step bench FAIL 0 "no build/kvmatch"
fi

echo "gpu-check: $([ "$failed" -eq 0 ] && echo PASS || echo FAIL) (outputs in $out)" | tee -a "$summary"
exit "$failed"
