/* SPDX-License-Identifier: Apache-2.0 */
/* The engine model (include/kvmatch/engine_model.h): each preset reproduces the published figures
 * it was calibrated on (docs/SIM_ENGINE.md, "Presets"), the step formula's known answers, and the
 * predicted time to first token against a step-by-step replay of the same queue, plus its
 * monotonicity on fresh random states. */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kvmatch/engine_model.h"
#include "test_util.h"

static km_engine_model preset(const char *name)
{
    km_engine_model m;
    cr_assert_eq(km_engine_model_preset(name, &m), KM_OK, "preset %s", name);
    cr_assert_eq(km_engine_model_validate(&m, NULL, 0), KM_OK);
    return m;
}

static double step_ms(const km_engine_model *m, uint64_t prefill, uint32_t decodes, uint64_t context)
{
    km_engine_step s = {prefill, km_engine_model_chunk_pairs(0, prefill), decodes, context};
    return km_engine_model_step_us(m, &s) / 1000.0;
}

#define WITHIN(value, expected, share)                                                             \
    cr_assert(fabs((value) - (expected)) <= (share) * (expected), "%s = %.3f, expected %.3f +- %.0f%%", \
              #value, (value), (expected), 100.0 * (share))

/* Figures and sources (docs/SIM_ENGINE.md): decode steps are vLLM v0.6.0's published inter-token
 * latency on H100 SXM in bf16 divided by its 10 scheduler steps (Lambda Labs' vllm-benchmark:
 * 7.05 ms with one request, about 7.5 ms with about 10, 12.5-13 ms with about 256 of about 250
 * tokens of context each); prefills are Vidur's measured per-layer H100 operator times summed over
 * the model's layers, with its measured attention. */
Test(engine_model, llama3_8b_h100_reproduces_its_figures, .timeout = 30)
{
    km_engine_model m = preset("llama3-8b-h100");
    WITHIN(step_ms(&m, 0, 1, 500), 7.05, 0.02);
    WITHIN(step_ms(&m, 0, 10, 4000), 7.5, 0.05);
    WITHIN(step_ms(&m, 0, 256, 65000), 12.75, 0.03);
    WITHIN(step_ms(&m, 1024, 0, 0), 24.3, 0.10);
    WITHIN(step_ms(&m, 2048, 0, 0), 47.0, 0.03);
    WITHIN(step_ms(&m, 4096, 0, 0), 99.2, 0.03);
    WITHIN(step_ms(&m, 8192, 0, 0), 218.5, 0.03);
    /* KV: 128 KiB per token; the derived capacity range at 0.9 of 80 GB is 428k-456k tokens. */
    uint64_t tokens = (uint64_t)m.capacity_blocks * m.block_size;
    cr_assert(tokens >= 428000 && tokens <= 456000, "%llu tokens", (unsigned long long)tokens);
    cr_assert_eq(m.max_num_batched_tokens, 8192);
    cr_assert_eq(m.max_num_seqs, 1024);
}

Test(engine_model, llama3_70b_h100x4_reproduces_its_figures, .timeout = 30)
{
    km_engine_model m = preset("llama3-70b-h100x4");
    WITHIN(step_ms(&m, 0, 1, 500), 17.0, 0.02);
    WITHIN(step_ms(&m, 0, 8, 4000), 17.8, 0.05);
    WITHIN(step_ms(&m, 0, 256, 65000), 28.75, 0.10);
    WITHIN(step_ms(&m, 2048, 0, 0), 140.7, 0.05);
    WITHIN(step_ms(&m, 4096, 0, 0), 286.8, 0.05);
    WITHIN(step_ms(&m, 8192, 0, 0), 599.1, 0.05);
    uint64_t tokens = (uint64_t)m.capacity_blocks * m.block_size;
    cr_assert(tokens >= 450000 && tokens <= 495000, "%llu tokens", (unsigned long long)tokens);
}

Test(engine_model, presets_names_and_validation, .timeout = 30)
{
    size_t n = 0;
    for (const char *name; (name = km_engine_model_preset_name(n)); n++) {
        cr_assert_not_null(km_engine_model_preset_summary(name));
        preset(name);
    }
    cr_assert_geq(n, 2);
    km_engine_model m, d;
    km_engine_model_init(&d);
    cr_assert_eq(km_engine_model_preset(KM_ENGINE_MODEL_DEFAULT_PRESET, &m), KM_OK);
    cr_assert(memcmp(&m, &d, sizeof m) == 0, "init gives the default preset");
    memset(&m, 0x5a, sizeof m);
    km_engine_model before = m;
    cr_assert_eq(km_engine_model_preset("llama3-8b", &m), KM_ERR_NOT_FOUND);
    cr_assert(memcmp(&m, &before, sizeof m) == 0, "an unknown preset writes nothing");
    cr_assert_null(km_engine_model_preset_summary("nope"));
    cr_assert_eq(km_engine_model_preset(NULL, &m), KM_ERR_NULL_POINTER);

    char why[128];
    km_engine_model_init(&m);
    m.block_size = 0;
    cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_ERR_BLOCK_SIZE);
    km_engine_model_init(&m);
    m.max_num_seqs = 0;
    cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "max_num_seqs"), "%s", why);
    km_engine_model_init(&m);
    m.prefill_us_per_pair = NAN;
    cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "prefill_us_per_pair"), "%s", why);
    km_engine_model_init(&m);
    m.step_floor_us = -1;
    cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_engine_model_validate(NULL, why, sizeof why), KM_ERR_NULL_POINTER);
}

