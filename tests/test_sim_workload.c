/* SPDX-License-Identifier: Apache-2.0 */
/* The simulator's built-in workloads (src/sim/workload.h): deterministic per seed, each shape with
 * the sharing it promises (shared prefixes, sessions whose turns extend each other, bounded
 * prompts), chain hashes that share exactly the tokens the ids share, and workload statistics
 * against a brute-force count over chain hashes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "kvmatch/error.h"
#include "base/u64_map.h"
#include "sim/workload.h"
#include "sim/trace.h"
#include "test_util.h"

static bool same_trace(const km_trace *a, const km_trace *b)
{
    if (a->n_requests != b->n_requests || a->n_ids != b->n_ids)
        return false;
    for (size_t i = 0; i < a->n_requests; i++) {
        const km_trace_request *x = &a->requests[i], *y = &b->requests[i];
        if (x->timestamp_ms != y->timestamp_ms || x->input_length != y->input_length ||
            x->output_length != y->output_length || x->n_ids != y->n_ids ||
            memcmp(x->ids, y->ids, x->n_ids * sizeof *x->ids))
            return false;
    }
    return true;
}

Test(sim_workload, deterministic_per_seed, .timeout = 30)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_generator_config cfg;
        cr_assert_eq(km_sim_generator_config_shape((km_sim_shape)k, &cfg), KM_OK);
        km_trace a, b, c;
        cr_assert_eq(km_sim_generate_trace(&cfg, &a, NULL, 0), KM_OK);
        cr_assert_eq(km_sim_generate_trace(&cfg, &b, NULL, 0), KM_OK);
        cfg.seed = 2;
        cr_assert_eq(km_sim_generate_trace(&cfg, &c, NULL, 0), KM_OK);
        cr_assert_eq(a.n_requests, cfg.requests, "%s", km_sim_shape_name((km_sim_shape)k));
        cr_assert(same_trace(&a, &b), "%s: the same seed gives the same trace",
                  km_sim_shape_name((km_sim_shape)k));
        cr_assert_not(same_trace(&a, &c), "%s: another seed gives another trace",
                      km_sim_shape_name((km_sim_shape)k));
        km_trace_free(&a);
        km_trace_free(&b);
        km_trace_free(&c);
    }
}

Test(sim_workload, shape_names_round_trip, .timeout = 30)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_shape s;
        cr_assert_eq(km_sim_shape_parse(km_sim_shape_name((km_sim_shape)k), &s), KM_OK);
        cr_assert_eq(s, (km_sim_shape)k);
    }
    km_sim_shape s;
    cr_assert_eq(km_sim_shape_parse("chats", &s), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_shape_parse(NULL, &s), KM_ERR_NULL_POINTER);
    cr_assert_str_eq(km_sim_shape_name(KM_SIM_SHAPE_COUNT), "unknown");
}

/* The tokens two prompts share from their start, from their ids alone: whole ids while both use
 * them whole, then the shorter use of the first id they both use in part. */
static uint32_t common_tokens(const km_trace_request *a, const km_trace_request *b)
{
    uint32_t common = 0;
    for (uint32_t k = 0; k < a->n_ids && k < b->n_ids && a->ids[k] == b->ids[k]; k++) {
        uint32_t ua = a->input_length - k * KM_SIM_TOKENS_PER_ID;
        uint32_t ub = b->input_length - k * KM_SIM_TOKENS_PER_ID;
        ua = ua < KM_SIM_TOKENS_PER_ID ? ua : KM_SIM_TOKENS_PER_ID;
        ub = ub < KM_SIM_TOKENS_PER_ID ? ub : KM_SIM_TOKENS_PER_ID;
        common += ua < ub ? ua : ub;
        if (ua < KM_SIM_TOKENS_PER_ID || ub < KM_SIM_TOKENS_PER_ID)
            break;
    }
    return common;
}

/* Does some earlier request's prompt lie wholly inside r's, beyond the shared prefixes (an earlier
 * turn of r's session)? */
