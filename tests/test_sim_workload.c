/* The simulator's built-in workload (src/sim/workload.h): deterministic, Mooncake-shaped (shared
 * system prompts, multi-turn sessions whose turns extend each other, bounded prompts), and its
 * chain hashes share exactly the prefixes its ids share. */
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kvmatch/error.h"
#include "sim/workload.h"
#include "sim/trace.h"

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

Test(sim_workload, deterministic_per_seed, .timeout = 20)
{
    km_sim_generator_config cfg;
    km_sim_generator_config_init(&cfg);
    km_trace a, b, c;
    cr_assert_eq(km_sim_generate_trace(&cfg, &a, NULL, 0), KM_OK);
    cr_assert_eq(km_sim_generate_trace(&cfg, &b, NULL, 0), KM_OK);
    cfg.seed = 2;
    cr_assert_eq(km_sim_generate_trace(&cfg, &c, NULL, 0), KM_OK);
    cr_assert_eq(a.n_requests, cfg.requests);
    cr_assert(same_trace(&a, &b), "the same seed gives the same trace");
    cr_assert_not(same_trace(&a, &c), "another seed gives another trace");
    km_trace_free(&a);
    km_trace_free(&b);
    km_trace_free(&c);
}

Test(sim_workload, mooncake_shape, .timeout = 20)
{
    km_sim_generator_config cfg;
    km_sim_generator_config_init(&cfg);
    cfg.requests = 2000;
    km_trace t;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
    /* System prompt ids are the smallest: they come first. */
    uint32_t sys_ids = cfg.system_prompts * cfg.system_prompt_ids_max;
    size_t extends = 0, on_popular = 0;
    for (size_t i = 0; i < t.n_requests; i++) {
        const km_trace_request *r = &t.requests[i];
        if (i)
            cr_assert_geq(r->timestamp_ms, t.requests[i - 1].timestamp_ms, "arrival order");
        cr_assert_leq(r->n_ids, cfg.max_input_ids);
        cr_assert_eq(r->input_length, r->n_ids * KM_SIM_TOKENS_PER_ID);
        cr_assert_geq(r->output_length, 1);
        cr_assert_leq(r->output_length, 8 * cfg.output_tokens_mean);
        cr_assert_lt(r->ids[0], sys_ids, "request %zu starts with a system prompt", i);
        on_popular += r->ids[0] == 0;
        /* A later turn: some earlier request's ids are a strict prefix of these. */
        for (size_t j = i; j-- > 0 && i - j < 400;) {
            const km_trace_request *q = &t.requests[j];
            if (q->n_ids < r->n_ids && q->ids[q->n_ids - 1] >= sys_ids &&
                !memcmp(q->ids, r->ids, q->n_ids * sizeof *q->ids)) {
                extends++;
                break;
            }
        }
    }
    /* With 70% sessions of 2..6 turns, well over a third of requests continue a conversation. */
    cr_assert_gt(extends, t.n_requests / 3, "%zu of %zu requests extend an earlier turn", extends,
                 t.n_requests);
    /* Zipf over 4 prompts: the first is the most used (48% expected). */
    cr_assert_gt(on_popular, t.n_requests / 3);
    /* Poisson arrivals at 8/s of sessions and singles: the trace spans at least a few minutes. */
    double span_s = (double)t.requests[t.n_requests - 1].timestamp_ms / 1000.0;
    cr_assert_gt(span_s, 60.0);
    km_trace_free(&t);
}

Test(sim_workload, chain_hashes_share_what_ids_share, .timeout = 30)
{
    km_sim_generator_config cfg;
    km_sim_generator_config_init(&cfg);
    cfg.requests = 200;
    km_trace t;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, NULL, 0), KM_OK);
    const uint32_t bs = 16, per_id = KM_SIM_TOKENS_PER_ID / bs;
    uint64_t *ha = malloc(cfg.max_input_ids * per_id * sizeof *ha);
    uint64_t *hb = malloc(cfg.max_input_ids * per_id * sizeof *hb);
    for (size_t i = 1; i < t.n_requests; i++) {
        const km_trace_request *a = &t.requests[i - 1], *b = &t.requests[i];
        uint32_t na, nb;
        cr_assert_eq(km_trace_chain_hashes(a, bs, KM_SIM_TOKENS_PER_ID, ha, &na), KM_OK);
        cr_assert_eq(km_trace_chain_hashes(b, bs, KM_SIM_TOKENS_PER_ID, hb, &nb), KM_OK);
        cr_assert_eq(na, a->n_ids * per_id);
        uint32_t common = 0;
        while (common < a->n_ids && common < b->n_ids && a->ids[common] == b->ids[common])
            common++;
        uint32_t shared = 0;
        while (shared < na && shared < nb && ha[shared] == hb[shared])
            shared++;
        cr_assert_eq(shared, common * per_id, "requests %zu/%zu: %u common ids, %u shared blocks",
                     i - 1, i, common, shared);
    }
    free(ha);
    free(hb);
    km_trace_free(&t);
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
    cfg.max_input_ids = cfg.system_prompt_ids_max;
    cr_assert_eq(km_sim_generate_trace(&cfg, &t, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_generate_trace(NULL, &t, why, sizeof why), KM_ERR_NULL_POINTER);

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