static double *time_constant(km_engine_model *m, int i)
{
    double *fields[] = {&m->step_floor_us,         &m->token_us,
                        &m->prefill_us_per_pair,   &m->decode_us_per_request,
                        &m->decode_us_per_context_token, &m->host_load_us_per_block,
                        &m->disk_load_us_per_block};
    return fields[i];
}

/* Each time constant lies in [0, KM_ENGINE_MODEL_TIME_MAX]: one past it is refused, naming the
 * field, and with every constant at the maximum, every limit at 1 and every count at its largest
 * the predictions stay finite (a larger constant, 1e306, made them infinite and NaN). */
Test(engine_model, time_constants_past_their_maximum_are_refused, .timeout = 10)
{
    static const char *const names[] = {"step_floor_us",         "token_us",
                                        "prefill_us_per_pair",   "decode_us_per_request",
                                        "decode_us_per_context_token", "host_load_us_per_block",
                                        "disk_load_us_per_block"};
    char why[160];
    for (int i = 0; i < 7; i++) {
        km_engine_model m;
        km_engine_model_init(&m);
        *time_constant(&m, i) = KM_ENGINE_MODEL_TIME_MAX;
        cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_OK, "%s", names[i]);
        double over[] = {nextafter(KM_ENGINE_MODEL_TIME_MAX, INFINITY), 1e306, INFINITY};
        for (size_t k = 0; k < sizeof over / sizeof over[0]; k++) {
            *time_constant(&m, i) = over[k];
            cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_ERR_INVALID_ARGUMENT,
                         "%s = %g", names[i], over[k]);
            cr_assert(strstr(why, names[i]), "%s", why);
        }
    }

    km_engine_model m;
    km_engine_model_init(&m);
    m.capacity_blocks = m.max_num_batched_tokens = m.max_num_seqs = 1;
    for (int i = 0; i < 7; i++)
        *time_constant(&m, i) = KM_ENGINE_MODEL_TIME_MAX;
    cr_assert_eq(km_engine_model_validate(&m, why, sizeof why), KM_OK, "%s", why);
    km_engine_load load = {UINT64_MAX, UINT32_MAX, UINT32_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX};
    double t = km_engine_model_predict_ttft_us(&m, &load, UINT64_MAX, UINT64_MAX, UINT32_MAX,
                                               UINT32_MAX, UINT64_MAX, UINT64_MAX);
    cr_assert(isfinite(t) && t > 0, "predicted %g", t);
    t = km_engine_model_step_in_progress_us(&m, &load);
    cr_assert(isfinite(t) && t > 0, "step in progress %g", t);
    km_engine_step step = {UINT64_MAX, UINT64_MAX, UINT32_MAX, UINT64_MAX};
    t = km_engine_model_step_us(&m, &step);
    cr_assert(isfinite(t) && t > 0, "step %g", t);
}

