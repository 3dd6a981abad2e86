/* SPDX-License-Identifier: Apache-2.0 */
/* The policies that reproduce peers' routers beyond kv and cache_aware, and kvmatch's own:
 * llmd (llm-d's precise prefix-cache scorer with its queue and KV-utilization scorers), preble
 * (Preble's E2) and ttft (the lowest predicted time to first token plus the prefill work a choice
 * adds). Known answers worked out by hand from each source's rules, and invariants on fresh random
 * candidates: an idle worker holding the whole prompt wins; a saturated one loses. */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "test_util.h"

#include "kvmatch/policy.h"

static km_policy_candidate cand(uint32_t worker, uint32_t depth, uint32_t in_flight,
                                uint32_t prefilling, uint64_t pending, uint64_t decode_blocks)
{
    km_policy_candidate c;
    memset(&c, 0, sizeof c);
    c.worker = worker;
    c.depth = c.device_blocks = depth;
    c.in_flight = in_flight;
    c.prefilling = prefilling;
    c.pending_prefill_tokens = pending;
    c.active_decode_blocks = c.allocated_blocks = decode_blocks;
    return c;
}

/* Round numbers, so the expected costs below are arithmetic. */
static km_policy_config config(km_policy_kind kind)
{
    km_policy_config cfg;
    km_policy_config_init(&cfg);
    cfg.kind = kind;
    km_engine_model *m = &cfg.engine;
    m->block_size = 16;
    m->capacity_blocks = 1000;
    m->max_num_batched_tokens = 1000;
    m->max_num_seqs = 100;
    m->step_floor_us = 1000;
    m->token_us = 10;
    m->prefill_us_per_pair = 0;
    m->decode_us_per_request = 0;
    m->decode_us_per_context_token = 0;
    m->host_load_us_per_block = 0;
    m->disk_load_us_per_block = 0;
    return cfg;
}

static km_policy_request request(uint32_t n_blocks, uint64_t prompt, uint64_t output)
{
    km_policy_request r = {n_blocks, 16, prompt, output, false};
    return r;
}

static km_policy_decision decide(const km_policy_config *cfg, const km_policy_request *req,
                                 const km_policy_candidate *c, uint32_t n, double *costs)
{
    km_policy_state st;
    km_policy_state_init(&st, 1);
    km_policy_decision d;
    cr_assert_eq(km_policy_decide(cfg, &st, req, c, n, &d, costs), KM_OK, "%s",
                 km_policy_last_error(&st));
    return d;
}

/* llm-d: score = 2 x prefix + 1 x queue + 1 x (1 - KV usage). Prefix: min-max over the workers
 * that hold the first block (others 0, a lone holder or equal holders 1); queue: (max - q) /
 * (max - min), all equal 1; usage: allocated blocks over the capacity. */
Test(policy_peers, llmd_known_answers, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_LLMD);
    km_policy_request req = request(10, 160, 10);
    /* w1 holds 8 blocks, w2 holds 4 (the shorter holder scores 0, as a miss does), w3 none. */
    km_policy_candidate c[3] = {cand(1, 8, 4, 4, 0, 500), cand(2, 4, 0, 0, 0, 100),
                                cand(3, 0, 2, 2, 0, 0)};
    double costs[3];
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_float_eq(costs[0], 2 * 1.0 + 1 * 0.0 + 1 * 0.5, 1e-12);
    cr_assert_float_eq(costs[1], 2 * 0.0 + 1 * 1.0 + 1 * 0.9, 1e-12);
    cr_assert_float_eq(costs[2], 2 * 0.0 + 1 * 0.5 + 1 * 1.0, 1e-12);
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_MAX_SCORE);
    cr_assert_float_eq(d.chosen_cost, 2.5, 1e-12);
    /* A lone holder scores 1 on the prefix; a queue that outweighs it moves the choice. */
    cfg.llmd.queue_weight = 3;
    c[1].depth = c[1].device_blocks = 0;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_float_eq(costs[0], 2 * 1.0 + 3 * 0.0 + 0.5, 1e-12);
    cr_assert_float_eq(costs[1], 2 * 0.0 + 3 * 1.0 + 0.9, 1e-12);
    cr_assert_eq(d.chosen, 1);
    /* A host-tier block counts host_tier_weight (0.8) on the prefix. */
    km_policy_config h = config(KM_POLICY_LLMD);
    km_policy_candidate t[2] = {cand(1, 5, 0, 0, 0, 0), cand(2, 5, 0, 0, 0, 0)};
    t[1].device_blocks = 4;
    t[1].host_blocks = 1;
    d = decide(&h, &req, t, 2, costs);
    cr_assert_float_eq(costs[1], 2 * 0.0 + 1 + 1, 1e-12, "4.8 is the minimum of {5, 4.8}");
    cr_assert_eq(d.chosen, 0);
    /* Equal scores fall to the load order. */
    km_policy_candidate e[2] = {cand(7, 3, 1, 0, 50, 0), cand(4, 3, 1, 0, 10, 0)};
    d = decide(&h, &req, e, 2, NULL);
    cr_assert_eq(e[d.chosen].worker, 4);
}

/* Preble E2: cached tokens (the deepest match anywhere, vLLM's hit rule) over the rest -> exploit
 * among the workers holding that match; else explore over all. Either picks the lowest load cost
 * L = queued prefill time + running decodes x expected output x the worker's time per token. */