static bool extends_an_earlier_turn(const km_trace *t, size_t i, uint32_t shared_ids)
{
    const km_trace_request *r = &t->requests[i];
    for (size_t j = i; j-- > 0 && i - j < 2000;) {
        const km_trace_request *q = &t->requests[j];
        if (q->input_length < r->input_length && q->ids[q->n_ids - 1] >= shared_ids &&
            common_tokens(q, r) == q->input_length)
            return true;
    }
    return false;
}

Test(sim_workload, each_shape_shares_what_it_promises, .timeout = 60)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_generator_config cfg;
        km_sim_generator_config_shape((km_sim_shape)k, &cfg);
        cfg.requests = 1500;
        const char *name = km_sim_shape_name((km_sim_shape)k);
        km_trace t;
        cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK, "%s", name);
        /* The header's and the prefixes' ids come first: the smallest ids. */
        uint32_t shared_ids = cfg.common_tokens / KM_SIM_TOKENS_PER_ID +
                              cfg.prefixes * ((cfg.prefix_tokens_max + KM_SIM_TOKENS_PER_ID - 1) /
                                              KM_SIM_TOKENS_PER_ID);
        size_t extends = 0, on_first = 0;
        for (size_t i = 0; i < t.n_requests; i++) {
            const km_trace_request *r = &t.requests[i];
            if (i)
                cr_assert_geq(r->timestamp_ms, t.requests[i - 1].timestamp_ms, "%s: order", name);
            cr_assert_leq(r->input_length, cfg.max_input_tokens, "%s", name);
            cr_assert_geq(r->input_length,
                          cfg.common_tokens + cfg.prefix_tokens_min + cfg.new_tokens_min, "%s", name);
            /* The ids cover the prompt, then the answer when the next turn would re-send it. */
            cr_assert(r->answer_tokens == r->output_length ||
                          (r->answer_tokens == 0 &&
                           r->input_length + r->output_length > cfg.max_input_tokens),
                      "%s: request %zu knows %u of its %u answer tokens", name, i,
                      r->answer_tokens, r->output_length);
            cr_assert_eq(r->n_ids,
                         (r->input_length + r->answer_tokens + KM_SIM_TOKENS_PER_ID - 1) /
                             KM_SIM_TOKENS_PER_ID,
                         "%s", name);
            cr_assert(r->output_length >= 1 && r->output_length <= 8 * cfg.output_tokens_mean,
                      "%s", name);
            cr_assert_lt(r->ids[0], shared_ids, "%s: request %zu starts with a shared prefix", name, i);
            on_first += common_tokens(r, &t.requests[0]) >= cfg.common_tokens + 1;
            if (i > 0 && t.requests[0].ids[0] == r->ids[0] && cfg.common_tokens)
                cr_assert_geq(common_tokens(r, &t.requests[0]), cfg.common_tokens, "%s", name);
            extends += extends_an_earlier_turn(&t, i, shared_ids);
        }
        if (cfg.session_share > 0) {
            /* Sessions of several turns: a good share of requests extend an earlier one. */
            cr_assert_gt(extends, t.n_requests / 3, "%s: %zu of %zu extend an earlier turn", name,
                         extends, t.n_requests);
        } else {
            cr_assert_eq(extends, 0, "%s: single turns extend nothing", name);
        }
        /* Popular prefixes: the first request's prefix comes back often. */
        cr_assert_gt(on_first, t.n_requests / 20, "%s", name);
        km_trace_free(&t);
    }
}

/* A follow-up turn names the previous turn of its session: an earlier request whose prompt and
 * answer its own prompt extends (the same ids, then more, and more tokens than both), at most
 * once; single-turn shapes name none. */
