/* SPDX-License-Identifier: Apache-2.0 */
/* Block hashing (include/kvmatch/hash.h) against vectors from an independent implementation
 * (scripts/gen-hash-vectors.py, Python xxhash), plus the algebra the index relies on: continuing
 * a sequence equals hashing it whole, what salt and LoRA change, the reserved-value remap, errors.
 * Also the error-code tables (include/kvmatch/error.h). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define VECTORS_PATH "tests/vectors/hash_vectors.txt"

typedef struct vec_case {
    char name[64];
    uint32_t block_size;
    char *lora, *salt; /* NULL, "" or the decoded name */
    uint64_t lora_seed, seed0;
    uint32_t *tokens;
    size_t n_tokens;
    uint64_t *seeds, *locals, *chains;
    size_t n_blocks, blocks_capacity;
} vec_case;

static char *decode_name(const char *field)
{
    if (strcmp(field, "-") == 0)
        return NULL;
    if (strcmp(field, "=") == 0)
        return strdup("");
    size_t n = strlen(field) / 2;
    char *s = calloc(n + 1, 1);
    cr_assert(s);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        cr_assert(sscanf(field + 2 * i, "%2x", &v) == 1, "bad hex name field %s", field);
        s[i] = (char)v;
    }
    return s;
}

/* Parse the whole vector file. Returns the number of cases; fails the test on a malformed file. */
static size_t load_vectors(vec_case **out)
{
    const char *path = getenv("KM_TEST_VECTORS") ? getenv("KM_TEST_VECTORS") : VECTORS_PATH;
    FILE *f = fopen(path, "r");
    cr_assert(f != NULL, "cannot open %s (run the tests from the repository root; regenerate with "
                         "scripts/gen-hash-vectors.py)", path);
    size_t n = 0, cap = 0;
    vec_case *cases = NULL, *c = NULL;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    int lineno = 0;
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = 0;
        if (len == 0 || line[0] == '#')
            continue;
        if (strncmp(line, "case ", 5) == 0) {
            if (n == cap) {
                cap = cap ? cap * 2 : 32;
                cases = realloc(cases, cap * sizeof *cases);
                cr_assert(cases);
            }
            c = &cases[n++];
            memset(c, 0, sizeof *c);
            snprintf(c->name, sizeof c->name, "%s", line + 5);
        } else if (strncmp(line, "config ", 7) == 0) {
            char lora[512], salt[512];
            cr_assert(c && sscanf(line + 7, "%u %511s %511s", &c->block_size, lora, salt) == 3,
                      "%s:%d: bad config line", path, lineno);
            c->lora = decode_name(lora);
            c->salt = decode_name(salt);
        } else if (strncmp(line, "seeds ", 6) == 0) {
            unsigned long long a, b;
            cr_assert(c && sscanf(line + 6, "%llx %llx", &a, &b) == 2, "%s:%d: bad seeds", path,
                      lineno);
            c->lora_seed = a;
            c->seed0 = b;
        } else if (strncmp(line, "tokens ", 7) == 0) {
            char *p = line + 7, *end;
            cr_assert(c != NULL);
            c->n_tokens = strtoull(p, &end, 10);
            c->tokens = calloc(c->n_tokens + 1, sizeof *c->tokens);
            cr_assert(c->tokens);
            for (size_t i = 0; i < c->n_tokens; i++) {
                p = end;
                unsigned long long t = strtoull(p, &end, 10);
                cr_assert(end != p && t <= UINT32_MAX, "%s:%d: bad token %zu", path, lineno, i);
                c->tokens[i] = (uint32_t)t;
            }
        } else if (strncmp(line, "block ", 6) == 0) {
            size_t idx;
            unsigned long long s, l, ch;
            cr_assert(c && sscanf(line + 6, "%zu %llx %llx %llx", &idx, &s, &l, &ch) == 4,
                      "%s:%d: bad block line", path, lineno);
            cr_assert_eq(idx, c->n_blocks, "%s:%d: blocks out of order", path, lineno);
            if (c->n_blocks == c->blocks_capacity) {
                c->blocks_capacity = c->blocks_capacity ? c->blocks_capacity * 2 : 16;
                c->seeds = realloc(c->seeds, c->blocks_capacity * sizeof(uint64_t));
                c->locals = realloc(c->locals, c->blocks_capacity * sizeof(uint64_t));
                c->chains = realloc(c->chains, c->blocks_capacity * sizeof(uint64_t));
                cr_assert(c->seeds && c->locals && c->chains);
            }
            c->seeds[c->n_blocks] = s;
            c->locals[c->n_blocks] = l;
            c->chains[c->n_blocks] = ch;
            c->n_blocks++;
        } else if (strcmp(line, "end") == 0) {
            cr_assert(c != NULL);
            c = NULL;
        } else {
            cr_assert_fail("%s:%d: unknown line kind", path, lineno);
        }
    }
    free(line);
    fclose(f);
    *out = cases;
    return n;
}