Test(policy_peers, preble_exploits_and_explores, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_PREBLE);
    km_policy_request req = request(10, 170, 10);
    /* w1 holds 8 of 10 blocks (128 cached of 170 tokens: exploit) but has queued work; w2 holds 8
     * with less; w3 holds nothing and is idle. Exploit picks w2, not the idle w3. */
    km_policy_candidate c[3] = {cand(1, 8, 5, 5, 3000, 0), cand(2, 8, 2, 2, 1000, 0),
                                cand(3, 0, 0, 0, 0, 0)};
    double costs[3];
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.reason, KM_POLICY_REASON_EXPLOIT);
    /* 3000 queued tokens on an idle engine: three full steps of 1000 tokens at 10 us each. */
    cr_assert_float_eq(costs[0], 30.0, 1e-9);
    cr_assert_float_eq(costs[1], 10.0, 1e-9);
    cr_assert_float_eq(costs[2], 0.0, 1e-9);
    /* Decodes: 3 running, 10 tokens to go each, at the worker's decode step (the 1 ms floor);
     * they also take 3 tokens of each step's budget, so the 1000 queued tokens need a second
     * step (10 + 1 ms). */
    c[1].in_flight = 5;
    c[1].prefilling = 2;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_float_eq(costs[1], 11.0 + 3 * 10 * 1.0, 1e-9);
    cr_assert_eq(d.chosen, 0, "w1 now costs less than w2");
    /* Mostly uncached (4 of 10 blocks): explore, the idle worker. */
    c[0].depth = c[0].device_blocks = 4;
    c[1].depth = c[1].device_blocks = 4;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 2);
    cr_assert_eq(d.reason, KM_POLICY_REASON_EXPLORE);
}

/* ttft: predicted TTFT (engine_model.h) plus the extra prefill work over the best-cached worker,
 * times the requests waiting at the worker (at least one). */
Test(policy_peers, ttft_known_answers, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(100, 1610, 20);
    /* w1 holds 90 of the 100 blocks with 2000 tokens queued; w2 is idle and cold. */
    km_policy_candidate c[2] = {cand(1, 90, 2, 2, 2000, 0), cand(2, 0, 0, 0, 0, 0)};
    double costs[2];
    km_policy_decision d = decide(&cfg, &req, c, 2, costs);
    /* w1: half of the 1000-token step it is running (5 ms), then 2000 queued + 170 own tokens = 3
     * steps of the 1 ms floor or 10 us a token: 10 + 10 + 1.7 ms. w2 (idle: no step to wait for):
     * 1610 tokens, 10 + 6.1 ms, plus 1440 extra tokens (14.4 ms) once. */
    cr_assert_float_eq(costs[0], 5.0 + 21.7, 1e-9);
    cr_assert_float_eq(costs[1], 16.1 + 14.4, 1e-9);
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_TTFT);
    /* A longer queue at the owner tips it. */
    c[0].pending_prefill_tokens = 20000;
    d = decide(&cfg, &req, c, 2, costs);
    cr_assert_float_eq(costs[0], 5.0 + 201.7, 1e-9);
    cr_assert_eq(d.chosen, 1);
    /* Moving the work onto a worker with waiting requests charges it once per waiter. */
    c[1].prefilling = c[1].in_flight = 3;
    d = decide(&cfg, &req, c, 2, costs);
    cr_assert_float_eq(costs[1], 16.1 + 3 * 14.4, 1e-9);
    /* The queued prefills' attention counts: at 0.001 us a pair, 10^6 pairs queued at w1 add 1 ms
     * to its time and nothing to w2's. */
    c[0].pending_prefill_tokens = 2000;
    c[1].prefilling = c[1].in_flight = 0;
    cfg.engine.prefill_us_per_pair = 0.001;
    double no_pairs[2];
    decide(&cfg, &req, c, 2, no_pairs);
    c[0].pending_prefill_pairs = 1000000;
    decide(&cfg, &req, c, 2, costs);
    cr_assert_float_eq(costs[0], no_pairs[0] + 1.0, 1e-9);
    cr_assert_float_eq(costs[1], no_pairs[1], 1e-9);
    c[0].pending_prefill_pairs = 0;
    cfg.engine.prefill_us_per_pair = 0;
    /* A worker without room for the request's KV waits for running requests to end. */
    km_policy_candidate m[2] = {cand(1, 0, 4, 0, 0, 0), cand(2, 0, 4, 0, 0, 995)};
    d = decide(&cfg, &req, m, 2, costs);
    cr_assert_gt(costs[1], costs[0]);
    cr_assert_eq(d.chosen, 0);
}

/* However long the prompt, a worker holding its first 64 tokens never costs more than one that
 * is alike but cold, with the default engine model (whose attention term grows with the square
 * of the prompt): attention pairs past 2^64 saturate, never wrap into a small count. */
Test(policy_peers, a_huge_prompt_never_makes_a_cold_worker_cheaper_than_a_warm_one, .timeout = 30)
{
    km_policy_config cfg;
    km_policy_config_init(&cfg);
    cfg.kind = KM_POLICY_TTFT;
    const uint64_t prompts[] = {100000,
                                UINT64_C(1) << 31,
                                (UINT64_C(1) << 32) - 1,
                                UINT64_C(1) << 32,
                                UINT64_C(5000000000),
                                UINT64_C(1) << 33,
                                UINT64_C(1) << 40,
                                UINT64_MAX / 2,
                                UINT64_MAX};
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        km_policy_candidate c[2] = {cand(0, 0, 0, 0, 0, 0), cand(1, 4, 0, 0, 0, 0)};
        km_policy_request req = {8, 16, prompts[i], 0, false};
        double costs[2];
        km_policy_decision d = decide(&cfg, &req, c, 2, costs);
        cr_assert_leq(costs[1], costs[0], "prompt %" PRIu64 ": warm %g, cold %g", prompts[i],
                      costs[1], costs[0]);
        cr_assert_eq(c[d.chosen].worker, 1, "prompt %" PRIu64 ": the cold worker chosen",
                     prompts[i]);
    }
}

/* Equal predicted times go to the deeper queued hit (it leaves the others' caches for other
 * prefixes), whichever order the candidates come in. A hashes-only request of 4 blocks caps every
 * hit at 3 blocks (its last token is always computed), so depths 4 and 3 cost the same. */