Test(sim_workload, a_follow_up_names_its_previous_turn, .timeout = 60)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_generator_config cfg;
        cr_assert_eq(km_sim_generator_config_shape((km_sim_shape)k, &cfg), KM_OK);
        cfg.requests = 500;
        km_trace t;
        cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
        bool *named = calloc(t.n_requests, sizeof *named);
        size_t follow_ups = 0;
        for (size_t i = 0; i < t.n_requests; i++) {
            const km_trace_request *q = &t.requests[i];
            if (!q->previous_turn)
                continue;
            follow_ups++;
            size_t p = q->previous_turn - 1;
            const km_trace_request *prev = &t.requests[p];
            cr_assert_lt(p, i, "%s request %zu", km_sim_shape_name((km_sim_shape)k), i);
            cr_assert_not(named[p], "turn %zu is the previous of two", p);
            named[p] = true;
            cr_assert_leq(prev->timestamp_ms, q->timestamp_ms);
            cr_assert_gt(prev->answer_tokens, 0, "a re-sent answer is known");
            cr_assert_gt(q->input_length, prev->input_length + prev->answer_tokens);
            cr_assert_geq(q->n_ids, prev->n_ids);
            cr_assert_eq(memcmp(q->ids, prev->ids, prev->n_ids * sizeof *q->ids), 0,
                         "request %zu does not extend its previous turn's prompt", i);
        }
        if (cfg.session_share > 0)
            cr_assert_gt(follow_ups, t.n_requests / 4, "%s", km_sim_shape_name((km_sim_shape)k));
        else
            cr_assert_eq(follow_ups, 0, "%s", km_sim_shape_name((km_sim_shape)k));
        free(named);
        km_trace_free(&t);
    }
}

/* A request's own text (its question, its message) shares no id with another request's: an id
 * stands for fixed tokens, so text in an id that others' prompts also cover would be their text
 * too. In the single-turn shapes every id two requests share is a prefix's, so the tokens past the
 * shared ids are at least the request's own new_tokens_min, whatever the prefixes' drawn lengths
 * (several seeds, so many lengths). */
Test(sim_workload, own_text_starts_an_id_of_its_own, .timeout = 60)
{
    const km_sim_shape single_turn[] = {KM_SIM_SHAPE_SYSTEM_PROMPT, KM_SIM_SHAPE_DOCQA};
    for (size_t k = 0; k < sizeof single_turn / sizeof single_turn[0]; k++)
        for (uint64_t seed = 1; seed <= 8; seed++) {
            km_sim_generator_config cfg;
            cr_assert_eq(km_sim_generator_config_shape(single_turn[k], &cfg), KM_OK);
            cfg.seed = seed;
            cfg.requests = 400;
            km_trace t;
            cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
            km_memory memory = {0};
            km_u64map uses;
            km_u64map_init(&uses, &memory);
            for (size_t i = 0; i < t.n_requests; i++)
                for (uint32_t j = 0; j < t.requests[i].n_ids; j++) {
                    uint64_t key = km_u64map_key(t.requests[i].ids[j]);
                    uint64_t *n = km_u64map_find(&uses, key);
                    cr_assert_eq(km_u64map_put(&uses, key, n ? *n + 1 : 1, 1), KM_OK);
                }
            for (size_t i = 0; i < t.n_requests; i++) {
                const km_trace_request *q = &t.requests[i];
                uint32_t shared = 0;
                while (shared < q->n_ids &&
                       *km_u64map_find(&uses, km_u64map_key(q->ids[shared])) > 1)
                    shared++;
                uint64_t covered = (uint64_t)shared * KM_SIM_TOKENS_PER_ID;
                cr_assert_geq((int64_t)q->input_length - (int64_t)covered,
                              (int64_t)cfg.new_tokens_min,
                              "%s seed %llu request %zu: %u tokens, %u ids shared with others",
                              km_sim_shape_name(single_turn[k]), (unsigned long long)seed, i,
                              q->input_length, shared);
            }
            km_u64map_free(&uses);
            km_trace_free(&t);
        }
}