/* km_engine_model_preset_of names the preset a model is, and nothing for a model any of whose
 * parameters differs from every preset's. */
Test(engine_model, a_model_names_its_preset, .timeout = 10)
{
    for (size_t i = 0; km_engine_model_preset_name(i); i++) {
        const char *name = km_engine_model_preset_name(i);
        km_engine_model m;
        cr_assert_eq(km_engine_model_preset(name, &m), KM_OK);
        cr_assert_str_eq(km_engine_model_preset_of(&m), name);
        km_engine_model changed = m;
        changed.capacity_blocks++;
        cr_assert_null(km_engine_model_preset_of(&changed), "%s with another capacity", name);
        changed = m;
        changed.token_us *= 1.5;
        cr_assert_null(km_engine_model_preset_of(&changed), "%s with another token time", name);
        changed = m;
        changed.disk_load_us_per_block += 1;
        cr_assert_null(km_engine_model_preset_of(&changed), "%s with another disk load time",
                       name);
    }
    cr_assert_null(km_engine_model_preset_of(NULL));
}

/* The same queue served step by step: full chunks of the budget left by the decodes, the queued
 * tokens first, each step timed without attention, then the request's own attention pairs. */
static double replay_ttft_us(const km_engine_model *m, const km_engine_load *load, uint64_t cached,
                             uint64_t uncached)
{
    uint64_t per_step = m->max_num_batched_tokens > load->decode_requests
                            ? m->max_num_batched_tokens - load->decode_requests
                            : 1;
    uint64_t left = load->prefill_tokens + uncached;
    double t = 0;
    do {
        uint64_t chunk = left < per_step ? left : per_step;
        km_engine_step s = {chunk, 0, load->decode_requests, load->decode_context_tokens};
        t += km_engine_model_step_us(m, &s);
        left -= chunk;
    } while (left);
    return t + m->prefill_us_per_pair *
                   ((double)load->prefill_pairs + (double)km_engine_model_chunk_pairs(cached, uncached));
}

Test(engine_model, predicted_ttft_follows_the_queue_and_is_monotonic, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (size_t p = 0; km_engine_model_preset_name(p); p++) {
        km_engine_model m = preset(km_engine_model_preset_name(p));
        for (int i = 0; i < 2000; i++) {
            km_engine_load load = {km_rng_below(&r, 40000), km_rng_below(&r, 20),
                                   km_rng_below(&r, 300), km_rng_below(&r, 400000), 0, 0};
            /* Queued prefills' attention: some pairs of the queued tokens after cached prefixes
             * of up to 30,000 tokens, or none. */
            if (km_rng_percent(&r, 70))
                load.prefill_pairs = km_engine_model_chunk_pairs(km_rng_below(&r, 30000),
                                                                 load.prefill_tokens);
            uint64_t cached = km_rng_below(&r, 20000), uncached = 1 + km_rng_below(&r, 20000);
            double t = km_engine_model_predict_ttft_us(&m, &load, cached, uncached, 0, 0, 10, 100);
            double expect = replay_ttft_us(&m, &load, cached, uncached);
            KM_CHECK(fabs(t - expect) <= 1e-6 * expect, "preset %zu: %.3f against the replay's %.3f",
                     p, t, expect);
            /* More queued tokens, more decodes, fewer cached tokens: never less. */
            km_engine_load more = load;
            more.prefill_tokens += 1 + km_rng_below(&r, 10000);
            KM_CHECK(km_engine_model_predict_ttft_us(&m, &more, cached, uncached, 0, 0, 10, 100) >= t,
                     "queued tokens");
            more = load;
            more.prefill_pairs += 1 + km_rng_below(&r, 1000000);
            KM_CHECK(km_engine_model_predict_ttft_us(&m, &more, cached, uncached, 0, 0, 10, 100) > t,
                     "queued attention pairs");
            more = load;
            more.decode_requests += 1 + km_rng_below(&r, 50);
            KM_CHECK(km_engine_model_predict_ttft_us(&m, &more, cached, uncached, 0, 0, 10, 100) >= t,
                     "decodes");
            uint64_t moved = cached ? 1 + km_rng_below(&r, cached) : 0;
            KM_CHECK(km_engine_model_predict_ttft_us(&m, &load, cached - moved, uncached + moved, 0, 0,
                                                     10, 100) >= t,
                     "fewer cached tokens");
            /* Blocks to bring back from host or disk cost their transfer. */
            double lower = km_engine_model_predict_ttft_us(&m, &load, cached, uncached, 3, 2, 10, 100);
            KM_CHECK(fabs(lower - t - 3 * m.host_load_us_per_block - 2 * m.disk_load_us_per_block) <
                         1e-6 * lower,
                     "lower tiers");
            /* A worker short of KV waits, the more the shorter it is. */
            km_engine_load full = load;
            full.used_blocks = m.capacity_blocks;
            double a = km_engine_model_predict_ttft_us(&m, &full, cached, uncached, 0, 0, 100, 200);
            full.used_blocks = m.capacity_blocks + 5000;
            double b = km_engine_model_predict_ttft_us(&m, &full, cached, uncached, 0, 0, 100, 200);
            KM_CHECK(a > t && b >= a, "memory: %.1f, %.1f over %.1f", a, b, t);
        }
    }
}

