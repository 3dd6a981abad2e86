#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check, for a lent machine with an NVIDIA GPU, nvcc and (ideally) compute-sanitizer but no
# network and none of our Debian libraries. It passes only when the GPU was really exercised: the
# CUDA test suite ran with KM_REQUIRE_CUDA=1 (a missing or unusable device fails it, naming the
# reason, instead of skipping) with no test skipped, and `bench index` measured the cuda row; and
# only when every step it started finished: a sanitizer run cut off by its time limit makes the
# check INCOMPLETE, never PASS. Without a GPU it FAILs (env, cuda and bench steps).
#
# Time: the device machine is lent for 15 minutes in all, its start and every rerun included. The
# script starts no step after KM_BUDGET (420 s) and cuts each step's limit to what is left, so it
# ends within about 7 minutes (the last H200 run took 74 s: BENCHMARKS.md, "GPU"); run it with a
# timeout_s of 450.
#
# Here, once (needs apt and network):   scripts/fetch-gpu-debs.sh .deps/debs
# There (device tool):                  run(command="scripts/gpu-check.sh $OUT", carry=[".deps"],
#                                           timeout_s=450)
# To skip the build there, build here with `make CUDA=1 -j2 build/kvmatch build/kvmatch-tests`,
# carry them too and set KM_PREBUILT=1 (the binaries are used as they are):
#   run(command="KM_PREBUILT=1 scripts/gpu-check.sh $OUT", timeout_s=450,
#       carry=[".deps", "build/kvmatch", "build/kvmatch-tests"])
#
# Steps, each with its own time limit, all within KM_BUDGET; a failed step does not stop the next:
#   env      the GPU as nvidia-smi sees it (name, driver, compute capability); FAIL without one
#   prefix   the carried .deb files unpacked with `dpkg -x` into a private prefix (never into /):
#            headers and link libraries through CPATH / LIBRARY_PATH; at run time only the
#            sonames (from `readelf -d`) the machine lacks go on LD_LIBRARY_PATH, so system tools
#            never load our copies
#   build    make CUDA=1 (KM_T_BUILD, 120 s)
#   load     the test binary starts (`--list`); a loader error is shown, never discarded
#   cuda     the verdict: the CUDA suite without the sanitizer (KM_T_CUDA, 240 s: no less than the
#            longest test's own limit, slot_patches_longer_than_one_round's); FAIL on any failed,
#            skipped or unfinished test
#   bench    kvmatch bench index --quick --backends cuda (KM_T_BENCH, 60 s); FAIL without a cuda row
#   races    the small sanitizer tests (KM_SANITIZER_TESTS, cuda/small_batch_*: one batch at 1,000
#            workers, walk scratch in shared memory, and one at 3,000, in global scratch) under
#            compute-sanitizer's racecheck and synccheck (KM_T_RACECHECK, 60 s each): the walk's
#            shared memory and its warp barriers
#   memcheck the small sanitizer tests under memcheck (KM_T_MEMCHECK, 60 s), then each other CUDA
#            test alone with the same limit while the budget lasts (those it leaves out are listed)
#   A sanitizer run that fails, or whose tests did not all pass, FAILs its step; one its time limit
#   cut off makes the step INCOMPLETE, and so does a required run the budget left no room for.
#   Without compute-sanitizer both steps are skipped (the verdict above ran without it).
# Outputs in OUTDIR (7 files, flat: the device tool returns at most 8):
#   summary.txt  one line per step with its status and seconds, then PASS, INCOMPLETE or FAIL
#                (exit 0, 2 or 1)
#   env.txt      the GPU's name, driver and compute capability, nvidia-smi, nvcc and
#                compute-sanitizer versions, each soname of the prefix (private or the system's),
#                the binaries' NEEDED libraries
#   build.log    make CUDA=1
#   cuda.log     the test binary's --list and the CUDA suite's verbose run
#   memcheck.log the racecheck and synccheck runs, then the memcheck runs
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
budget=${KM_BUDGET:-420}
t_build=${KM_T_BUILD:-120}
t_cuda=${KM_T_CUDA:-240}
t_bench=${KM_T_BENCH:-60}
t_memcheck=${KM_T_MEMCHECK:-60}
t_racecheck=${KM_T_RACECHECK:-60}
sanitizer_tests=${KM_SANITIZER_TESTS:-small_batch_}
export KM_REQUIRE_CUDA=1