Test(sim_workload, chain_hashes_share_what_ids_share, .timeout = 60)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_generator_config cfg;
        km_sim_generator_config_shape((km_sim_shape)k, &cfg);
        cfg.requests = 150;
        km_trace t;
        cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
        const uint32_t bs = 16;
        size_t cap = cfg.max_input_tokens / bs + 1;
        uint64_t *ha = malloc(cap * sizeof *ha), *hb = malloc(cap * sizeof *hb);
        for (size_t i = 1; i < t.n_requests; i++) {
            const km_trace_request *a = &t.requests[i - 1], *b = &t.requests[i];
            uint32_t na, nb;
            cr_assert_eq(km_trace_chain_hashes(a, bs, KM_SIM_TOKENS_PER_ID, ha, &na), KM_OK);
            cr_assert_eq(km_trace_chain_hashes(b, bs, KM_SIM_TOKENS_PER_ID, hb, &nb), KM_OK);
            cr_assert_eq(na, a->input_length / bs);
            uint32_t shared = 0;
            while (shared < na && shared < nb && ha[shared] == hb[shared])
                shared++;
            cr_assert_eq(shared, common_tokens(a, b) / bs, "%s: requests %zu/%zu",
                         km_sim_shape_name((km_sim_shape)k), i - 1, i);
        }
        free(ha);
        free(hb);
        km_trace_free(&t);
    }
}

/* Reusable tokens by brute force: every full block's chain hash seen in an earlier prompt or known
 * answer, the leading run of them, never the prompt's last token. Of the whole trace;
 * per_request (may be NULL) gets each request's. */
static uint64_t reusable_by_hashes(const km_trace *t, uint32_t bs, uint64_t *per_request)
{
    km_memory memory = {0};
    km_u64map seen;
    km_u64map_init(&seen, &memory);
    uint64_t *h = malloc(((size_t)1 << 20) * sizeof *h);
    uint64_t total = 0;
    for (size_t i = 0; i < t->n_requests; i++) {
        const km_trace_request *r = &t->requests[i];
        uint32_t n;
        cr_assert_eq(km_trace_chain_hashes(r, bs, KM_SIM_TOKENS_PER_ID, h, &n), KM_OK);
        uint32_t run = 0;
        while (run < n && km_u64map_find(&seen, km_u64map_key(h[run])))
            run++;
        uint32_t cap = (r->input_length - 1) / bs;
        total += (uint64_t)(run < cap ? run : cap) * bs;
        if (per_request)
            per_request[i] = (uint64_t)(run < cap ? run : cap) * bs;
        /* What it leaves cached: its prompt's blocks and its known answer's, up to the last
         * token generated (never computed). */
        km_trace_request served = *r;
        served.input_length += r->answer_tokens < r->output_length ? r->answer_tokens
                               : r->output_length ? r->output_length - 1 : 0;
        cr_assert_eq(km_trace_chain_hashes(&served, bs, KM_SIM_TOKENS_PER_ID, h, &n), KM_OK);
        for (uint32_t b = 0; b < n; b++)
            cr_assert_eq(km_u64map_put(&seen, km_u64map_key(h[b]), 1, 1), KM_OK);
    }
    free(h);
    km_u64map_free(&seen);
    return total;
}