static void free_vectors(vec_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(cases[i].lora);
        free(cases[i].salt);
        free(cases[i].tokens);
        free(cases[i].seeds);
        free(cases[i].locals);
        free(cases[i].chains);
    }
    free(cases);
}

Test(hash, vectors_match_independent_implementation, .timeout = 30)
{
    vec_case *cases;
    size_t n = load_vectors(&cases);
    size_t total_blocks = 0;
    int saw_lora = 0, saw_salt = 0, saw_empty = 0;
    for (size_t k = 0; k < n; k++) {
        const vec_case *c = &cases[k];
        km_hash_config cfg = {c->block_size, c->lora, c->salt};
        saw_lora |= c->lora && *c->lora;
        saw_salt |= c->salt && *c->salt;
        saw_empty |= c->n_tokens == 0;

        cr_assert_eq(km_hash_block_seed(&cfg, 0), c->seed0, "%s: seed of block 0", c->name);
        cr_assert_eq(km_hash_block_seed(&cfg, 1), c->lora_seed, "%s: seed of block 1", c->name);
        cr_assert_eq(km_hash_block_seed(&cfg, 123456789), c->lora_seed, "%s: seed of a far block",
                     c->name);

        size_t expect = c->n_tokens / c->block_size;
        cr_assert_eq(c->n_blocks, expect, "%s: vector file has %zu blocks for %zu tokens", c->name,
                     c->n_blocks, c->n_tokens);
        uint64_t *local = calloc(expect + 1, sizeof *local),
                 *chain = calloc(expect + 1, sizeof *chain);
        size_t got = 999;
        int rc =
            km_hash_sequence(&cfg, c->tokens, c->n_tokens, 0, KM_NO_PARENT, local, chain, &got);
        cr_assert_eq(rc, KM_OK, "%s: km_hash_sequence: %s", c->name, km_error_name(rc));
        cr_assert_eq(got, expect, "%s: %zu blocks, expected %zu", c->name, got, expect);
        for (size_t i = 0; i < expect; i++) {
            cr_assert_eq(c->seeds[i], km_hash_block_seed(&cfg, i), "%s block %zu: seed", c->name,
                         i);
            cr_assert_eq(local[i], c->locals[i], "%s block %zu: local %016llx, expected %016llx",
                         c->name, i, (unsigned long long)local[i],
                         (unsigned long long)c->locals[i]);
            cr_assert_eq(chain[i], c->chains[i], "%s block %zu: chain %016llx, expected %016llx",
                         c->name, i, (unsigned long long)chain[i],
                         (unsigned long long)c->chains[i]);
            /* The building blocks give the same values. */
            uint64_t l = km_hash_local(c->tokens + i * c->block_size, c->block_size, c->seeds[i]);
            cr_assert_eq(l, c->locals[i], "%s block %zu: km_hash_local", c->name, i);
            uint64_t ch = i == 0 ? km_hash_chain_root(l) : km_hash_chain_step(c->chains[i - 1], l);
            cr_assert_eq(ch, c->chains[i], "%s block %zu: chain_root / chain_step", c->name, i);
        }
        /* local_out is optional. */
        memset(chain, 0, (expect + 1) * sizeof *chain);
        rc = km_hash_sequence(&cfg, c->tokens, c->n_tokens, 0, KM_NO_PARENT, NULL, chain, &got);
        cr_assert_eq(rc, KM_OK);
        cr_assert_eq(got, expect);
        for (size_t i = 0; i < expect; i++)
            cr_assert_eq(chain[i], c->chains[i], "%s block %zu without local_out", c->name, i);
        total_blocks += expect;
        free(local);
        free(chain);
    }
    /* Guard against a parser that silently reads nothing. */
    cr_assert_geq(n, 20, "only %zu vector cases parsed", n);
    cr_assert_geq(total_blocks, 300, "only %zu vector blocks parsed", total_blocks);
    cr_assert(saw_lora && saw_salt && saw_empty, "vector file lacks lora / salt / empty cases");
    free_vectors(cases, n);
}