/* Attention pairs are exact while they fit in 64 bits and UINT64_MAX past them, never a wrapped
 * count: a prompt of 2^32 tokens has 2^63 + 2^31 pairs, and twice that saturates. More tokens, or
 * more before them, never give fewer pairs. */
Test(engine_model, chunk_pairs_saturate_instead_of_wrapping, .timeout = 10)
{
    cr_assert_eq(km_engine_model_chunk_pairs(0, 0), 0);
    cr_assert_eq(km_engine_model_chunk_pairs(10, 0), 0);
    cr_assert_eq(km_engine_model_chunk_pairs(0, 1), 1);
    cr_assert_eq(km_engine_model_chunk_pairs(3, 4), 4 * 3 + 10);
    const uint64_t two32 = UINT64_C(1) << 32;
    cr_assert_eq(km_engine_model_chunk_pairs(0, two32), (UINT64_C(1) << 63) + (UINT64_C(1) << 31));
    cr_assert_eq(km_engine_model_chunk_pairs(0, two32 - 1),
                 (UINT64_C(1) << 63) - (UINT64_C(1) << 31));
    cr_assert_eq(km_engine_model_chunk_pairs(64, two32 - 64),
                 (two32 - 64) * 64 + (two32 - 64) / 2 * (two32 - 63));
    cr_assert_eq(km_engine_model_chunk_pairs(two32, two32), UINT64_MAX);
    cr_assert_eq(km_engine_model_chunk_pairs(0, UINT64_C(1) << 33), UINT64_MAX);
    cr_assert_eq(km_engine_model_chunk_pairs(0, UINT64_MAX), UINT64_MAX);
    cr_assert_eq(km_engine_model_chunk_pairs(0, UINT64_MAX - 1), UINT64_MAX);
    cr_assert_eq(km_engine_model_chunk_pairs(UINT64_MAX, 1), UINT64_MAX);
    cr_assert_eq(km_engine_model_chunk_pairs(UINT64_MAX, 0), 0);
    /* Around the largest chunk whose own pairs fit: 6,074,000,999 tokens. */
    uint64_t prev = 0;
    for (uint64_t chunk = UINT64_C(6074000990); chunk < UINT64_C(6074001010); chunk++) {
        uint64_t p = km_engine_model_chunk_pairs(0, chunk);
        cr_assert_geq(p, prev, "chunk %" PRIu64, chunk);
        cr_assert_geq(km_engine_model_chunk_pairs(1000, chunk), p, "chunk %" PRIu64, chunk);
        prev = p;
    }
    /* A worker whose queue's pairs saturated predicts no less than one just under it. */
    km_engine_model m = preset(KM_ENGINE_MODEL_DEFAULT_PRESET);
    km_engine_load under = {two32, 1, 0, 0, 0, UINT64_MAX - 1}, over = under;
    over.prefill_pairs = UINT64_MAX;
    cr_assert_geq(km_engine_model_predict_ttft_us(&m, &over, 0, two32, 0, 0, 1, 1),
                  km_engine_model_predict_ttft_us(&m, &under, 0, two32, 0, 0, 1, 1));
    km_engine_load huge = {UINT64_MAX, 1, 0, 0, 0, 0};
    cr_assert_geq(km_engine_model_predict_ttft_us(&m, &huge, 0, two32, 0, 0, 1, 1),
                  km_engine_model_predict_ttft_us(&m, &huge, 0, 1, 0, 0, 1, 1),
                  "queued and own tokens that sum past 2^64");
}