Test(policy_peers, ttft_ties_go_to_the_deeper_hit, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(4, 0, 20);
    for (int order = 0; order < 2; order++) {
        km_policy_candidate deep = cand(1, 4, 1, 0, 0, 0), shallow = cand(2, 3, 1, 0, 0, 0);
        km_policy_candidate c[2] = {order ? shallow : deep, order ? deep : shallow};
        double costs[2];
        km_policy_decision d = decide(&cfg, &req, c, 2, costs);
        cr_assert_float_eq(costs[0], costs[1], 1e-12, "the capped hits cost the same");
        cr_assert_eq(c[d.chosen].worker, 1, "order %d: the deeper hit", order);
    }
}

/* Workers within spread_ms of the lowest cost take arrivals in turn: the one whose last arrival
 * is the oldest wins, so equal idle workers are not chosen by their order. */
Test(policy_peers, ttft_spreads_near_equal_workers_by_their_last_arrival, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(10, 160, 20);
    km_policy_candidate c[3] = {cand(1, 0, 0, 0, 0, 0), cand(2, 0, 0, 0, 0, 0),
                                cand(3, 0, 0, 0, 0, 0)};
    c[0].last_arrival = 7;
    c[1].last_arrival = 5;
    c[2].last_arrival = 9;
    double costs[3];
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_float_eq(costs[0], costs[1], 1e-12);
    cr_assert_eq(d.chosen, 1, "equal costs: the oldest arrival");
    cr_assert_eq(d.reason, KM_POLICY_REASON_SPREAD, "the load order alone would choose w1");
    cr_assert_float_eq(d.chosen_cost, costs[1], 1e-12);
    /* Never routed to counts as oldest; equal arrivals fall back to the load order. */
    c[2].last_arrival = 0;
    cr_assert_eq(decide(&cfg, &req, c, 3, costs).chosen, 2);
    c[0].last_arrival = c[1].last_arrival = c[2].last_arrival = 4;
    c[0].in_flight = c[0].prefilling = 1;
    c[0].pending_prefill_tokens = 1;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 1, "ties: the load order");
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_TTFT);
    /* w1 runs one decode: 0.51 ms dearer than w3 (the rest of its 1 ms step, and its decode
     * token beside the request's 160 in the next). It last had a request longest ago: within
     * 1 ms it wins; at 0.4 ms or with spreading off, the cheapest does. */
    km_policy_candidate e[2] = {cand(1, 0, 0, 0, 0, 0), cand(3, 0, 0, 0, 0, 0)};
    e[0].in_flight = 1; /* one decode running: the rest of its step */
    e[0].last_arrival = 2;
    e[1].last_arrival = 8;
    d = decide(&cfg, &req, e, 2, costs);
    cr_assert_float_eq(costs[0] - costs[1], 0.51, 1e-9);
    cr_assert_eq(d.chosen, 0);
    cr_assert_float_eq(d.chosen_cost, costs[0], 1e-12);
    cfg.ttft.spread_ms = 0.4;
    cr_assert_eq(decide(&cfg, &req, e, 2, costs).chosen, 1);
    cfg.ttft.spread_ms = 0.0;
    cr_assert_eq(decide(&cfg, &req, e, 2, costs).chosen, 1);
    /* spread_ms must be finite and >= 0. */
    const double bad[] = {-0.1, NAN, INFINITY};
    char why[256];
    for (int i = 0; i < 3; i++) {
        cfg.ttft.spread_ms = bad[i];
        cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(why, "ttft.spread_ms"), "%s", why);
    }
}

/* The engine model counts its capacity and per-block load times in blocks of its own size; a pool
 * may hash in larger or smaller blocks. The same worker states and request, written in the
 * engine's 16-token blocks and in a pool's 64-token blocks, get the same costs from every policy
 * that weighs KV memory or lower tiers. */
Test(policy_peers, costs_do_not_depend_on_the_pools_block_size, .timeout = 30)
{
    const km_policy_kind kinds[] = {KM_POLICY_TTFT, KM_POLICY_LLMD, KM_POLICY_PREBLE};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        km_policy_config cfg = config(kinds[k]);
        cfg.engine.host_load_us_per_block = 50; /* per 16-token block */
        double costs[2][3];
        for (uint32_t scale = 1; scale <= 4; scale += 3) { /* blocks of 16, then of 64 tokens */
            km_policy_request req = {40 / scale, 16 * scale, 640, 20, false};
            /* w1: 960 of the engine's 1000 blocks allocated (a memory wait for the request's 42),
             * 32 blocks of the prompt, 8 of them in host memory; w2: half as full, cold; w3:
             * nearly empty, 16 blocks of the prompt. */
            km_policy_candidate c[3] = {cand(1, 32 / scale, 6, 2, 800, 960 / scale),
                                        cand(2, 0, 3, 1, 400, 480 / scale),
                                        cand(3, 16 / scale, 1, 0, 0, 32 / scale)};
            c[0].device_blocks = 24 / scale;
            c[0].host_blocks = 8 / scale;
            km_policy_decision d = decide(&cfg, &req, c, 3, costs[scale == 4]);
            (void)d;
        }
        for (int i = 0; i < 3; i++)
            cr_assert_float_eq(costs[0][i], costs[1][i], 1e-9,
                               "%s, worker %d: %.6f in 16-token blocks, %.6f in 64-token blocks",
                               km_policy_kind_name(kinds[k]), i + 1, costs[0][i], costs[1][i]);
    }
}

/* A prompt being prefilled on a worker is as good as cached there for a request queued behind it:
 * ttft weighs the queued depth (the index's depth extended by the blocks queued prefills will
 * store); without it the same worker looks cold and busy. */