/* Random tokens; returns chain hashes of every full block of tokens under cfg. */
static uint64_t *hash_all(const km_hash_config *cfg, const uint32_t *tokens, size_t n_tokens,
                          uint64_t **local_out, size_t *n_blocks)
{
    size_t nb = n_tokens / cfg->block_size;
    uint64_t *chain = calloc(nb + 1, sizeof *chain), *local = calloc(nb + 1, sizeof *local);
    cr_assert(chain && local);
    int rc = km_hash_sequence(cfg, tokens, n_tokens, 0, KM_NO_PARENT, local, chain, n_blocks);
    cr_assert_eq(rc, KM_OK, "km_hash_sequence: %s", km_error_name(rc));
    cr_assert_eq(*n_blocks, nb);
    if (local_out)
        *local_out = local;
    else
        free(local);
    return chain;
}

Test(hash, continuation_equals_whole_sequence, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const char *loras[] = {NULL, "adapter-1"};
    const char *salts[] = {NULL, "salt-9"};
    for (int round = 0; round < 40; round++) {
        uint32_t bs = 1 + km_rng_below(&r, 20);
        size_t n_tokens = km_rng_below(&r, bs * 30 + 5);
        uint32_t *tokens = malloc((n_tokens + 1) * sizeof *tokens);
        for (size_t i = 0; i < n_tokens; i++)
            tokens[i] = (uint32_t)km_rng_next(&r);
        km_hash_config cfg = {bs, loras[round & 1], salts[(round >> 1) & 1]};
        size_t nb;
        uint64_t *local;
        uint64_t *chain = hash_all(&cfg, tokens, n_tokens, &local, &nb);
        for (size_t k = 1; k < nb; k++) {
            /* Continue after block k-1: position k, parent chain[k-1]; the tail may be partial. */
            uint64_t out[64], lout[64];
            size_t got = 0;
            int rc = km_hash_sequence(&cfg, tokens + k * bs, n_tokens - k * bs, k, chain[k - 1],
                                      lout, out, &got);
            KM_CHECK(rc == KM_OK, "continuation at block %zu: %s", k, km_error_name(rc));
            KM_CHECK(got == nb - k, "continuation at block %zu: %zu blocks, expected %zu", k, got,
                     nb - k);
            for (size_t i = 0; i < got; i++) {
                KM_CHECK(out[i] == chain[k + i], "bs %u lora %s salt %s: continuing at %zu, "
                         "block %zu differs", bs, cfg.lora_name ? cfg.lora_name : "-",
                         cfg.cache_salt ? cfg.cache_salt : "-", k, k + i);
                KM_CHECK(lout[i] == local[k + i], "continuing at %zu: local hash of block %zu "
                         "differs (salt must only seed position 0)", k, k + i);
            }
        }
        /* first_position 0 ignores the parent. */
        if (nb > 0) {
            uint64_t out[64];
            size_t got = 0;
            int rc = km_hash_sequence(&cfg, tokens, n_tokens, 0, km_rng_hash(&r), NULL, out, &got);
            KM_CHECK(rc == KM_OK && got == nb, "first_position 0 with a parent");
            KM_CHECK(memcmp(out, chain, nb * sizeof *out) == 0,
                     "first_position 0 must ignore the parent");
        }
        free(tokens);
        free(chain);
        free(local);
    }
}

static uint32_t *random_tokens(km_rng *r, size_t n)
{
    uint32_t *t = malloc((n + 1) * sizeof *t);
    cr_assert(t);
    for (size_t i = 0; i < n; i++)
        t[i] = km_rng_below(r, 100000);
    return t;
}

