/* SPDX-License-Identifier: Apache-2.0 */
/* Shared helpers for the Criterion suites: a replayable random source, the brute-force placement
 * oracle the index is checked against (the CPU backend is checked against
 * brute force, and every other backend against the CPU backend), a random workload generator
 * (prefix trees of token sequences, store / remove / clear batches, scoring requests) and result
 * comparison. Test files include this; tests/test_util.c implements it.
 *
 * Seeds: every randomized test takes its seed from km_test_seed(): $KM_TEST_SEED when set (replay),
 * else the clock. Assertions made through KM_CHECK print the seed, so a failure can be replayed. */
#ifndef KM_TEST_UTIL_H
#define KM_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <criterion/criterion.h>

#include "kvmatch/kvmatch.h"

/* ---- seeds and random numbers ------------------------------------------------------------- */

/* The seed of this test process: $KM_TEST_SEED (decimal or 0x hex) when set, else time-derived.
 * Fixed for the life of the process (Criterion runs each test in its own process). */
uint64_t km_test_seed(void);

#define KM_CHECK(cond, fmt, ...)                                                                \
    cr_assert((cond), "[replay with KM_TEST_SEED=%llu] " fmt,                                  \
              (unsigned long long)km_test_seed(), ##__VA_ARGS__)

typedef struct km_rng {
    uint64_t state;
} km_rng;

void km_rng_init(km_rng *r, uint64_t seed);
uint64_t km_rng_next(km_rng *r);
/* Uniform in [0, n); n >= 1. */
uint32_t km_rng_below(km_rng *r, uint32_t n);
/* 1 with probability percent / 100. */
int km_rng_percent(km_rng *r, uint32_t percent);
/* A random value usable as a chain hash (never 0 or 1). */
uint64_t km_rng_hash(km_rng *r);

/* ---- the oracle: a plain set of (worker, chain hash) pairs --------------------------------- */

typedef struct km_oracle_entry {
    uint64_t key;       /* 0 = empty slot */
    uint32_t n, cap;    /* holders, ascending in workers[0..n) */
    uint32_t *workers;
    /* Does the index know this block's position in its sequence? Known for a run that starts at
     * KM_NO_PARENT or continues a block whose position is known; a block keeps the first known
     * position while it has holders. A store run whose parent's position is unknown (parent not
     * held by anyone, or itself from an orphan run) is an orphan run. */
    int position_known;
} km_oracle_entry;

typedef struct km_oracle {
    km_oracle_entry *entries;
    uint64_t capacity, used; /* used: keys ever inserted (entries are never erased, only emptied) */
    uint64_t pairs, blocks;  /* blocks: keys with at least one holder */
    uint32_t max_workers;
    km_worker_stats *workers;
} km_oracle;

void km_oracle_init(km_oracle *o, uint32_t max_workers);
void km_oracle_free(km_oracle *o);
/* Holders of hash, ascending (NULL and *n = 0 when none). */
const uint32_t *km_oracle_holders(const km_oracle *o, uint64_t hash, uint32_t *n);
int km_oracle_holds(const km_oracle *o, uint32_t worker, uint64_t hash);
/* Leading blocks of hashes[0..n) that worker holds. */
uint32_t km_oracle_depth(const km_oracle *o, uint32_t worker, const uint64_t *hashes, uint32_t n);
/* Apply a batch the way the header specifies km_index_apply (in order), accumulating what the
 * index should report into *expect (zeroed first) and the per-worker counters. The batch must be
 * valid (worker ids in range, hashes non-NULL). */
void km_oracle_apply(km_oracle *o, const km_update *updates, size_t n, km_update_stats *expect);
/* Every key the oracle has ever seen (held or not), for content snapshots. */
size_t km_oracle_keys(const km_oracle *o, uint64_t *out, size_t capacity);

/* Expected scoring result of one request: entries ascending by worker, depth >= 1. out must hold
 * max_workers entries. */
uint32_t km_oracle_match(const km_oracle *o, const uint64_t *hashes, uint32_t n,
                         km_worker_match *out, uint32_t *owner, uint32_t *owner_depth);

/* Compare a scoring batch with the oracle. Returns 1 when every request's count, entries (worker,
 * depth, ascending), owner and owner_depth match and the bookkeeping (n_requests, first, probes
 * sum, probes bound) is consistent; else 0 with a description in why. */
int km_check_results(const km_oracle *o, const km_request *requests, size_t n,
                     const km_match_results *res, uint32_t segment_blocks, char *why,
                     size_t why_size);

/* Compare the index's counters (get_stats pairs/blocks, every worker's km_worker_stats) with the
 * oracle's. Returns 1 when equal, else 0 with why. */
int km_check_counters(const km_oracle *o, const km_index *index, char *why, size_t why_size);

/* Everything observable against the oracle: counters, the holders of every key the oracle has
 * seen, and a scoring batch of `requests` (results reused from *res); segment_blocks is the
 * index's, for the probe bound. Returns 1 or 0 with why. */
int km_check_index(const km_oracle *o, km_index *index, uint32_t segment_blocks,
                   const km_request *requests, size_t n, km_match_results *res, char *why,
                   size_t why_size);

int km_update_stats_equal(const km_update_stats *a, const km_update_stats *b, char *why,
                          size_t why_size);

/* Bit-for-bit equality of two scoring batches (for backend comparisons). */
int km_results_identical(const km_match_results *a, const km_match_results *b, char *why,
                         size_t why_size);

/* ---- random workloads ---------------------------------------------------------------------- */

typedef struct km_seq {
    uint32_t *tokens;
    size_t n_tokens;
    uint64_t *chain; /* n_blocks chain hashes (library hashing, default config) */
    uint32_t n_blocks;
} km_seq;

/* A prefix tree of token sequences: shared system prompts, conversations, multi-turn
 * continuations, branches cut at arbitrary token positions (mid-block and mid-segment included),
 * unrelated prompts. */
typedef struct km_corpus {
    km_seq *seqs;
    size_t n_seqs;
    uint32_t block_size;
} km_corpus;

void km_corpus_generate(km_corpus *c, km_rng *r, size_t n_seqs, uint32_t block_size,
                        uint32_t max_blocks);
void km_corpus_free(km_corpus *c);

/* Generates update batches against a corpus, using the oracle to know what each worker holds.
 * The arrays the updates point to live in the workload until the next call. */
typedef struct km_workload {
    const km_corpus *corpus;
    uint32_t max_workers;
    uint32_t n_workers_used; /* workers 0..n_workers_used-1 plus a few high ids are used */
    km_update *updates;
    size_t n_updates, updates_capacity;
    uint64_t **arrays;
    size_t n_arrays, arrays_capacity;
} km_workload;

void km_workload_init(km_workload *w, const km_corpus *c, uint32_t max_workers);
void km_workload_free(km_workload *w);
/* One random batch (1..max_batch updates) of stores (continuations, orphans, out-of-order runs,
 * duplicates, broadcasts of one prefix to many workers), removes (heads, tails, middles, random
 * subsets, absent blocks) and occasional clears. */
void km_workload_step(km_workload *w, km_rng *r, const km_oracle *o, size_t max_batch);

/* A batch of random requests over the corpus: prefixes of stored chains, full chains, extensions,
 * sibling branches diverging at any block, unrelated hashes, empty requests. Every request is a
 * valid chain (scoring may rely on a chain hash naming its whole prefix). The request hashes
 * live in *storage (reallocated as needed). */
typedef struct km_request_set {
    km_request *requests;
    size_t n;
    uint64_t *storage;
    size_t storage_used, storage_capacity;
} km_request_set;

void km_request_set_generate(km_request_set *s, km_rng *r, const km_corpus *c, size_t n);
void km_request_set_free(km_request_set *s);

/* ---- the Mooncake trace -------------------------------------------------------------------- */

/* Chain hashes of the first requests of the Mooncake conversation trace (src/sim/trace.h). */
typedef struct km_trace_case {
    uint64_t *hashes;   /* all requests' chain hashes, back to back */
    size_t *offset;     /* request i: hashes + offset[i] */
    uint32_t *n_blocks; /* request i: n_blocks[i] hashes */
    uint32_t *session;  /* request i: its first id after the shared id 0 (a conversation key) */
    size_t n;
} km_trace_case;

/* Load up to max_requests requests with block_size tokens per block (512 tokens per trace id).
 * Returns KM_OK, or the loader's status with *why saying what (KM_ERR_IO: the file is absent; the
 * caller skips the test then). */
int km_trace_case_load(km_trace_case *tc, uint32_t block_size, size_t max_requests, char *why,
                       size_t why_size);
void km_trace_case_free(km_trace_case *tc);

/* Receives every update batch of a scenario, with what the oracle says it should report. */
typedef void (*km_apply_fn)(void *ctx, const km_update *updates, size_t n,
                            const km_update_stats *expect);

/* Build a placement state from requests [0, n_state) of the trace: each request is routed to a
 * worker (by conversation when affinity, else round robin) which stores the blocks it lacks as a
 * continuation run; every 500 requests a few workers evict the tails of earlier requests; at the
 * end two workers clear, one is removed, and a few drop random subsets. Updates go to the oracle
 * and, in batches of up to 8, to apply(). */
void km_trace_scenario(const km_trace_case *tc, size_t n_state, uint32_t max_workers,
                       int affinity, km_rng *r, km_oracle *o, km_apply_fn apply, void *ctx);

/* ---- misc ---------------------------------------------------------------------------------- */

/* km_index_config with quiet logging (the log callback counts lines into *counter if non-NULL). */
void km_test_config(km_index_config *cfg, int *log_counter);
/* A CPU index of max_workers workers, segment_blocks and `threads` scoring lanes, created small
 * (initial_blocks 256) so its tables grow during a test; asserts on failure. */
km_index *km_test_growing_index(uint32_t max_workers, uint32_t segment_blocks, uint32_t threads);
/* Give a server configuration's pools an index capped at its size when created (initial_blocks
 * 256, memory_cap_bytes what such an index holds, with cfg's max_workers, backend and threads):
 * any growth is refused. */
void km_test_cap_server_index_at_creation(km_server_config *cfg);
/* One update of the growth tests: store a random corpus chain whole on a random worker of W, or
 * (15%) remove up to 8 blocks from its end instead (copied into tail, which *u then points to).
 * Returns 0 when the chain drawn is empty (no update). */
int km_growth_update(km_rng *r, const km_corpus *corpus, uint32_t W, km_update *u, uint64_t tail[8]);
double km_test_now(void);
/* Run a shell command, its stderr joined to its stdout; the first out_size - 1 bytes of that output
 * go to out (NUL-terminated), the rest is read and dropped. Returns the exit status, or -1 when it
 * did not exit normally or could not start. */
int km_test_run_capture(const char *command, char *out, size_t out_size);
/* Resident memory (VmRSS) of process pid, or of this process when pid is 0, in MiB; -1 when it
 * cannot be read. */
long km_test_resident_mib(int pid);
/* In a child just forked, before it execs or serves: the kernel kills it (SIGKILL) when the thread
 * that forked it ends, so a server a test started never outlives the test, however the test ends
 * (a failed assertion ends the test's process without its teardown). parent: getpid() taken
 * before the fork; a child whose parent is already gone exits at once. */
void km_test_die_with_parent(int parent);

#endif