Test(policy_peers, ttft_counts_the_prefix_a_queued_prefill_will_store, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(100, 1610, 20);
    /* w1 is computing the same 1600-token prefix for another request; w2 is idle and cold. */
    km_policy_candidate c[2] = {cand(1, 0, 1, 1, 1600, 0), cand(2, 0, 0, 0, 0, 0)};
    c[0].queued_depth = 100;
    double costs[2];
    km_policy_decision d = decide(&cfg, &req, c, 2, costs);
    /* w1: half of its running 1000-token step (5 ms), then 1600 queued + 10 own tokens, 10 + 6.1
     * ms. w2: 1610 tokens, 16.1 ms, plus the 1600 tokens w1 would not recompute (16 ms) once. */
    cr_assert_float_eq(costs[0], 5.0 + 16.1, 1e-9);
    cr_assert_float_eq(costs[1], 16.1 + 16.0, 1e-9);
    cr_assert_eq(d.chosen, 0);
    /* Without the queued depth w1 looks cold behind 1600 tokens: w2 wins. */
    c[0].queued_depth = 0;
    d = decide(&cfg, &req, c, 2, costs);
    cr_assert_float_eq(costs[0], 5.0 + 32.1, 1e-9);
    cr_assert_float_eq(costs[1], 16.1, 1e-9);
    cr_assert_eq(d.chosen, 1);
    /* A queued depth below the index's depth changes nothing. */
    c[0] = cand(1, 60, 1, 1, 1600, 0);
    c[0].queued_depth = 30;
    km_policy_candidate plain[2] = {cand(1, 60, 1, 1, 1600, 0), cand(2, 0, 0, 0, 0, 0)};
    double plain_costs[2];
    decide(&cfg, &req, c, 2, costs);
    decide(&cfg, &req, plain, 2, plain_costs);
    cr_assert_float_eq(costs[0], plain_costs[0], 1e-12);
    cr_assert_float_eq(costs[1], plain_costs[1], 1e-12);
    /* More than the request's blocks is refused. */
    c[0].queued_depth = 101;
    km_policy_state st;
    km_policy_state_init(&st, 1);
    cr_assert_eq(km_policy_decide(&cfg, &st, &req, c, 2, &d, costs), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(km_policy_last_error(&st), "queued depth 101"), "%s",
              km_policy_last_error(&st));
}

/* A worker's used blocks (allocated_blocks) already hold what in-flight work there holds of the
 * request: the blocks queued prefills will store, and a cached prefix other requests in flight use
 * (km_active charges it once per worker). Only the rest of the request's blocks can make it wait
 * for memory, as a prefix no one holds does. */
Test(policy_peers, ttft_counts_no_block_in_flight_work_holds_as_new_memory, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    /* 40 blocks of 16 tokens, 20 output tokens: 42 blocks; 32 of them cached or queued on w1,
     * whose 1000 blocks are 980 allocated (980 + 42 > 1000; 980 + 10 fits). */
    km_policy_request req = request(40, 640, 20);
    km_policy_candidate c[2] = {cand(1, 32, 1, 0, 0, 980), cand(2, 0, 0, 0, 0, 0)};
    km_policy_candidate roomy[2] = {cand(1, 32, 1, 0, 0, 0), cand(2, 0, 0, 0, 0, 0)};
    double costs[2], roomy_costs[2];
    /* A cached prefix other requests use: no memory wait. */
    c[0].prefix_sharers = roomy[0].prefix_sharers = 1;
    decide(&cfg, &req, c, 2, costs);
    decide(&cfg, &req, roomy, 2, roomy_costs);
    cr_assert_float_eq(costs[0], roomy_costs[0], 1e-9, "a shared prefix counted as new memory");
    /* The same prefix cached but used by no one there: taking it is new memory, and waits. */
    c[0].prefix_sharers = roomy[0].prefix_sharers = 0;
    decide(&cfg, &req, c, 2, costs);
    decide(&cfg, &req, roomy, 2, roomy_costs);
    cr_assert_gt(costs[0], roomy_costs[0]);
    /* Blocks a queued prefill there will store are its: no memory wait either. */
    c[0].depth = c[0].device_blocks = roomy[0].depth = roomy[0].device_blocks = 0;
    c[0].queued_depth = roomy[0].queued_depth = 32;
    decide(&cfg, &req, c, 2, costs);
    decide(&cfg, &req, roomy, 2, roomy_costs);
    cr_assert_float_eq(costs[0], roomy_costs[0], 1e-9, "queued blocks counted as new memory");
}

/* Bounded load: a holder loaded past ceil(1.25 x (in flight + 1) / n) is passed over while the
 * request's prefix is in use there by other requests, so a hot prefix is copied to a less loaded
 * worker; a prefix no one else is using there keeps its holder, however loaded. */