Test(hash, salt_changes_block_zero_local_and_every_chain, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const uint32_t bs = 16;
    size_t n_tokens = bs * 12 + 3, nb, nb2;
    uint32_t *tokens = random_tokens(&r, n_tokens);
    km_hash_config plain = {bs, NULL, NULL}, salted = {bs, NULL, "tenant-a"},
                   salted2 = {bs, NULL, "tenant-b"}, empty = {bs, "", ""};
    uint64_t *lp, *ls, *ls2, *le;
    uint64_t *cp = hash_all(&plain, tokens, n_tokens, &lp, &nb);
    uint64_t *cs = hash_all(&salted, tokens, n_tokens, &ls, &nb2);
    uint64_t *cs2 = hash_all(&salted2, tokens, n_tokens, &ls2, &nb2);
    uint64_t *ce = hash_all(&empty, tokens, n_tokens, &le, &nb2);
    KM_CHECK(ls[0] != lp[0] && ls2[0] != ls[0], "salt must change block 0's local hash");
    for (size_t i = 1; i < nb; i++)
        KM_CHECK(ls[i] == lp[i] && ls2[i] == lp[i], "salt changed the local hash of block %zu", i);
    for (size_t i = 0; i < nb; i++) {
        KM_CHECK(cs[i] != cp[i] && cs2[i] != cs[i], "salt did not change chain hash %zu", i);
        KM_CHECK(ce[i] == cp[i] && le[i] == lp[i], "empty lora/salt must equal NULL (block %zu)",
                 i);
    }
    KM_CHECK(km_hash_block_seed(&salted, 0) != km_hash_block_seed(&plain, 0), "salt seed");
    KM_CHECK(km_hash_block_seed(&salted, 1) == KM_HASH_SEED, "salt must not seed block 1");
    KM_CHECK(km_hash_block_seed(&plain, 0) == KM_HASH_SEED, "base seed is 1337");
    free(tokens), free(cp), free(cs), free(cs2), free(ce), free(lp), free(ls), free(ls2), free(le);
}

Test(hash, lora_changes_every_block, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const uint32_t bs = 8;
    size_t n_tokens = bs * 20, nb;
    uint32_t *tokens = random_tokens(&r, n_tokens);
    km_hash_config plain = {bs, NULL, NULL}, a = {bs, "lora-a", NULL}, b = {bs, "lora-b", NULL},
                   a_salted = {bs, "lora-a", "s"};
    uint64_t *lp, *la, *lb, *las;
    uint64_t *cp = hash_all(&plain, tokens, n_tokens, &lp, &nb);
    uint64_t *ca = hash_all(&a, tokens, n_tokens, &la, &nb);
    uint64_t *cb = hash_all(&b, tokens, n_tokens, &lb, &nb);
    uint64_t *cas = hash_all(&a_salted, tokens, n_tokens, &las, &nb);
    for (size_t i = 0; i < nb; i++) {
        KM_CHECK(la[i] != lp[i] && lb[i] != la[i], "lora did not change local hash %zu", i);
        KM_CHECK(ca[i] != cp[i] && cb[i] != ca[i], "lora did not change chain hash %zu", i);
        KM_CHECK(cas[i] != ca[i], "salt under a lora did not change chain hash %zu", i);
        if (i > 0)
            KM_CHECK(las[i] == la[i], "salt under a lora changed local hash %zu", i);
    }
    uint64_t lora_seed = km_hash_block_seed(&a, 5);
    KM_CHECK(lora_seed != KM_HASH_SEED && km_hash_block_seed(&a, 0) == lora_seed,
             "a lora seeds every block the same way");
    KM_CHECK(km_hash_block_seed(&a_salted, 0) != lora_seed &&
             km_hash_block_seed(&a_salted, 1) == lora_seed, "salt under a lora: block 0 only");
    free(tokens), free(cp), free(ca), free(cb), free(cas), free(lp), free(la), free(lb), free(las);
}

Test(hash, remap_reserved_values, .timeout = 30)
{
    cr_assert_eq(km_hash_remap(KM_HASH_RESERVED_EMPTY), KM_HASH_REMAP_EMPTY);
    cr_assert_eq(km_hash_remap(KM_HASH_RESERVED_TOMBSTONE), KM_HASH_REMAP_TOMBSTONE);
    const uint64_t same[] = {2, 3, KM_HASH_REMAP_EMPTY, KM_HASH_REMAP_TOMBSTONE, UINT64_MAX,
                             UINT64_C(0x8000000000000000), 1337};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        cr_assert_eq(km_hash_remap(same[i]), same[i], "remap changed %llx",
                     (unsigned long long)same[i]);
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int i = 0; i < 1000; i++) {
        uint64_t x = km_rng_hash(&r);
        KM_CHECK(km_hash_remap(x) == x, "remap changed %llx", (unsigned long long)x);
        KM_CHECK(km_hash_chain_root(x) == x, "chain_root changed %llx", (unsigned long long)x);
    }
    /* A first block whose local hash is a reserved value gets the remapped chain hash. */
    cr_assert_eq(km_hash_chain_root(0), KM_HASH_REMAP_EMPTY);
    cr_assert_eq(km_hash_chain_root(1), KM_HASH_REMAP_TOMBSTONE);
    /* A chain step is never reserved (spot check on random inputs, including reserved locals). */
    for (int i = 0; i < 1000; i++) {
        uint64_t s = km_hash_chain_step(km_rng_hash(&r), (uint64_t)(i % 3));
        KM_CHECK(s > 1, "chain_step returned a reserved value");
    }
}

