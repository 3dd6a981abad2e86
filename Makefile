# kvmatch build. Knobs use ?=; project flags come first, user CFLAGS/LDFLAGS last.
#   make            library + build/kvmatch (CUDA backend when nvcc is found; CUDA=0 forces it off
#                   and builds into build-cpu/)
#   make test       unit and property tests (Criterion)
#   make asan       the tests again under AddressSanitizer + UndefinedBehaviorSanitizer (CPU only)
#   make cuda       compile the kernels for sm_90 (fails if nvcc is missing)
#   make bench      benchmarks -> bench/results/*.json
#   make fuzz       libFuzzer harnesses (tests/fuzz/) under ASan + UBSan, FUZZ_SECONDS each (needs
#                   clang; not part of `make test`; docs/FUZZING.md)
#   make run        install missing Debian packages, build, run the main job (a kvmatch sim sweep)
#   make soak       a bounded soak of a real server (SOAK_SECONDS, default 180; docs/RELIABILITY.md)
#   make fuzz-replay  every committed fuzz corpus (tests/fuzz/corpus/) once through its harness
#                   under ASan + UBSan (needs clang; seconds; .ci/run runs it)
# V=1 shows the commands.

CC ?= cc
# CUDA=0 builds live apart, so switching CUDA on and off never mixes objects built both ways.
BUILD ?= $(if $(filter 1,$(CUDA)),build,build-cpu)
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(shell command -v nvcc 2>/dev/null || ( test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc ))
ifeq ($(origin CUDA),undefined)
  CUDA := $(if $(NVCC),1,0)
endif
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
SANITIZE ?=

ifeq ($(V),1)
  Q :=
else
  Q := @
endif

KM_CPPFLAGS := -Iinclude -Isrc -D_GNU_SOURCE -DKM_HAVE_CUDA=$(CUDA)
KM_CFLAGS := -std=c11 -O2 -g -Wall -Wextra -Wshadow -Wno-unused-function -pthread -MMD -MP $(SANITIZE)
KM_LDLIBS := -lxxhash -ljansson -lmsgpackc -lzmq -luv -lmicrohttpd -lm -pthread
ifeq ($(CUDA),1)
  KM_LDLIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
endif
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-fno-strict-aliasing -Iinclude -Isrc -DKM_HAVE_CUDA=1