static int cmp_ms(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

Test(sim_workload, statistics_match_a_brute_force_count, .timeout = 60)
{
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++) {
        km_sim_generator_config cfg;
        km_sim_generator_config_shape((km_sim_shape)k, &cfg);
        cfg.requests = 300;
        cfg.seed = km_test_seed() + k;
        km_trace t;
        cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
        for (uint32_t bs = 16; bs <= 64; bs *= 4) {
            km_engine_model model;
            km_engine_model_init(&model);
            model.block_size = bs;
            km_sim_workload_stats st;
            cr_assert_eq(km_sim_workload_stats_of(&t, &model, &st), KM_OK);
            uint64_t *each = malloc(t.n_requests * sizeof *each);
            double *floor_ms = malloc(t.n_requests * sizeof *floor_ms);
            uint64_t expect = reusable_by_hashes(&t, bs, each);
            /* With an hour between arrivals everything before a request is computed when it
             * arrives: its floor is its prefill after its reusable tokens, alone on an engine. */
            km_trace spaced = t;
            spaced.requests = malloc(t.n_requests * sizeof *spaced.requests);
            for (size_t i = 0; i < t.n_requests; i++) {
                spaced.requests[i] = t.requests[i];
                spaced.requests[i].timestamp_ms = (uint64_t)i * 3600 * 1000;
            }
            km_sim_workload_stats at_leisure;
            cr_assert_eq(km_sim_workload_stats_of(&spaced, &model, &at_leisure), KM_OK);
            for (size_t i = 0; i < t.n_requests; i++) {
                const km_trace_request *q = &t.requests[i];
                uint64_t own = q->input_length - each[i];
                double tokens = model.token_us * (double)own;
                floor_ms[i] = ((model.step_floor_us > tokens ? model.step_floor_us : tokens) +
                               model.prefill_us_per_pair *
                                   ((double)own * (double)each[i] + (double)own * (own + 1) / 2)) /
                              1000.0;
            }
            qsort(floor_ms, t.n_requests, sizeof *floor_ms, cmp_ms);
            size_t n = t.n_requests;
            cr_assert_float_eq(at_leisure.floor_ttft_p50_ms, floor_ms[(size_t)(0.5 * (n - 1) + 0.5)],
                               1e-9);
            cr_assert_float_eq(at_leisure.floor_ttft_p99_ms,
                               floor_ms[(size_t)(0.99 * (n - 1) + 0.5)], 1e-9);
            /* At the workload's own times a prefix may not exist yet when a request arrives. */
            cr_assert(st.floor_ttft_p50_ms >= at_leisure.floor_ttft_p50_ms - 1e-9);
            cr_assert(st.floor_ttft_p99_ms >= at_leisure.floor_ttft_p99_ms - 1e-9);
            cr_assert(st.floor_ttft_p50_ms >= model.step_floor_us / 1000.0);
            free(spaced.requests);
            free(each);
            free(floor_ms);
            cr_assert_eq(st.reusable_tokens, expect, "%s, block %u, seed %llu: %llu reusable, "
                         "brute force %llu", km_sim_shape_name((km_sim_shape)k), bs,
                         (unsigned long long)cfg.seed, (unsigned long long)st.reusable_tokens,
                         (unsigned long long)expect);
            uint64_t prompt = 0;
            for (size_t i = 0; i < t.n_requests; i++)
                prompt += t.requests[i].input_length;
            cr_assert_eq(st.prompt_tokens, prompt);
            cr_assert_float_eq(st.reusable_share, (double)expect / (double)prompt, 1e-12);
            cr_assert(st.prompt_p50 <= st.prompt_p99 && st.prompt_mean > 0);
            cr_assert_gt(st.arrival_rate_per_s, 0);
        }
        km_trace_free(&t);
    }
    km_sim_workload_stats st;
    km_engine_model model;
    km_engine_model_init(&model);
    cr_assert_eq(km_sim_workload_stats_of(NULL, &model, &st), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_sim_workload_stats_of(&st == NULL ? NULL : &(km_trace){0}, NULL, &st),
                 KM_ERR_NULL_POINTER);
    km_trace empty = {0};
    model.block_size = 0;
    cr_assert_eq(km_sim_workload_stats_of(&empty, &model, &st), KM_ERR_BLOCK_SIZE);
}