/* Window keys (HASHING.md, "Window keys"): vectors from Python's xxhash, 12 bytes hashed. */
Test(hash, window_key_vectors, .timeout = 30)
{
    cr_assert_eq(km_hash_window_key(UINT64_C(0x44a2b2379d6d3c3d), 1), UINT64_C(0x23b135fca6fe7287));
    cr_assert_eq(km_hash_window_key(UINT64_C(0xcb38e4d7fb2dca5c), 1), UINT64_C(0x878762ada09fde58));
    cr_assert_eq(km_hash_window_key(UINT64_C(0x44a2b2379d6d3c3d), 2), UINT64_C(0x42ea90e22955955e));
}

Test(hash, errors, .timeout = 30)
{
    uint32_t tokens[32] = {0};
    uint64_t chain[32];
    size_t n = 77;
    km_hash_config zero = {0, NULL, NULL}, ok = {4, NULL, NULL};
    cr_assert_eq(km_hash_sequence(&zero, tokens, 32, 0, KM_NO_PARENT, NULL, chain, &n),
                 KM_ERR_BLOCK_SIZE);
    cr_assert_eq(km_hash_sequence(NULL, tokens, 32, 0, KM_NO_PARENT, NULL, chain, &n),
                 KM_ERR_NULL_POINTER);
    cr_assert_eq(km_hash_sequence(&ok, NULL, 32, 0, KM_NO_PARENT, NULL, chain, &n),
                 KM_ERR_NULL_POINTER);
    cr_assert_eq(km_hash_sequence(&ok, tokens, 32, 0, KM_NO_PARENT, NULL, NULL, &n),
                 KM_ERR_NULL_POINTER);
    cr_assert_eq(km_hash_sequence(&ok, tokens, 32, 0, KM_NO_PARENT, NULL, chain, NULL),
                 KM_ERR_NULL_POINTER);
    /* No full block: nothing hashed, not an error. */
    n = 77;
    cr_assert_eq(km_hash_sequence(&ok, tokens, 3, 0, KM_NO_PARENT, NULL, chain, &n), KM_OK);
    cr_assert_eq(n, 0);
    n = 77;
    cr_assert_eq(km_hash_sequence(&ok, tokens, 0, 0, KM_NO_PARENT, NULL, chain, &n), KM_OK);
    cr_assert_eq(n, 0);
    /* The partial tail is not hashed. */
    cr_assert_eq(km_hash_sequence(&ok, tokens, 11, 0, KM_NO_PARENT, NULL, chain, &n), KM_OK);
    cr_assert_eq(n, 2);
}

Test(error, names_and_messages_for_every_code, .timeout = 30)
{
    static const struct {
        int code;
        const char *name, *text;
    } codes[] = {
#define KM_TEST_ERROR_ENTRY(name, value, text) {value, #name, text},
        KM_ERROR_MAP(KM_TEST_ERROR_ENTRY)
#undef KM_TEST_ERROR_ENTRY
    };
    size_t n = sizeof codes / sizeof codes[0];
    cr_assert_eq(n, 22, "error map has %zu entries", n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_str_eq(km_error_name(codes[i].code), codes[i].name);
        cr_assert_str_eq(km_strerror(codes[i].code), codes[i].text);
        cr_assert(codes[i].code <= 0, "%s is positive", codes[i].name);
        for (size_t j = 0; j < i; j++)
            cr_assert_neq(codes[i].code, codes[j].code, "duplicate code %d", codes[i].code);
    }
    cr_assert_str_eq(km_error_name(KM_ERR_MEMORY_CAP), "KM_ERR_MEMORY_CAP");
    const int unknown[] = {1, 42, -99, -1000, INT_MIN, INT_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = km_strerror(unknown[i]), *name = km_error_name(unknown[i]);
        cr_assert(s != NULL && name != NULL, "NULL for unknown code %d", unknown[i]);
        cr_assert_str_eq(s, "unknown error", "km_strerror(%d)", unknown[i]);
        cr_assert(name[0] != 0, "empty name for unknown code %d", unknown[i]);
        for (size_t j = 0; j < n; j++)
            cr_assert(strcmp(name, codes[j].name) != 0, "unknown code %d named %s", unknown[i],
                      name);
    }
}