/* A request arriving at a busy worker waits, on average, for half of the step it is running: one
 * step of the queued prefill (at most the token budget) beside the decodes; nothing at an idle
 * worker. */
Test(engine_model, step_in_progress_is_half_the_running_step, .timeout = 30)
{
    km_engine_model m = preset(KM_ENGINE_MODEL_DEFAULT_PRESET);
    cr_assert_float_eq(km_engine_model_step_in_progress_us(&m, NULL), 0.0, 0.0);
    km_engine_load idle = {0, 0, 0, 0, 0, 0};
    cr_assert_float_eq(km_engine_model_step_in_progress_us(&m, &idle), 0.0, 0.0);
    /* Queued prefill past the budget: one full-budget step. */
    km_engine_load queued = {3 * m.max_num_batched_tokens + 7, 2, 0, 0, 0, 0};
    km_engine_step full = {m.max_num_batched_tokens, 0, 0, 0};
    cr_assert_float_eq(km_engine_model_step_in_progress_us(&m, &queued),
                       0.5 * km_engine_model_step_us(&m, &full), 1e-9);
    /* Decodes alone: one decode step. */
    km_engine_load decoding = {0, 0, 12, 40000, 0, 0};
    km_engine_step decode = {0, 0, 12, 40000};
    cr_assert_float_eq(km_engine_model_step_in_progress_us(&m, &decoding),
                       0.5 * km_engine_model_step_us(&m, &decode), 1e-9);

    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (size_t p = 0; km_engine_model_preset_name(p); p++) {
        km_engine_model e = preset(km_engine_model_preset_name(p));
        for (int i = 0; i < 2000; i++) {
            km_engine_load load = {km_rng_below(&r, 40000), km_rng_below(&r, 20),
                                   km_rng_below(&r, 300), km_rng_below(&r, 400000),
                                   km_rng_below(&r, 5000), km_rng_below(&r, 1000000)};
            double t = km_engine_model_step_in_progress_us(&e, &load);
            uint64_t chunk = load.prefill_tokens < e.max_num_batched_tokens
                                 ? load.prefill_tokens
                                 : e.max_num_batched_tokens;
            km_engine_step running = {chunk, 0, load.decode_requests, load.decode_context_tokens};
            double expect = load.prefill_tokens || load.decode_requests
                                ? 0.5 * km_engine_model_step_us(&e, &running)
                                : 0.0;
            KM_CHECK(fabs(t - expect) <= 1e-9 * (expect + 1), "preset %zu: %.3f against %.3f", p,
                     t, expect);
            /* More queued tokens or more decodes never shorten it; pairs and memory do not enter. */
            km_engine_load more = load;
            more.prefill_tokens += 1 + km_rng_below(&r, 10000);
            KM_CHECK(km_engine_model_step_in_progress_us(&e, &more) >= t, "queued tokens");
            more = load;
            more.decode_requests += 1 + km_rng_below(&r, 50);
            KM_CHECK(km_engine_model_step_in_progress_us(&e, &more) >= t, "decodes");
        }
    }
}