summary="$out/summary.txt"
: >"$summary"
failed=0
incomplete=0
step() { # step NAME STATUS SECONDS [NOTE]; STATUS ok, skip, INCOMPLETE or FAIL
    printf '%-8s %-10s %4ss %s\n' "$1" "$2" "$3" "${4:-}" | tee -a "$summary"
    case "$2" in
        ok | skip) ;;
        INCOMPLETE) incomplete=1 ;;
        *) failed=1 ;;
    esac
}
# Seconds left of the budget, never below 1.
left() { local l=$((budget - SECONDS)); [ "$l" -gt 1 ] && echo "$l" || echo 1; }
# The smaller of a step's own limit and what the budget leaves.
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }

# ---- environment --------------------------------------------------------------------------------
t0=$SECONDS
if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
    done
fi
if command -v nvcc >/dev/null; then
    export CUDA_HOME=${CUDA_HOME:-$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)}
    [ -x "$CUDA_HOME/compute-sanitizer/compute-sanitizer" ] && export PATH="$PATH:$CUDA_HOME/compute-sanitizer"
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1)
gpu_rc=$?
{
    echo "== date"; date -u
    echo "== gpu (name, driver, compute capability)"; echo "$gpu"
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
    echo "== nvcc"; command -v nvcc && nvcc --version 2>&1 | tail -2
    echo "== compute-sanitizer"; command -v compute-sanitizer && compute-sanitizer --version 2>&1 | head -2
    echo "== cc"; cc --version 2>&1 | head -1
    echo "== os"; head -2 /etc/os-release 2>/dev/null
    echo "== cpus"; nproc
} >"$out/env.txt" 2>&1
if [ "$gpu_rc" -eq 0 ] && [ -n "$gpu" ]; then
    step env ok $((SECONDS - t0)) "$(head -1 <<<"$gpu")"
else
    step env FAIL $((SECONDS - t0)) "nvidia-smi sees no GPU: $(head -1 <<<"$gpu")"
fi

