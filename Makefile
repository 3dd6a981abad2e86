# kvmatch build. Knobs use ?=; project flags come first, user CFLAGS/LDFLAGS last.
#   make            library + build/kvmatch (CUDA backend when nvcc is found; CUDA=0 forces it off
#                   and builds into build-cpu/)
#   make test       unit and property tests (Criterion)
#   make asan       the tests again under AddressSanitizer + UndefinedBehaviorSanitizer (CPU only)
#   make tsan       the threaded suites (TSAN_SUITES) under ThreadSanitizer (CPU only; not part of
#                   make test; fails on any report, those of kvmatch processes a test starts too)
#   make cuda       compile the kernels for sm_90 (fails if nvcc is missing)
#   make bench      benchmarks -> bench/results/*.json
#   make fuzz       libFuzzer harnesses (tests/fuzz/) under ASan + UBSan, FUZZ_SECONDS each (needs
#                   clang; not part of `make test`; docs/FUZZING.md)
#   make run        install missing Debian packages, build, run the main job (a kvmatch sim sweep)
#   make soak       a bounded soak of a real server (SOAK_SECONDS, default 180; docs/RELIABILITY.md)
#   make fuzz-replay  every committed fuzz corpus (tests/fuzz/corpus/) once through its harness
#                   under ASan + UBSan (needs clang; seconds; .ci/run runs it)
#   make install    the binary, libkvmatch.a, libkvmatch.so.$(VERSION) (its soname
#                   libkvmatch.so.$(SOVERSION); it exports the public API alone), the headers,
#                   kvmatch.pc, the man pages, an example config and systemd unit, the service
#                   user's sysusers.d file, under $(DESTDIR)$(PREFIX) (default /usr/local), then
#                   (without DESTDIR) runs ldconfig; make uninstall removes them
# V=1 shows the commands. Library flags come from pkg-config (PKG_CONFIG); the dependency script
# installs Debian packages only for what pkg-config does not find.

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

# The libraries, by their pkg-config names; without pkg-config (or a .pc file) the usual -l names.
PKG_CONFIG ?= pkg-config
KM_PKGS := libxxhash jansson msgpack libzmq libuv libmicrohttpd libnats libcurl
KM_PKG_CFLAGS := $(shell $(PKG_CONFIG) --cflags $(KM_PKGS) 2>/dev/null)
KM_PKG_LIBS := $(shell $(PKG_CONFIG) --libs $(KM_PKGS) 2>/dev/null || \
                 echo -lxxhash -ljansson -lmsgpackc -lzmq -luv -lmicrohttpd -lnats -lcurl)
TEST_LIBS := $(shell $(PKG_CONFIG) --libs criterion 2>/dev/null || echo -lcriterion)
# The kvmatch executable's allocator: jemalloc when pkg-config finds it (JEMALLOC=0 keeps glibc's
# malloc; sanitizer builds always do). Freed memory goes back to the system from jemalloc's own
# background thread, a little at a time, where glibc's malloc_trim walks the whole heap holding
# the lock every allocation needs (docs/SERVICE.md, "Memory after an overload"). The library never
# links an allocator: a program embedding it keeps its own.
ifeq ($(origin JEMALLOC),undefined)
  JEMALLOC := $(if $(SANITIZE),0,$(if $(shell $(PKG_CONFIG) --exists jemalloc 2>/dev/null && echo y),1,0))
endif
JEMALLOC_LIBS := $(if $(filter 1,$(JEMALLOC)),$(shell $(PKG_CONFIG) --libs jemalloc 2>/dev/null),)

VERSION := $(shell sed -n 's/^\#define KVMATCH_VERSION "\(.*\)"/\1/p' include/kvmatch/version.h)
SOVERSION := $(firstword $(subst ., ,$(VERSION)))

KM_CPPFLAGS := -Iinclude -Isrc -D_GNU_SOURCE -DKM_HAVE_CUDA=$(CUDA) -DKM_HAVE_JEMALLOC=$(JEMALLOC) \
               $(KM_PKG_CFLAGS)