Test(policy_peers, ttft_passes_over_a_hot_prefix_on_an_overloaded_holder, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(100, 1610, 20);
    /* 12 in flight: the bound is ceil(1.25 x 13 / 3) = 6; w1 would hold 11. */
    km_policy_candidate c[3] = {cand(1, 100, 10, 0, 0, 0), cand(2, 0, 1, 0, 0, 0),
                                cand(3, 0, 1, 0, 0, 0)};
    double costs[3];
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0, "a cold prefix stays with its holder");
    c[0].prefix_sharers = 3;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_neq(d.chosen, 0, "the hot prefix was queued behind 10 requests");
    cr_assert(isnan(costs[0]), "a worker passed over is not weighed: %g", costs[0]);
    cr_assert(!isnan(costs[1]) && !isnan(costs[2]));
    /* Within the bound (10 in flight: ceil(1.25 x 11 / 3) = 5 >= 4 + 1), or with the bound off,
     * the holder wins. */
    c[0].in_flight = 4;
    c[1].in_flight = c[2].in_flight = 3;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0);
    c[0].in_flight = 10;
    cfg.ttft.load_bound = 0.0;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0);
    /* hot_prefix_sharers 0 bounds a worker whatever it holds; a higher one needs more sharers. */
    cfg.ttft.load_bound = 1.25;
    cfg.ttft.hot_prefix_sharers = 4;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0, "3 sharers are below 4");
    c[0].prefix_sharers = 0;
    cfg.ttft.hot_prefix_sharers = 0;
    cfg.ttft.hot_prefix_share = 0.0; /* no sharers are no share of the load either */
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_neq(d.chosen, 0);
    cfg.ttft.hot_prefix_share = 0.25;
    /* A holder whose hit a worker within the bound matches is weighed: passing it over would copy
     * nothing. Every worker holds the first 10 blocks (a shared preamble), w1 is past the bound
     * with no queue, w2 and w3 have 20000 tokens queued: w1 has the lowest predicted time. */
    cfg.ttft.hot_prefix_sharers = 1;
    km_policy_candidate same[3] = {cand(1, 10, 10, 0, 0, 0), cand(2, 10, 1, 1, 20000, 0),
                                   cand(3, 10, 1, 1, 20000, 0)};
    same[0].prefix_sharers = 9;
    d = decide(&cfg, &req, same, 3, costs);
    cr_assert_eq(d.chosen, 0, "an equal hit within the bound does not pass over the holder");
    cr_assert(!isnan(costs[0]));
    /* One block more at the holder than within the bound: passed over again. */
    same[0].depth = same[0].device_blocks = 11;
    d = decide(&cfg, &req, same, 3, costs);
    cr_assert_neq(d.chosen, 0);
    cr_assert(isnan(costs[0]));
    /* A bound below 1 (other than 0) is refused. */
    cfg.ttft.load_bound = 0.5;
    char why[160];
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "ttft.load_bound"), "%s", why);
}

/* A holder past the bound is passed over only while the prefix's own requests in flight on its
 * holders are, per holder, at least hot_prefix_share x the mean in flight (this request
 * included): otherwise its load is other prefixes' work, which a copy would not take away. */
Test(policy_peers, ttft_copies_a_prefix_only_while_it_is_a_share_of_its_holders_load, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(100, 1610, 20);
    /* 12 in flight: the bound is ceil(1.25 x 13 / 3) = 6, the mean 13 / 3; a quarter of it is
     * 1.08 sharers per holder. */
    km_policy_candidate c[3] = {cand(1, 100, 10, 0, 0, 0), cand(2, 0, 1, 0, 0, 0),
                                cand(3, 0, 1, 0, 0, 0)};
    c[0].prefix_sharers = 1;
    double costs[3];
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0, "1 sharer of 10 in flight: the holder keeps the prefix");
    cr_assert(!isnan(costs[0]));
    c[0].prefix_sharers = 2;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_neq(d.chosen, 0, "2 sharers are past a quarter of the mean");
    cr_assert(isnan(costs[0]));
    /* Two holders, 10 in flight each, w3 idle: 20 in flight, the bound ceil(1.25 x 21 / 3) = 9,
     * a quarter of the mean 1.75 per holder, 3.5 for both. */
    km_policy_candidate two[3] = {cand(1, 100, 10, 0, 0, 0), cand(2, 100, 10, 0, 0, 0),
                                  cand(3, 0, 0, 0, 0, 0)};
    two[0].prefix_sharers = 1;
    two[1].prefix_sharers = 2;
    d = decide(&cfg, &req, two, 3, costs);
    cr_assert_neq(d.chosen, 2, "3 sharers over two holders are under 3.5");
    two[1].prefix_sharers = 3;
    d = decide(&cfg, &req, two, 3, costs);
    cr_assert_eq(d.chosen, 2, "4 sharers over two holders: both passed over");
    cr_assert(isnan(costs[0]) && isnan(costs[1]));
    /* hot_prefix_share 0: no such limit; a share of 100 never copies. */
    two[0].prefix_sharers = two[1].prefix_sharers = 1;
    cfg.ttft.hot_prefix_share = 0.0;
    d = decide(&cfg, &req, two, 3, costs);
    cr_assert_eq(d.chosen, 2);
    two[0].prefix_sharers = two[1].prefix_sharers = 10;
    cfg.ttft.hot_prefix_share = 100.0;
    d = decide(&cfg, &req, two, 3, costs);
    cr_assert_neq(d.chosen, 2);
    /* Negative and not finite shares are refused. */
    char why[160];
    double bad[3] = {-0.5, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        cfg.ttft.hot_prefix_share = bad[i];
        cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(why, "ttft.hot_prefix_share"), "%s", why);
    }
}

/* With warm-ups, the copy the bound wants is made by a prefill of the prefix alone: the request
 * stays with the holder (the choice without the bound) and the worker the bound would have chosen
 * is named to be warmed up with the holder's hit. Where the bound passes over nobody, or the
 * choice without it is no holder, nothing changes and nothing is warmed. */