# ---- private prefix from the carried .deb files -------------------------------------------------
# The SONAME a shared library declares (readelf -d; objdump -p where binutils' readelf is absent).
soname_of() {
    if command -v readelf >/dev/null; then
        readelf -d "$1" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p' | head -1
    else
        objdump -p "$1" 2>/dev/null | awk '$1 == "SONAME" {print $2; exit}'
    fi
}
t0=$SECONDS
rm -rf "$prefix"
mkdir -p "$prefix" "$prefix/runlib"
n_debs=0
for f in "$debs"/*.deb; do
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
# Every shared object in the prefix under the soname it declares (whatever its file name:
# libgit2.so.1.5 and libhttp_parser.so.2.9 have two-part versions), when the system lacks it.
system_sonames=$(ldconfig -p 2>/dev/null | awk 'NR > 1 {print $1}' | sort -u)
declare -A seen_soname=()
for d in $libdirs; do
    for lib in "$d"/lib*.so*; do
        [ -f "$lib" ] || continue
        soname=$(soname_of "$lib")
        [ -n "$soname" ] || continue
        [ -n "${seen_soname[$soname]:-}" ] && continue
        seen_soname[$soname]=1
        if grep -qxF "$soname" <<<"$system_sonames"; then
            echo "system  $soname ($(basename "$lib") not used)"
        else
            ln -sf "$lib" "$prefix/runlib/$soname"
            echo "private $soname -> $(basename "$lib")"
        fi
    done
done >"$prefix/sonames.txt"
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
{ echo "== sonames of the prefix (readelf -d)"; cat "$prefix/sonames.txt"; } >>"$out/env.txt" 2>&1

# ---- build --------------------------------------------------------------------------------------
t0=$SECONDS
tests=build/kvmatch-tests
if [ "${KM_PREBUILT:-0}" = 1 ] && [ -x "$tests" ] && [ -x build/kvmatch ]; then
    echo "KM_PREBUILT=1: using the carried build/kvmatch and $tests" >"$out/build.log"
    step build skip 0 "prebuilt binaries carried (KM_PREBUILT=1)"
elif timeout "$(limit "$t_build")" make CUDA=1 -j"$jobs" build/kvmatch "$tests" >"$out/build.log" 2>&1; then
    step build ok $((SECONDS - t0))
else
    step build FAIL $((SECONDS - t0)) "see build.log"
fi
for b in "$tests" build/kvmatch; do
    { echo "== readelf -d $b (NEEDED)"; readelf -d "$b" 2>&1 | grep NEEDED; } >>"$out/env.txt" 2>&1
done

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

# ---- the CUDA suite: the verdict ------------------------------------------------------------------
# Criterion's --list: "cuda: 9 tests", then one "├── name" / "└── name" line per test.
t0=$SECONDS
cuda_tests=""
if [ ! -x "$tests" ]; then
    step load FAIL 0 "no $tests"
else
    { echo "== $tests --list"; LD_LIBRARY_PATH="$run_ld_path" timeout 20 "$tests" --list 2>&1; } \
        >"$out/cuda.log"
    list_rc=$?
    cuda_tests=$(awk '/^[A-Za-z0-9_]+: [0-9]+ tests?$/ {suite = $1; sub(":", "", suite); next}
                      suite == "cuda" && NF >= 2 {print $NF}' "$out/cuda.log")
    if [ -z "$cuda_tests" ]; then
        step load FAIL $((SECONDS - t0)) "no cuda suite in --list (exit $list_rc): $(sed -n 2p "$out/cuda.log" | cut -c1-200)"
    else
        step load ok $((SECONDS - t0)) "$(wc -w <<<"$cuda_tests") cuda tests"
    fi
fi
t0=$SECONDS
if [ -n "$cuda_tests" ]; then
    echo "== suite cuda, KM_REQUIRE_CUDA=1, trace ${KM_MOONCAKE_TRACE:-(default path)}" >>"$out/cuda.log"
    LD_LIBRARY_PATH="$run_ld_path" timeout "$(limit "$t_cuda")" "$tests" --filter 'cuda/*' --jobs 1 \
        --verbose >>"$out/cuda.log" 2>&1
    rc=$?
    echo "== exit $rc" >>"$out/cuda.log"
    synth=$(grep -a "Synthesis" "$out/cuda.log" | tail -1)
    # --verbose reports every test the filter leaves out as "[SKIP] suite::name: Test is
    # disabled"; only the cuda suite's skips count, and every listed cuda test must have passed.
    skips=$(grep -ac '^\[SKIP\] cuda::' "$out/cuda.log")
    passed=$(grep -ac '^\[PASS\] cuda::' "$out/cuda.log")
    listed=$(wc -w <<<"$cuda_tests")
    first_fail=$(grep -a -m1 -E '^\[----\] .*:[0-9]+: |^\[FAIL\]' "$out/cuda.log" | cut -c1-240)
    if [ "$rc" -eq 0 ] && [ "$skips" -eq 0 ] && [ "$passed" -eq "$listed" ] && [ -n "$synth" ]; then
        step cuda ok $((SECONDS - t0)) "$synth"
    elif [ "$rc" -eq 0 ]; then
        step cuda FAIL $((SECONDS - t0)) "$passed of $listed passed, $skips skipped (a GPU check passes no skip): $(grep -a -m1 '^\[SKIP\] cuda::\|^\[----\]' "$out/cuda.log" | cut -c1-200)"
    else
        step cuda FAIL $((SECONDS - t0)) "exit $rc; $synth; $first_fail"
    fi
else
    step cuda FAIL 0 "not run: no test binary that lists the cuda suite"
fi

# ---- benchmark ----------------------------------------------------------------------------------
t0=$SECONDS
if [ -x build/kvmatch ]; then
    LD_LIBRARY_PATH="$run_ld_path" timeout "$(limit "$t_bench")" build/kvmatch bench index --quick \
        --backends cuda --json >"$out/bench.json" 2>"$out/bench.log"
    rc=$?
    if grep -q '"backend": *"cuda"' "$out/bench.json" && [ "$rc" -eq 0 ]; then
        step bench ok $((SECONDS - t0)) "cuda measured; trace: ${KM_MOONCAKE_TRACE:-default path}"
    else
        step bench FAIL $((SECONDS - t0)) "exit $rc; no cuda row unless measured: $(tail -1 "$out/bench.log" | cut -c1-200)"
    fi
else
    step bench FAIL 0 "no build/kvmatch"
fi

# ---- compute-sanitizer ---------------------------------------------------------------------------
# sanitize TOOL FILTER EXPECTED LIMIT: the tests FILTER selects under compute-sanitizer TOOL, their
# output appended to memcheck.log. Prints ok, timeout (the limit cut it off: no verdict), or why it
# failed: its exit status, or fewer than EXPECTED tests passed (a filter that selects nothing
# exits 0 too).
sanitize() {
    local tool=$1 filter=$2 expect=$3 lim=$4 log rc passed
    log=$(mktemp)
    echo "== $filter under compute-sanitizer $tool (limit ${lim}s)" >>"$out/memcheck.log"
    LD_LIBRARY_PATH="$run_ld_path" timeout "$lim" compute-sanitizer --tool "$tool" \
        --target-processes all --error-exitcode 86 "$tests" --filter "$filter" --jobs 1 \
        --verbose >"$log" 2>&1
    rc=$?
    passed=$(grep -ac '^\[PASS\] cuda::' "$log")
    cat "$log" >>"$out/memcheck.log"
    rm -f "$log"
    echo "== $tool exit $rc, $passed of $expect passed" >>"$out/memcheck.log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo timeout
    elif [ "$rc" -ne 0 ]; then
        echo "exit $rc"
    elif [ "$passed" -ne "$expect" ]; then
        echo "$passed of $expect passed"
    else
        echo ok
    fi
}
: >"$out/memcheck.log"
small_tests=$(grep "^$sanitizer_tests" <<<"$cuda_tests")
n_small=$(wc -w <<<"$small_tests")
small_filter="cuda/$sanitizer_tests*"
have_sanitizer=0
command -v compute-sanitizer >/dev/null && have_sanitizer=1

# ---- the walk's shared memory and warp barriers: racecheck and synccheck of the small tests ------
t0=$SECONDS
if [ "$n_small" -eq 0 ]; then
    step races FAIL 0 "no $small_filter tests in the suite"
elif [ "$have_sanitizer" -eq 0 ]; then
    step races skip 0 "compute-sanitizer not found"
else
    bad=""; cut=""
    for tool in racecheck synccheck; do
        if [ $((budget - SECONDS)) -lt 10 ]; then
            cut="$cut $tool(no time left)"
            continue
        fi
        res=$(sanitize "$tool" "$small_filter" "$n_small" "$(limit "$t_racecheck")")
        case "$res" in
            ok) ;;
            timeout) cut="$cut $tool(timeout)" ;;
            *) bad="$bad $tool($res)" ;;
        esac
    done
    note="$small_filter ($n_small tests)${bad:+; failed:$bad}${cut:+; not finished:$cut}"
    if [ -n "$bad" ]; then
        step races FAIL $((SECONDS - t0)) "$note"
    elif [ -n "$cut" ]; then
        step races INCOMPLETE $((SECONDS - t0)) "$note"
    else
        step races ok $((SECONDS - t0)) "$note"
    fi
fi

# ---- memcheck: the small tests, then each other CUDA test while the budget lasts ----------------
t0=$SECONDS
if [ "$n_small" -eq 0 ]; then
    step memcheck FAIL 0 "no $small_filter tests in the suite"
elif [ "$have_sanitizer" -eq 0 ]; then
    echo "compute-sanitizer not found" >>"$out/memcheck.log"
    step memcheck skip 0 "compute-sanitizer not found (the verdict above ran without it)"
else
    ok=0; bad=""; cut=""; left_out=""
    if [ $((budget - SECONDS)) -lt 10 ]; then
        cut=" $small_filter(no time left)"
    else
        res=$(sanitize memcheck "$small_filter" "$n_small" "$(limit "$t_memcheck")")
        case "$res" in
            ok) ok=$((ok + n_small)) ;;
            timeout) cut=" $small_filter(timeout)" ;;
            *) bad=" $small_filter($res)" ;;
        esac
    fi
    for t in $cuda_tests; do
        grep -qx "$t" <<<"$small_tests" && continue
        if [ $((budget - SECONDS)) -lt 10 ]; then
            left_out="$left_out $t"
            continue
        fi
        res=$(sanitize memcheck "cuda/$t" 1 "$(limit "$t_memcheck")")
        case "$res" in
            ok) ok=$((ok + 1)) ;;
            timeout) cut="$cut $t(timeout)" ;;
            *) bad="$bad $t($res)" ;;
        esac
    done
    note="$ok clean${bad:+; failed:$bad}${cut:+; not finished:$cut}"
    note="$note${left_out:+; left out for the budget:$left_out}"
    if [ -n "$bad" ]; then
        step memcheck FAIL $((SECONDS - t0)) "$note"
    elif [ -n "$cut" ]; then
        step memcheck INCOMPLETE $((SECONDS - t0)) "$note"
    else
        step memcheck ok $((SECONDS - t0)) "$note"
    fi
fi

verdict=PASS; status=0
[ "$incomplete" -eq 1 ] && verdict=INCOMPLETE && status=2
[ "$failed" -eq 1 ] && verdict=FAIL && status=1
echo "gpu-check: $verdict in ${SECONDS}s (outputs in $out)" | tee -a "$summary"
exit "$status"