/* Lookahead hashing: block i covers its tokens and the L after it, and is hashed only once they
 * exist. Vectors from Python's xxhash (docs/HASHING.md, "Lookahead hashing"). */
Test(hash, lookahead_vectors_and_split_form, .timeout = 30)
{
    static const struct {
        uint32_t tokens[10];
        size_t n;
        uint32_t lookahead;
        size_t blocks;
        uint64_t local[2], chain[2];
    } cases[] = {
        {{1, 2, 3, 4, 5, 6, 7, 8, 9}, 9, 1, 2,
         {UINT64_C(0x1a92ffa9004c0851), UINT64_C(0x1ac55a72d61806e3)},
         {UINT64_C(0x1a92ffa9004c0851), UINT64_C(0xb64e31be06d3e9dd)}},
        {{1, 2, 3, 4, 5, 6, 7, 8}, 8, 1, 1, {UINT64_C(0x1a92ffa9004c0851), 0},
         {UINT64_C(0x1a92ffa9004c0851), 0}},
        {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 10, 2, 2,
         {UINT64_C(0xe53e9f562d4d0eda), UINT64_C(0x38fbdb9103e14577)},
         {UINT64_C(0xe53e9f562d4d0eda), UINT64_C(0x8bc30087951001ac)}},
        /* Diverging right after block 1's boundary changes block 1 (its lookahead), not block 0. */
        {{1, 2, 3, 4, 5, 6, 7, 9, 9}, 9, 1, 2,
         {UINT64_C(0x1a92ffa9004c0851), UINT64_C(0x3e88eaf4a8c39afb)},
         {UINT64_C(0x1a92ffa9004c0851), UINT64_C(0xf0ed95bbf140bf97)}},
        {{1, 2}, 2, 3, 0, {0, 0}, {0, 0}}, /* fewer tokens than the lookahead */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        km_hash_config cfg = {4, NULL, NULL};
        uint64_t local[3], chain[3];
        size_t nb = 99;
        cr_assert_eq(km_hash_sequence_lookahead(&cfg, cases[c].lookahead, cases[c].tokens,
                                                cases[c].n, 0, KM_NO_PARENT, local, chain, &nb),
                     KM_OK);
        cr_assert_eq(nb, cases[c].blocks, "case %zu: %zu blocks", c, nb);
        for (size_t i = 0; i < nb; i++) {
            cr_assert_eq(local[i], cases[c].local[i], "case %zu block %zu", c, i);
            cr_assert_eq(chain[i], cases[c].chain[i], "case %zu block %zu", c, i);
            uint64_t split = km_hash_local_lookahead(cases[c].tokens + 4 * i, 4,
                                                     cases[c].tokens + 4 * i + 4,
                                                     cases[c].lookahead, KM_HASH_SEED);
            cr_assert_eq(split, local[i], "the split form hashes the same bytes");
        }
    }
    /* Random contents: the split form equals the contiguous one, and L = 0 is plain hashing. */
    km_rng r;
    km_rng_init(&r, km_test_seed());
    uint32_t t[64];
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < 64; i++)
            t[i] = (uint32_t)km_rng_next(&r);
        uint32_t b = 1 + (uint32_t)(km_rng_next(&r) % 40), l = (uint32_t)(km_rng_next(&r) % 20);
        uint64_t seed = km_rng_next(&r);
        cr_assert_eq(km_hash_local_lookahead(t, b, t + b, l, seed), km_hash_local(t, b + l, seed));
    }
    km_hash_config plain = {4, NULL, NULL};
    uint64_t chain[1];
    size_t nb;
    cr_assert_eq(km_hash_sequence_lookahead(&plain, KM_HASH_MAX_LOOKAHEAD + 1, t, 8, 0,
                                            KM_NO_PARENT, NULL, chain, &nb),
                 KM_ERR_INVALID_ARGUMENT);
}