# -fPIC: the same objects make libkvmatch.a and libkvmatch.so.
KM_CFLAGS := -std=c11 -O2 -g -fPIC -Wall -Wextra -Wshadow -Wno-unused-function -pthread -MMD -MP \
             $(SANITIZE)
KM_LDLIBS := $(KM_PKG_LIBS) -lm -pthread
ifeq ($(CUDA),1)
  KM_LDLIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
endif
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-fno-strict-aliasing,-fPIC -Iinclude -Isrc \
             -DKM_HAVE_CUDA=1

# Installation layout (GNU conventions).
PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
MANDIR ?= $(PREFIX)/share/man
DOCDIR ?= $(PREFIX)/share/doc/kvmatch
SYSCONFDIR ?= $(if $(filter /usr,$(PREFIX)),/etc,$(PREFIX)/etc)
# The service user's sysusers.d file: $(PREFIX)/lib/sysusers.d, which is /usr/lib/sysusers.d (where
# Debian's packages put theirs) for PREFIX=/usr. Debian 12's systemd (252) reads no
# /usr/local/lib/sysusers.d: with another PREFIX, copy the file to /etc/sysusers.d (README).
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
INSTALL ?= install
# Without DESTDIR, `make install` installs for this machine and refreshes the dynamic loader's
# cache, without which a program linked against $(LIBDIR) (pkg-config --libs kvmatch) does not
# start until ldconfig runs. A DESTDIR stages a package, whose installation runs it.
LDCONFIG ?= $(firstword $(shell command -v ldconfig 2>/dev/null) \
                        $(wildcard /sbin/ldconfig /usr/sbin/ldconfig))