Test(policy_peers, ttft_warms_a_copy_up_instead_of_a_request_paying_for_it, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_policy_request req = request(100, 1610, 20);
    /* As above: 12 in flight, the bound 6, w1 holds 100 blocks with 10 in flight, 3 sharing. */
    km_policy_candidate c[3] = {cand(1, 100, 10, 0, 0, 0), cand(2, 0, 1, 0, 0, 0),
                                cand(3, 0, 2, 0, 0, 0)};
    c[0].prefix_sharers = 3;
    double costs[3], plain_costs[3];
    km_policy_decision plain = decide(&cfg, &req, c, 3, plain_costs);
    cr_assert_eq(plain.chosen, 1, "the bound copies the prefix to the least loaded cold worker");
    cr_assert_eq(plain.warm_up, KM_POLICY_NO_WARM_UP, "no warm-up unless the caller can do one");
    cr_assert_eq(plain.warm_up_blocks, 0);
    req.warm_ups = true;
    km_policy_decision d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0, "the request stays with the holder");
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_TTFT);
    cr_assert_eq(d.warm_up, 1, "the worker the bound chose is warmed up");
    /* The hit an engine counts: (1610 - 1) / 16 = 100 blocks. */
    cr_assert_eq(d.warm_up_blocks, 100);
    cr_assert(!isnan(costs[0]), "the holder's cost is the one compared");
    cr_assert_float_eq(d.chosen_cost, costs[0], 1e-9);
    cr_assert_float_eq(costs[1], plain_costs[1], 1e-9);
    cr_assert_float_eq(costs[2], plain_costs[2], 1e-9);
    /* The prompt ends inside its last block: the hit stops short of the last token's block. */
    km_policy_request aligned = request(100, 1600, 20);
    aligned.warm_ups = true;
    d = decide(&cfg, &aligned, c, 3, costs);
    cr_assert_eq(d.warm_up_blocks, 99, "a block-aligned prompt recomputes its last block");
    /* A cold prefix (no sharers): the bound passes over nobody, nothing is warmed. */
    c[0].prefix_sharers = 0;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.warm_up, KM_POLICY_NO_WARM_UP);
    c[0].prefix_sharers = 3;
    /* The holder so swamped that a cold worker is the best choice even without the bound: that
     * is a plain copy, paid by the request, and nothing else is warmed. */
    c[0].prefilling = 10;
    c[0].pending_prefill_tokens = 10000000;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.warm_up, KM_POLICY_NO_WARM_UP);
    c[0].prefilling = 0;
    c[0].pending_prefill_tokens = 0;
    /* A worker within the bound that will hold the prefix once its queued prefill has run (a
     * warm-up routed there): the holder is no longer passed over, and nothing more is warmed. */
    c[1].queued_depth = 100;
    c[1].prefilling = 1;
    c[1].pending_prefill_tokens = 1600;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.warm_up, KM_POLICY_NO_WARM_UP);
    cr_assert(!isnan(costs[0]));
    c[1].queued_depth = 0;
    c[1].prefilling = 0;
    c[1].pending_prefill_tokens = 0;
    /* Bound off: never a warm-up. Other policies: never one either. */
    cfg.ttft.load_bound = 0.0;
    d = decide(&cfg, &req, c, 3, costs);
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.warm_up, KM_POLICY_NO_WARM_UP);
    km_policy_kind others[] = {KM_POLICY_KV,          KM_POLICY_CACHE_AWARE, KM_POLICY_PREFIX,
                               KM_POLICY_LEAST_LOAD,  KM_POLICY_ROUND_ROBIN, KM_POLICY_LLMD,
                               KM_POLICY_PREBLE};
    for (size_t k = 0; k < sizeof others / sizeof others[0]; k++) {
        km_policy_config oc = config(others[k]);
        d = decide(&oc, &req, c, 3, NULL);
        cr_assert_eq(d.warm_up, KM_POLICY_NO_WARM_UP, "%s", km_policy_kind_name(others[k]));
        cr_assert_eq(d.warm_up_blocks, 0);
    }
}

static km_policy_candidate random_candidate(km_rng *r, uint32_t worker, uint32_t n_blocks)
{
    uint32_t in_flight = km_rng_below(r, 50);
    km_policy_candidate c = cand(worker, km_rng_below(r, n_blocks + 1), in_flight,
                                 in_flight ? km_rng_below(r, in_flight + 1) : 0,
                                 km_rng_below(r, 30000), km_rng_below(r, 900));
    if (c.depth && km_rng_percent(r, 30)) {
        c.host_blocks = km_rng_below(r, c.depth + 1);
        c.device_blocks = c.depth - c.host_blocks;
    }
    if (c.prefilling && km_rng_percent(r, 30)) /* a busy worker may be computing more of it */
        c.queued_depth = c.depth + km_rng_below(r, n_blocks - c.depth + 1);
    return c;
}

Test(policy_peers, an_idle_worker_with_the_whole_prompt_wins, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_policy_kind kinds[] = {KM_POLICY_LLMD, KM_POLICY_PREBLE, KM_POLICY_TTFT};
    for (int i = 0; i < 3000; i++) {
        km_policy_config cfg = config(kinds[i % 3]);
        uint32_t n_blocks = 1 + km_rng_below(&r, 200), n = 2 + km_rng_below(&r, 10);
        km_policy_request req = request(n_blocks, (uint64_t)n_blocks * 16 + 1 + km_rng_below(&r, 15),
                                        km_rng_below(&r, 500));
        km_policy_candidate c[12];
        uint32_t idle = km_rng_below(&r, n);
        for (uint32_t k = 0; k < n; k++)
            c[k] = random_candidate(&r, 10 + k, n_blocks);
        c[idle] = cand(10 + idle, n_blocks, 0, 0, 0, 0);
        for (uint32_t k = 0; k < n; k++)
            if (k != idle && c[k].depth == n_blocks && c[k].in_flight == 0)
                c[k].in_flight = c[k].prefilling = 1; /* one idle whole holder only */
        km_policy_decision d = decide(&cfg, &req, c, n, NULL);
        KM_CHECK(d.chosen == idle, "%s chose worker %u (depth %u, in flight %u), not the idle "
                 "holder of the whole prompt %u",
                 km_policy_kind_name(cfg.kind), c[d.chosen].worker, c[d.chosen].depth,
                 c[d.chosen].in_flight, c[idle].worker);
    }
}

Test(policy_peers, a_saturated_worker_loses, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_policy_kind kinds[] = {KM_POLICY_LLMD, KM_POLICY_PREBLE, KM_POLICY_TTFT};
    for (int i = 0; i < 3000; i++) {
        km_policy_config cfg = config(kinds[i % 3]);
        uint32_t n_blocks = 1 + km_rng_below(&r, 200), n = 2 + km_rng_below(&r, 10);
        km_policy_request req = request(n_blocks, (uint64_t)n_blocks * 16, km_rng_below(&r, 500));
        km_policy_candidate c[12];
        /* Every worker holds the same prefix; one is swamped: the longest queue, every slot and
         * block taken. */
        uint32_t depth = km_rng_below(&r, n_blocks + 1);
        for (uint32_t k = 0; k < n; k++) {
            c[k] = random_candidate(&r, 10 + k, n_blocks);
            c[k].depth = c[k].device_blocks = depth;
            c[k].host_blocks = 0;
        }
        uint32_t full = km_rng_below(&r, n);
        c[full] = cand(10 + full, depth, 400, 300, 10000000, 2000);
        km_policy_decision d = decide(&cfg, &req, c, n, NULL);
        KM_CHECK(d.chosen != full, "%s chose the saturated worker", km_policy_kind_name(cfg.kind));
    }
}