/* Known answers of km_sim_floor_ttft_us on an engine of a 1 ms step floor, 10 us a token and no
 * attention cost (ids of 512 tokens, 16-token blocks):
 *  - a: ids 1 2, 1,024 tokens at 0: alone, 10.24 ms;
 *  - b: ids 1 2 3, 1,500 tokens at 1 ms: a's ids exist at 5.12 and 10.24 ms; waiting for either
 *    and joining the step that completes it costs 13 ms either way (4.12 + 9.88 - 1, or 9.24 +
 *    4.76 - 1), less than 15 ms alone;
 *  - c: the same prompt at 100 ms: all but its last block (1,488 tokens) exists: one step floor;
 *  - d: ids 7 8, 512 tokens at 0 and an answer of 50 tokens: 5.12 ms; its answer's tokens exist
 *    one step floor apart from then on, the 50th at 55.12 ms;
 *  - e: ids 7 8, 700 tokens (d's prompt, its answer, 138 more) at 20 ms: d's prompt exists and
 *    the first block of its answer comes at 21.12 ms: waiting for it and adding 172 tokens beyond
 *    a floor (0.72 ms), 1.84 ms, beats 1.88 ms after the prompt alone;
 *  - f: the same at 60 ms: e's whole prompt exists (688 tokens in whole blocks): one step floor;
 *  - then g, the same as e at 0, listed last: it arrives with d and after it (equal times go in
 *    trace order), so waiting 5.12 ms for d's prompt and adding 188 tokens beyond a floor (0.88
 *    ms) beats 7 ms alone: 6 ms; e then finds g's whole prompt computed: one step floor;
 *  - on engines too small for a's prompt and output, a is refused (no floor) and computes nothing
 *    b could find. */
Test(sim_workload, the_floor_of_requests_whose_prefixes_are_still_computed, .timeout = 10)
{
    static const uint32_t pool[] = {1, 2, 3, 7, 8};
    km_trace_request reqs[] = {
        {0, 1024, 1, 2, pool, 0, 0},          {1, 1500, 1, 3, pool, 0, 0},
        {100, 1500, 1, 3, pool, 0, 0},        {0, 512, 100, 2, pool + 3, 0, 50},
        {20, 700, 1, 2, pool + 3, 0, 0},      {60, 700, 1, 2, pool + 3, 0, 0},
    };
    km_trace t = {reqs, 6, (uint32_t *)pool, 5};
    km_engine_model model;
    km_engine_model_init(&model);
    model.block_size = 16;
    model.max_num_batched_tokens = 8192;
    model.step_floor_us = 1000;
    model.token_us = 10;
    model.prefill_us_per_pair = 0;
    double us[7];
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, us), KM_OK);
    const double expect[] = {10240, 13000, 1000, 5120, 1840, 1000};
    for (size_t i = 0; i < 6; i++)
        cr_assert_float_eq(us[i], expect[i], 1e-6, "request %zu: %.3f us, expected %.3f", i, us[i],
                           expect[i]);
    km_trace_request with_g[7];
    memcpy(with_g, reqs, sizeof reqs);
    with_g[6] = (km_trace_request){0, 700, 1, 2, pool + 3, 0, 0};
    km_trace t2 = {with_g, 7, (uint32_t *)pool, 5};
    cr_assert_eq(km_sim_floor_ttft_us(&t2, &model, us), KM_OK);
    cr_assert_float_eq(us[6], 6000, 1e-6, "g: %.3f us", us[6]);
    cr_assert_float_eq(us[4], 1000, 1e-6, "e after g: %.3f us", us[4]);
    cr_assert_float_eq(us[1], 13000, 1e-6, "b: %.3f us", us[1]);
    /* With an answer of 600 tokens a needs 102 blocks, b 94 (its one output token too): engines of
     * 100 refuse a, and b finds nothing of it and computes its 1,500 tokens. */
    reqs[0].output_length = 600;
    model.capacity_blocks = 100;
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, us), KM_OK);
    cr_assert(isnan(us[0]), "a: %.3f us", us[0]);
    cr_assert_float_eq(us[1], 15000, 1e-6, "b: %.3f us", us[1]);
    model.capacity_blocks = 93;
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, us), KM_OK);
    cr_assert(isnan(us[1]) && !isnan(us[3]), "b refused at 93 blocks too: %.3f us", us[1]);
    model.capacity_blocks = 94;
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, us), KM_OK);
    cr_assert_float_eq(us[1], 15000, 1e-6, "b admitted at 94 blocks: %.3f us", us[1]);
    cr_assert_eq(km_sim_floor_ttft_us(NULL, &model, us), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, NULL), KM_ERR_NULL_POINTER);
    model.block_size = 0;
    cr_assert_eq(km_sim_floor_ttft_us(&t, &model, us), KM_ERR_BLOCK_SIZE);
}