# src/<subsystem>/*.c is the library (src/cli is the command line); kernels/ is the CUDA backend,
# built only with CUDA=1.
LIB_SRC := $(filter-out src/cli/%,$(wildcard src/*/*.c)) $(if $(filter 1,$(CUDA)),$(wildcard kernels/*.c),)
CLI_SRC := $(wildcard src/cli/*.c) $(wildcard bench/*.c)
TEST_SRC := $(wildcard tests/*.c)
CU_SRC := $(if $(filter 1,$(CUDA)),$(wildcard kernels/*.cu),)

LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_SRC:%.cu=$(BUILD)/%.cu.o)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/%.o)
# The benchmark's baseline indexes are tested against a brute-force model too.
BASELINE_SRC := bench/baselines.c bench/radix.c bench/radix_compressed.c bench/flatmap.c
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o) $(BASELINE_SRC:%.c=$(BUILD)/%.o)

LIB := $(BUILD)/libkvmatch.a
SHLIB := $(BUILD)/libkvmatch.so.$(VERSION)
SHLIB_MAP := $(BUILD)/libkvmatch.map
PC := $(BUILD)/kvmatch.pc
BIN := $(BUILD)/kvmatch
TEST_BIN := $(BUILD)/kvmatch-tests

.PHONY: all test test-deps asan tsan cuda bench run deps clean fuzz fuzz-build fuzz-bins \
        fuzz-replay soak install uninstall shared check-engines
all: $(BIN) $(LIB) $(SHLIB) $(PC)
shared: $(SHLIB) $(PC)

# Objects are rebuilt when the flags they were built with change (a CUDA=0/1 switch lives in
# another BUILD; this catches CFLAGS, SANITIZE, pkg-config answers).
FLAGS_STAMP := $(BUILD)/.flags
FLAGS_NOW := $(CC) $(KM_CPPFLAGS) $(KM_CFLAGS) $(CPPFLAGS) $(CFLAGS) | $(NVCC) $(NVCCFLAGS)
$(shell mkdir -p $(BUILD) && { [ "$$(cat $(FLAGS_STAMP) 2>/dev/null)" = '$(FLAGS_NOW)' ] || \
        printf '%s' '$(FLAGS_NOW)' > $(FLAGS_STAMP); })

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC    $<")
	$(Q)$(CC) $(KM_CPPFLAGS) $(KM_CFLAGS) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  NVCC  $<")
	$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(LIB): $(LIB_OBJ)
	@$(if $(Q),echo "  AR    $@")
	$(Q)rm -f $@ && ar rcs $@ $^

# The shared library exports the functions the public headers declare, nothing else.
$(SHLIB_MAP): $(wildcard include/kvmatch/*.h) scripts/export-map.sh
	@mkdir -p $(dir $@)
	$(Q)scripts/export-map.sh include/kvmatch > $@

$(SHLIB): $(LIB_OBJ) $(SHLIB_MAP)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) -shared -Wl,-soname,libkvmatch.so.$(SOVERSION) -Wl,--version-script=$(SHLIB_MAP) \
	    -Wl,--no-undefined $(KM_CFLAGS) $(CFLAGS) $(LIB_OBJ) $(LDFLAGS) $(KM_LDLIBS) -o $@
	$(Q)ln -sf $(notdir $@) $(BUILD)/libkvmatch.so.$(SOVERSION)
	$(Q)ln -sf $(notdir $@) $(BUILD)/libkvmatch.so

# kvmatch.pc for the prefix given now (install writes it again: PREFIX may differ there).
PC_SED := sed -e 's|@PREFIX@|$(PREFIX)|; s|@LIBDIR@|$(LIBDIR)|; s|@INCLUDEDIR@|$(INCLUDEDIR)|' \
    -e 's|@VERSION@|$(VERSION)|; s|@PKGS@|$(KM_PKGS)|' \
    -e 's|@LIBS_PRIVATE@|-lm -pthread$(if $(filter 1,$(CUDA)), -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++,)|' \
    dist/kvmatch.pc.in

$(PC): dist/kvmatch.pc.in include/kvmatch/version.h Makefile
	@mkdir -p $(dir $@)
	$(Q)$(PC_SED) > $@

install: $(BIN) $(LIB) $(SHLIB) $(PC)
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)/kvmatch \
	    $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(DOCDIR)/examples $(DESTDIR)$(DOCDIR)/docs
	$(INSTALL) -m 0755 $(BIN) $(DESTDIR)$(BINDIR)/kvmatch
	$(INSTALL) -m 0644 $(LIB) $(DESTDIR)$(LIBDIR)/libkvmatch.a
	$(INSTALL) -m 0755 $(SHLIB) $(DESTDIR)$(LIBDIR)/
	ln -sf $(notdir $(SHLIB)) $(DESTDIR)$(LIBDIR)/libkvmatch.so.$(SOVERSION)
	ln -sf $(notdir $(SHLIB)) $(DESTDIR)$(LIBDIR)/libkvmatch.so
	$(PC_SED) > $(DESTDIR)$(LIBDIR)/pkgconfig/kvmatch.pc
	chmod 0644 $(DESTDIR)$(LIBDIR)/pkgconfig/kvmatch.pc
	$(INSTALL) -m 0644 include/kvmatch/*.h $(DESTDIR)$(INCLUDEDIR)/kvmatch/
	$(INSTALL) -m 0644 man/*.1 $(DESTDIR)$(MANDIR)/man1/
	$(INSTALL) -m 0644 LICENSE README.md $(DESTDIR)$(DOCDIR)/
	$(INSTALL) -m 0644 docs/*.md docs/records.schema.json $(DESTDIR)$(DOCDIR)/docs/
	$(INSTALL) -m 0644 dist/serve.json $(DESTDIR)$(DOCDIR)/examples/serve.json
	sed -e 's|@BINDIR@|$(BINDIR)|g; s|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	    -e 's|@SYSUSERSDIR@|$(SYSUSERSDIR)|g' dist/kvmatch.service.in \
	    > $(DESTDIR)$(DOCDIR)/examples/kvmatch.service
	chmod 0644 $(DESTDIR)$(DOCDIR)/examples/kvmatch.service
	$(INSTALL) -d $(DESTDIR)$(SYSUSERSDIR)
	$(INSTALL) -m 0644 dist/kvmatch.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvmatch.conf
	$(if $(DESTDIR),,$(if $(LDCONFIG),$(LDCONFIG) || echo "make install: $(LDCONFIG) failed; \
	    run it as root (sudo $(LDCONFIG)) before starting a program linked against $(LIBDIR)", \
	    @echo "make install: no ldconfig found; run it as root before starting a program linked \
	    against $(LIBDIR)"))

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/kvmatch $(DESTDIR)$(LIBDIR)/libkvmatch.a \
	    $(DESTDIR)$(LIBDIR)/libkvmatch.so $(DESTDIR)$(LIBDIR)/libkvmatch.so.$(SOVERSION) \
	    $(DESTDIR)$(LIBDIR)/libkvmatch.so.$(VERSION) $(DESTDIR)$(LIBDIR)/pkgconfig/kvmatch.pc
	rm -rf $(DESTDIR)$(INCLUDEDIR)/kvmatch $(DESTDIR)$(DOCDIR)
	rm -f $(DESTDIR)$(SYSUSERSDIR)/kvmatch.conf
	rm -f $(addprefix $(DESTDIR)$(MANDIR)/man1/,$(notdir $(wildcard man/*.1)))

$(BIN): $(CLI_OBJ) $(LIB)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) $(KM_CFLAGS) $(CFLAGS) $(CLI_OBJ) $(LIB) $(LDFLAGS) $(KM_LDLIBS) $(JEMALLOC_LIBS) -o $@

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	@$(if $(Q),echo "  LD    $@")
	$(Q)$(CC) $(KM_CFLAGS) $(CFLAGS) $(TEST_OBJ) $(LIB) $(LDFLAGS) $(TEST_LIBS) $(KM_LDLIBS) -o $@

# What `make` and `make run` need; test-deps adds the test tools.
deps:
	$(Q)scripts/install-deps.sh

test-deps:
	$(Q)scripts/install-deps.sh --test

# Tests run from the repository root so they find tests/vectors and ../shared/data.
test: test-deps
	$(Q)$(MAKE) --no-print-directory $(BIN) $(TEST_BIN) $(SHLIB) $(PC)
	$(Q)scripts/run-tests.sh $(TEST_BIN)

# vLLM's own KV-cache manager and publisher, and vLLM's and SGLang's event encoders, against the
# feed (downloads their wheels; not part of make test, which checks the fixtures this writes).
check-engines:
	$(Q)$(MAKE) --no-print-directory $(TEST_BIN)
	$(Q)KM_TESTS=$(TEST_BIN) scripts/check-engines.sh

asan: test-deps
	$(Q)$(MAKE) --no-print-directory BUILD=build-asan CUDA=0 \
	    SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	    build-asan/kvmatch build-asan/kvmatch-tests
	$(Q)ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    LSAN_OPTIONS=fast_unwind_on_malloc=0:suppressions=$(CURDIR)/tests/lsan.supp \
	    KM_FAIL_ON_SANITIZER=1 scripts/run-tests.sh build-asan/kvmatch-tests

# The suites with threads of their own or of a server they start. Excluded by name: tests that
# measure resident memory (ThreadSanitizer's shadow memory and allocator change it) and tests whose
# pass depends on work finishing within a fixed time (the sanitizer makes it 5 to 15 times slower).
TSAN_SUITES ?= thread_pool match subscriber feed server cluster cluster_serve cluster_work \
               restart replica pools client timeouts sim_instances
TSAN_EXCLUDE ?= add_and_remove_hundreds_of_times_leaves_nothing \
                an_idle_connection_keeps_no_large_frame_decoded \
                half_sent_frames_and_stalled_readers_are_closed_after_their_timeouts
tsan_space := $(subst ,, )
tsan_alternatives = $(subst $(tsan_space),|,$(strip $(1)))
TSAN_REPORTS := $(CURDIR)/build-tsan/tsan-reports
# Reports go to files (log_path), one per process, so those of kvmatch processes a test starts are
# kept even where the test reads their stderr; exitcode=0 lets such a process exit as it would, and
# the run fails on any report file instead. die_after_fork=0: the sanitizer's own thread makes
# every process multithreaded, and some tests fork a child that starts threads.
# ignore_noninstrumented_modules=1: the C library calls libzmq makes (memcpy, free) on the frames it
# hands over are not recorded, so they raise no report (tests/tsan.supp says why they would); with
# the suppression alone each one is matched as it comes, at a cost that grows with those already
# matched, which no fixed wait in the subscriber's tests allows for.
# tests/tsan/criterion_arena.so lets Criterion map its arena beside the sanitizer's shadow memory.
tsan: test-deps
	$(Q)$(MAKE) --no-print-directory BUILD=build-tsan CUDA=0 \
	    SANITIZE="-fsanitize=thread -fno-omit-frame-pointer" \
	    build-tsan/kvmatch build-tsan/kvmatch-tests
	$(Q)$(CC) -O2 -shared -fPIC tests/tsan/criterion_arena.c -o build-tsan/criterion_arena.so -ldl
	$(Q)rm -rf $(TSAN_REPORTS) && mkdir -p $(TSAN_REPORTS)
	$(Q)LD_PRELOAD=$(CURDIR)/build-tsan/criterion_arena.so \
	    TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp log_path=$(TSAN_REPORTS)/report \
	    exitcode=0 halt_on_error=0 second_deadlock_stack=1 die_after_fork=0 \
	    ignore_noninstrumented_modules=1" \
	    KM_TEST_FILTER='@($(call tsan_alternatives,$(TSAN_SUITES)))/!($(call \
	    tsan_alternatives,$(TSAN_EXCLUDE)))' scripts/run-tests.sh build-tsan/kvmatch-tests
	$(Q)if ls $(TSAN_REPORTS)/report.* >/dev/null 2>&1; then \
	    grep -h 'SUMMARY: ThreadSanitizer' $(TSAN_REPORTS)/report.* | sort | uniq -c; \
	    echo "make tsan: ThreadSanitizer reports in $(TSAN_REPORTS)" >&2; exit 1; fi

cuda:
	@test -n "$(NVCC)" || { echo "make cuda: nvcc not found (set NVCC or CUDA_HOME)"; exit 1; }
	$(Q)$(MAKE) --no-print-directory CUDA=1 all

# index-h200, replay-h200 and replay-ceiling-h200 are stored results from a lent GPU machine
# (docs/BENCHMARKS.md, "GPU"): rendered as they are, never re-measured here.
bench: all
	$(Q)mkdir -p bench/results
	$(Q)$(BIN) bench index --json > bench/results/index.json
	$(Q)$(BIN) bench events --json > bench/results/events.json
	$(Q)scripts/bench-clients.sh $(BIN) --json > bench/results/ipc.json
	$(Q)$(BIN) bench replay --json > bench/results/replay.json
	$(Q)$(BIN) bench replay --ceiling --json > bench/results/replay-ceiling.json
	$(Q)$(BIN) sim --json > bench/results/sim.json
	$(Q)$(BIN) bench growth --json > bench/results/growth.json
	$(Q)$(BIN) bench cluster --json > bench/results/cluster.json
	$(Q)python3 scripts/bench-routing.py $(BIN) > bench/results/routing.json
	$(Q)python3 scripts/bench-routing.py $(BIN) --engine llama3-70b-h100x4 \
	    > bench/results/routing-llama3-70b-h100x4.json
	$(Q)python3 scripts/bench-routing.py $(BIN) --workers 8 > bench/results/routing-8-workers.json
	$(Q)for b in index events ipc replay replay-ceiling sim growth routing routing-llama3-70b-h100x4 \
	    routing-8-workers cluster index-h200 replay-h200 replay-ceiling-h200; do \
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
	rm -rf build build-cpu build-asan build-tsan build-fuzz

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d)