/* ttft and preble time a worker's decodes by their context, the decodes' share of its
 * active_decode_blocks x block_size tokens: a product past 2^64 counts as 2^64 tokens, never as
 * what is left after wrapping, so a worker running more decode KV never looks faster than the same
 * worker with less. Known answer, then fresh random workers with the default engine model. */
Test(policy_peers, more_decode_blocks_never_look_faster, .timeout = 60)
{
    km_policy_kind kinds[] = {KM_POLICY_TTFT, KM_POLICY_PREBLE};
    /* 2^60 + 1000 blocks of 16 tokens wrap to 16,000 tokens, under the 52,608 of 3,288 blocks. */
    km_policy_candidate c[2] = {cand(1, 4, 24, 10, 5000, 3288),
                                cand(2, 4, 24, 10, 5000, (UINT64_C(1) << 60) + 1000)};
    c[1].allocated_blocks = c[0].allocated_blocks;
    km_policy_request req = request(8, 128, 100);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        km_policy_config cfg;
        km_policy_config_init(&cfg);
        cfg.kind = kinds[k];
        double costs[2];
        km_policy_decision d = decide(&cfg, &req, c, 2, costs);
        cr_assert_eq(d.chosen, 0, "%s chose the worker with 2^60 decode blocks: costs %.6f, %.6f",
                     km_policy_kind_name(cfg.kind), costs[0], costs[1]);
        cr_assert_lt(costs[0], costs[1], "%s", km_policy_kind_name(cfg.kind));
    }

    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int i = 0; i < 4000; i++) {
        km_policy_config cfg;
        km_policy_config_init(&cfg);
        cfg.kind = kinds[i % 2];
        uint32_t n_blocks = 1 + km_rng_below(&r, 200);
        km_policy_request rq = request(n_blocks, 0, km_rng_below(&r, 2000));
        rq.block_size = km_rng_percent(&r, 50) ? 16 : 1 + km_rng_below(&r, 1000);
        km_policy_candidate pair[2];
        pair[0] = random_candidate(&r, 10, n_blocks);
        pair[0].in_flight += 1 + km_rng_below(&r, 40);
        pair[0].active_decode_blocks = km_rng_below(&r, 100000);
        pair[1] = pair[0];
        pair[1].worker = 11;
        uint64_t add = km_rng_next(&r) >> km_rng_below(&r, 8);
        pair[1].active_decode_blocks = UINT64_MAX - pair[0].active_decode_blocks < add
                                           ? UINT64_MAX
                                           : pair[0].active_decode_blocks + add;
        if (km_rng_percent(&r, 50)) { /* either order */
            km_policy_candidate t = pair[0];
            pair[0] = pair[1];
            pair[1] = t;
        }
        uint32_t light = pair[0].active_decode_blocks < pair[1].active_decode_blocks ? 0 : 1;
        double costs[2];
        km_policy_decision d = decide(&cfg, &rq, pair, 2, costs);
        KM_CHECK(d.chosen == light,
                 "%s chose %" PRIu64 " decode blocks over %" PRIu64 " (costs %.17g, %.17g; "
                 "block size %u)",
                 km_policy_kind_name(cfg.kind), pair[d.chosen].active_decode_blocks,
                 pair[light].active_decode_blocks, costs[d.chosen], costs[light], rq.block_size);
        km_policy_decision alone_light = decide(&cfg, &rq, &pair[light], 1, NULL);
        km_policy_decision alone_heavy = decide(&cfg, &rq, &pair[1 - light], 1, NULL);
        KM_CHECK(alone_heavy.chosen_predicted_ttft_ms >= alone_light.chosen_predicted_ttft_ms,
                 "predicted %.17g ms with %" PRIu64 " decode blocks, %.17g with %" PRIu64,
                 alone_heavy.chosen_predicted_ttft_ms, pair[1 - light].active_decode_blocks,
                 alone_light.chosen_predicted_ttft_ms, pair[light].active_decode_blocks);
    }
}

/* On fresh random candidates and windows: the choice costs at most the lowest cost + spread_ms,
 * no weighed candidate within that window last had a request longer ago, a window of 0 chooses
 * what the costs alone choose, and the choice does not depend on whether costs are asked for. */