# src/<subsystem>/*.c is the library (src/cli is the command line); kernels/ is the CUDA backend,
# built only with CUDA=1.
LIB_SRC := $(filter-out src/cli/%,$(wildcard src/*/*.c)) $(if $(filter 1,$(CUDA)),$(wildcard kernels/*.c),)
CLI_SRC := $(wildcard src/cli/*.c) $(wildcard bench/*.c)
TEST_SRC := $(wildcard tests/*.c)
CU_SRC := $(if $(filter 1,$(CUDA)),$(wildcard kernels/*.cu),)

LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_SRC:%.cu=$(BUILD)/%.cu.o)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)

LIB := $(BUILD)/libkvmatch.a
BIN := $(BUILD)/kvmatch
TEST_BIN := $(BUILD)/kvmatch-tests

.PHONY: all test asan cuda bench run deps clean fuzz fuzz-build fuzz-bins fuzz-replay soak
all: $(BIN) $(LIB)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC    $<")
	$(Q)$(CC) $(KM_CPPFLAGS) $(KM_CFLAGS) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  NVCC  $<")
	$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(LIB): $(LIB_OBJ)
	@$(if $(Q),echo "  AR    $@")
	$(Q)rm -f $@ && ar rcs $@ $^

$(BIN): $(CLI_OBJ) $(LIB)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) $(KM_CFLAGS) $(CFLAGS) $(CLI_OBJ) $(LIB) $(LDFLAGS) $(KM_LDLIBS) -o $@

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) $(KM_CFLAGS) $(CFLAGS) $(TEST_OBJ) $(LIB) $(LDFLAGS) -lcriterion $(KM_LDLIBS) -o $@

deps:
	$(Q)scripts/install-deps.sh

# Tests run from the repository root so they find tests/vectors and ../shared/data.
test: deps
	$(Q)$(MAKE) --no-print-directory $(BIN) $(TEST_BIN)
	$(Q)scripts/run-tests.sh $(TEST_BIN)

asan: deps
	$(Q)$(MAKE) --no-print-directory BUILD=build-asan CUDA=0 \
	    SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	    build-asan/kvmatch build-asan/kvmatch-tests
	$(Q)ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    LSAN_OPTIONS=fast_unwind_on_malloc=0:suppressions=$(CURDIR)/tests/lsan.supp \
	    KM_FAIL_ON_SANITIZER=1 scripts/run-tests.sh build-asan/kvmatch-tests

cuda:
	@test -n "$(NVCC)" || { echo "make cuda: nvcc not found (set NVCC or CUDA_HOME)"; exit 1; }
	$(Q)$(MAKE) --no-print-directory CUDA=1 all

bench: all
	$(Q)mkdir -p bench/results
	$(Q)$(BIN) bench index --json > bench/results/index.json
	$(Q)$(BIN) bench events --json > bench/results/events.json
	$(Q)scripts/bench-clients.sh $(BIN) --json > bench/results/ipc.json
	$(Q)$(BIN) bench replay --json > bench/results/replay.json
	$(Q)$(BIN) bench replay --ceiling --json > bench/results/replay-ceiling.json
	$(Q)$(BIN) sim --json > bench/results/sim.json
	$(Q)$(BIN) bench growth --json > bench/results/growth.json
	$(Q)python3 scripts/bench-routing.py $(BIN) > bench/results/routing.json
	$(Q)for b in index events ipc replay replay-ceiling sim growth routing; do \
		python3 scripts/bench-report.py bench/results/$$b.json docs/BENCHMARKS.md || exit 1; done
	$(Q)cat bench/results/index.json bench/results/events.json bench/results/ipc.json bench/results/replay.json bench/results/sim.json bench/results/growth.json

# The main job: every policy on agent loops at three loads of the cluster's capacity, the default
# policy against each of the others, and an HTML report (docs/SIM.md, "Load sweeps").
run: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)$(BIN) sim --workload agent --workers 4 --requests 600 --sweep 0.5,0.8,0.95 \
	    --html $(BUILD)/sim-report.html

# ---- fuzzing (docs/FUZZING.md) -----------------------------------------------------------------
# The library is rebuilt with clang into build-fuzz/ (sanitizers + coverage instrumentation); each
# tests/fuzz/fuzz_T.c is linked with libFuzzer, tests/fuzz/seeds_T.c writes its seed corpus, and
# the fuzzer runs FUZZ_SECONDS on build-fuzz/corpus/T (kept between runs: it grows). A crash, leak,
# sanitizer report or broken contract stops `make fuzz` with the input in build-fuzz/artifacts/.
# One target: make fuzz FUZZ_TARGETS=protocol. Replay an input: build-fuzz/fuzz_T FILE.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 60
FUZZ_RSS_MB ?= 2048
FUZZ_TARGETS ?= protocol kv_events snapshot analyze server_config trace
FUZZ_SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

fuzz-build:
	@command -v $(FUZZ_CC) >/dev/null || { echo "make fuzz: $(FUZZ_CC) not found (set FUZZ_CC)"; exit 1; }
	$(Q)$(MAKE) --no-print-directory BUILD=build-fuzz CUDA=0 CC=$(FUZZ_CC) \
	    SANITIZE="$(FUZZ_SANITIZE) -fsanitize=fuzzer-no-link" fuzz-bins

fuzz-bins: $(FUZZ_TARGETS:%=$(BUILD)/fuzz_%) $(FUZZ_TARGETS:%=$(BUILD)/seeds_%)

$(BUILD)/fuzz_%: tests/fuzz/fuzz_%.c $(LIB)
	@$(if $(Q),echo "  FUZZ  $@")
	$(Q)$(CC) $(KM_CPPFLAGS) $(KM_CFLAGS) -O1 -fsanitize=fuzzer $< $(LIB) $(KM_LDLIBS) -o $@

$(BUILD)/seeds_%: tests/fuzz/seeds_%.c $(LIB)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) $(KM_CPPFLAGS) $(KM_CFLAGS) $< $(LIB) $(KM_LDLIBS) -o $@

fuzz: fuzz-build
	$(Q)for t in $(FUZZ_TARGETS); do \
	    mkdir -p build-fuzz/corpus/$$t build-fuzz/artifacts && \
	    build-fuzz/seeds_$$t build-fuzz/corpus/$$t && \
	    echo "  FUZZ  $$t for $(FUZZ_SECONDS) s" && \
	    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=$(FUZZ_RSS_MB) \
	        -timeout=10 -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/$$t- \
	        build-fuzz/corpus/$$t $$(test -d tests/fuzz/corpus/$$t && echo tests/fuzz/corpus/$$t) \
	        || exit 1; \
	done

# Each harness over its committed, minimised corpus (tests/fuzz/corpus/T): every input run once;
# a crash, leak, sanitizer report or broken contract fails. Merge new finds into the corpus with
# build-fuzz/fuzz_T -merge=1 tests/fuzz/corpus/T build-fuzz/corpus/T (docs/FUZZING.md).
fuzz-replay: fuzz-build
	$(Q)for t in $(FUZZ_TARGETS); do \
	    test -d tests/fuzz/corpus/$$t || continue; \
	    echo "  REPLAY $$t ($$(ls tests/fuzz/corpus/$$t | wc -l) inputs)"; \
	    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    build-fuzz/fuzz_$$t -runs=0 -rss_limit_mb=$(FUZZ_RSS_MB) -timeout=10 tests/fuzz/corpus/$$t \
	        > build-fuzz/replay_$$t.log 2>&1 || { tail -30 build-fuzz/replay_$$t.log; exit 1; }; \
	done

soak: all
	$(Q)scripts/soak.sh $(BIN)

clean:
	rm -rf build build-cpu build-asan build-fuzz

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d)