Test(sim_workload, bad_configs_and_trim, .timeout = 10)
{
    km_sim_generator_config cfg;
    km_trace t;
    char why[256] = "";
    km_sim_generator_config_init(&cfg);
    cfg.requests = 0;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "requests"), "%s", why);
    km_sim_generator_config_init(&cfg);
    cfg.rate_per_s = 0;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    km_sim_generator_config_init(&cfg);
    cfg.session_share = 1.5;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    km_sim_generator_config_init(&cfg);
    cfg.turns_max = 1;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    km_sim_generator_config_init(&cfg);
    cfg.max_input_tokens = cfg.prefix_tokens_max;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "max_input_tokens"), "%s", why);
    km_sim_generator_config_init(&cfg);
    cfg.common_tokens = 100;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "common_tokens"), "%s", why);
    km_sim_generator_config_init(&cfg);
    cfg.shape = KM_SIM_SHAPE_COUNT;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_generate_trace(NULL, &t, why, sizeof why), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_sim_generator_config_shape(KM_SIM_SHAPE_COUNT, &cfg), KM_ERR_INVALID_ARGUMENT);

    km_sim_generator_config_init(&cfg);
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
    uint64_t last = t.requests[99].timestamp_ms;
    cr_assert_eq(km_sim_trace_trim(&t, 100, 0.5), KM_OK);
    cr_assert_eq(t.n_requests, 100);
    cr_assert_leq(t.requests[99].timestamp_ms, last / 2 + 1);
    cr_assert_geq(t.requests[99].timestamp_ms + 1, last / 2);
    cr_assert_eq(km_sim_trace_trim(&t, 0, 0), KM_ERR_INVALID_ARGUMENT);
    km_trace_free(&t);
}

/* Generation whose arrays cannot be allocated (a common header of 16 MB, and as much for the
 * prompt, with the address space capped 8 MB above what the process holds) fails with
 * KM_ERR_OUT_OF_MEMORY and leaves the trace empty. Each test runs in a process of its own, so the
 * cap ends with it. */
Test(sim_workload, arrays_that_cannot_be_allocated_are_out_of_memory, .timeout = 10)
{
#if defined(__SANITIZE_ADDRESS__)
    cr_skip_test("AddressSanitizer reserves its shadow memory: an address space cap fails it");
#endif
    km_sim_generator_config cfg;
    km_sim_generator_config_init(&cfg);
    cfg.common_tokens = 512u * 4000000u;
    cfg.max_input_tokens = cfg.common_tokens + 64u * 512u;
    unsigned long pages = 0;
    FILE *statm = fopen("/proc/self/statm", "r");
    cr_assert_not_null(statm);
    cr_assert_eq(fscanf(statm, "%lu", &pages), 1);
    fclose(statm);
    struct rlimit before, capped;
    cr_assert_eq(getrlimit(RLIMIT_AS, &before), 0);
    capped = before;
    capped.rlim_cur = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + (8u << 20);
    cr_assert_eq(setrlimit(RLIMIT_AS, &capped), 0);
    km_trace t;
    char why[256] = "";
    int rc = km_sim_generate_trace(&cfg, &t, why, sizeof why);
    cr_assert_eq(setrlimit(RLIMIT_AS, &before), 0);
    cr_assert_eq(rc, KM_ERR_OUT_OF_MEMORY, "%d: %s", rc, why);
    cr_assert(strstr(why, "out of memory"), "%s", why);
    cr_assert_eq(t.n_requests, 0);
    cr_assert_null(t.requests);
}