Test(policy_peers, ttft_spread_stays_within_its_window, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int i = 0; i < 3000; i++) {
        km_policy_config cfg = config(KM_POLICY_TTFT);
        uint32_t n_blocks = 1 + km_rng_below(&r, 200), n = 1 + km_rng_below(&r, 12);
        km_policy_request req = request(n_blocks, (uint64_t)n_blocks * 16, km_rng_below(&r, 500));
        km_policy_candidate c[12];
        for (uint32_t k = 0; k < n; k++) {
            c[k] = random_candidate(&r, 10 + k, n_blocks);
            c[k].last_arrival = km_rng_below(&r, 6); /* repeats, so arrival ties happen */
            if (km_rng_percent(&r, 30)) /* some idle workers, for equal costs */
                c[k] = (km_policy_candidate){.worker = 10 + k, .last_arrival = c[k].last_arrival};
        }
        double costs[12];
        cfg.ttft.spread_ms = 0.0;
        km_policy_decision plain = decide(&cfg, &req, c, n, costs);
        cfg.ttft.spread_ms = km_rng_percent(&r, 20) ? 0.0 : km_rng_below(&r, 3000) / 100.0;
        km_policy_decision d = decide(&cfg, &req, c, n, costs);
        km_policy_decision no_costs = decide(&cfg, &req, c, n, NULL);
        KM_CHECK(d.chosen == no_costs.chosen, "with costs %u, without %u", d.chosen,
                 no_costs.chosen);
        double lowest = INFINITY;
        for (uint32_t k = 0; k < n; k++)
            if (!isnan(costs[k]) && costs[k] < lowest)
                lowest = costs[k];
        KM_CHECK(!isnan(costs[d.chosen]) && costs[d.chosen] <= lowest + cfg.ttft.spread_ms,
                 "chosen cost %g, lowest %g, spread %g", costs[d.chosen], lowest,
                 cfg.ttft.spread_ms);
        KM_CHECK(d.chosen_cost == costs[d.chosen], "chosen_cost %g, its cost %g", d.chosen_cost,
                 costs[d.chosen]);
        KM_CHECK((d.reason == KM_POLICY_REASON_SPREAD) == (d.chosen != plain.chosen),
                 "reason %s, chosen %u, the costs alone %u", km_policy_reason_name(d.reason),
                 d.chosen, plain.chosen);
        if (cfg.ttft.spread_ms == 0.0) {
            KM_CHECK(d.chosen == plain.chosen, "spread 0 chose %u, the costs alone %u", d.chosen,
                     plain.chosen);
            continue;
        }
        for (uint32_t k = 0; k < n; k++)
            KM_CHECK(isnan(costs[k]) || costs[k] > lowest + cfg.ttft.spread_ms ||
                         c[k].last_arrival >= c[d.chosen].last_arrival,
                     "candidate %u (cost %g, last arrival %" PRIu64 ") is within the window and "
                     "older than the chosen %u (cost %g, last arrival %" PRIu64 ")",
                     k, costs[k], c[k].last_arrival, d.chosen, costs[d.chosen],
                     c[d.chosen].last_arrival);
    }
}

/* On fresh random candidates: with warm-ups the decision is the one without them, except that,
 * when a warm-up is asked for, the request goes to the choice the same rule makes with the bound
 * off, which the bound left out and which holds a deeper queued hit than the warmed worker, and
 * the warmed worker is the choice without warm-ups, to be warmed with exactly that hit. */
Test(policy_peers, ttft_warm_ups_match_the_decisions_with_and_without_the_bound, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    uint32_t asked = 0;
    for (int i = 0; i < 4000; i++) {
        km_policy_config cfg = config(KM_POLICY_TTFT);
        cfg.ttft.spread_ms = km_rng_percent(&r, 50) ? 0.0 : 1.0;
        uint32_t n_blocks = 1 + km_rng_below(&r, 200), n = 2 + km_rng_below(&r, 10);
        km_policy_request req = request(n_blocks, (uint64_t)n_blocks * 16 + km_rng_below(&r, 16),
                                        km_rng_below(&r, 500));
        km_policy_candidate c[12];
        for (uint32_t k = 0; k < n; k++) {
            c[k] = random_candidate(&r, 10 + k, n_blocks);
            c[k].prefix_sharers = km_rng_below(&r, 8);
            c[k].in_flight = km_rng_percent(&r, 30) ? 20 + km_rng_below(&r, 30)
                                                     : km_rng_below(&r, 4);
            c[k].prefilling = c[k].in_flight ? km_rng_below(&r, c[k].in_flight + 1) : 0;
            if (!c[k].prefilling)
                c[k].queued_depth = 0;
            c[k].pending_prefill_tokens = km_rng_percent(&r, 50) ? 0 : km_rng_below(&r, 3000);
        }
        double plain_costs[12], costs[12], unbounded_costs[12];
        km_policy_decision plain = decide(&cfg, &req, c, n, plain_costs);
        req.warm_ups = true;
        km_policy_decision d = decide(&cfg, &req, c, n, costs);
        km_policy_config off = cfg;
        off.ttft.load_bound = 0.0;
        off.ttft.spread_ms = 0.0;
        km_policy_decision unbounded = decide(&off, &req, c, n, unbounded_costs);
        KM_CHECK(plain.warm_up == KM_POLICY_NO_WARM_UP, "a warm-up nobody can carry out");
        if (d.warm_up == KM_POLICY_NO_WARM_UP) {
            KM_CHECK(d.chosen == plain.chosen && d.reason == plain.reason &&
                     d.warm_up_blocks == 0, "no warm-up, yet not the plain decision");
            continue;
        }
        asked++;
        KM_CHECK(d.warm_up == plain.chosen, "warmed %u, not the bound's choice %u", d.warm_up,
                 plain.chosen);
        KM_CHECK(d.chosen == unbounded.chosen, "chose %u, not the unbounded choice %u", d.chosen,
                 unbounded.chosen);
        KM_CHECK(isnan(plain_costs[d.chosen]), "the holder was not left out by the bound");
        KM_CHECK(!isnan(costs[d.chosen]) && costs[d.chosen] == unbounded_costs[d.chosen],
                 "the holder's cost is its unbounded one");
        uint64_t t = req.prompt_tokens;
        uint32_t cap = (uint32_t)((t - 1) / 16);
        uint32_t q = c[d.chosen].queued_depth > c[d.chosen].depth ? c[d.chosen].queued_depth
                                                                 : c[d.chosen].depth;
        uint32_t hit = q < cap ? q : cap;
        uint32_t wq = c[d.warm_up].queued_depth > c[d.warm_up].depth ? c[d.warm_up].queued_depth
                                                                    : c[d.warm_up].depth;
        KM_CHECK(d.warm_up_blocks == hit && hit > (wq < cap ? wq : cap),
                 "warm-up of %u blocks; the holder's hit is %u, the warmed worker's %u",
                 d.warm_up_blocks, hit, wq < cap ? wq : cap);
    }
    cr_assert_gt(asked, 50, "only %u of 4000 decisions asked for a warm-up", asked);
}
