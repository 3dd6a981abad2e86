/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_analyze into the directory given as argv[1]: decision and outcome
 * records as docs/RECORDS.md shows them, joined within one file and across two (NUL-separated). */
#include <stdio.h>
#include <string.h>

#define DECISION_WITH(id, att, chosen, state, t, extra)                                          \
    "{\"type\":\"decision\",\"schema_version\":1,\"record_id\":" #id ",\"instance\":\"4f1c\","   \
    "\"host\":\"h1\",\"kvmatch_version\":\"0.1.0\",\"decision_id\":" #id ",\"request_id\":"     \
    "\"req-" #id "\",\"attempt_id\":\"" att "\",\"model\":\"llama\",\"pool\":\"default\","       \
    "\"endpoint\":\"/v1/chat/completions\",\"time\":\"2026-11-30T05:56:54.079639Z\","            \
    "\"monotonic_ns\":" #t ",\"prediction\":{\"source\":\"events\",\"input\":\"tokens\","       \
    "\"units\":\"blocks\",\"block_size\":16,\"block_count\":40,\"prompt_tokens\":650,"           \
    "\"expected_output_tokens\":null,\"scored_monotonic_ns\":null,\"owner\":{\"worker\":\"A\","  \
    "\"state\":\"" state "\",\"depth_blocks\":12,\"depth_tokens\":192}},\"decision\":{"         \
    "\"policy\":\"cache_aware\",\"reason\":\"below_threshold\",\"chosen\":{\"worker\":\"" chosen \
    "\",\"state\":\"LIVE\",\"depth_blocks\":0,\"depth_tokens\":0},\"owner_is_chosen\":false,"    \
    "\"load\":{\"kind\":\"in_flight_requests\",\"value\":1.0,\"scope\":\"this_instance\"}" extra  \
    "},"                                                                                          \
    "\"candidates\":[{\"worker\":\"A\",\"state\":\"" state "\",\"depth_blocks\":12,"            \
    "\"depth_tokens\":192,\"device_blocks\":12,\"host_blocks\":null,\"disk_blocks\":null,"       \
    "\"in_flight\":9,\"pending_prefill_tokens\":null,\"active_decode_blocks\":null,\"cost\":9.0}," \
    "{\"worker\":\"B\",\"state\":\"LIVE\",\"depth_blocks\":0,\"depth_tokens\":0,"               \
    "\"device_blocks\":0,\"host_blocks\":0,\"disk_blocks\":0,\"in_flight\":1,"                   \
    "\"pending_prefill_tokens\":10,\"active_decode_blocks\":3,\"cost\":1.0}]}\n"

/* A decision whose decision object has nothing after its load. */
#define DECISION(id, att, chosen, state, t) DECISION_WITH(id, att, chosen, state, t, "")

#define OUTCOME(id, att, outcome, dispatched, t)                                                  \
    "{\"type\":\"outcome\",\"schema_version\":1,\"record_id\":" #id "0,\"instance\":\"4f1c\","  \
    "\"host\":\"h1\",\"kvmatch_version\":\"0.1.0\",\"decision_id\":" #id ",\"request_id\":"     \
    "\"req-" #id "\",\"attempt_id\":\"" att "\",\"model\":\"llama\",\"pool\":\"default\","       \
    "\"endpoint\":\"/v1/chat/completions\",\"time\":\"2026-11-30T05:56:54.079762Z\","            \
    "\"monotonic_ns\":" #t ",\"outcome\":\"" outcome "\",\"finish_reason\":\"stop\","           \
    "\"done_seen\":true,\"http_status\":200,\"error\":null,\"worker\":\"B\","                   \
    "\"dispatched_worker\":" dispatched ",\"cached_tokens\":0,\"prompt_tokens\":650,"            \
    "\"output_tokens\":80,\"retries\":0,\"decided_time\":\"2026-11-30T05:56:54.079639Z\","      \
    "\"decided_monotonic_ns\":8498317416741,\"dispatched_time\":\"x\","                          \
    "\"dispatched_monotonic_ns\":8498317540542,\"first_token_time\":\"x\","                      \
    "\"first_token_monotonic_ns\":8498317540592,\"finished_time\":\"x\","                        \
    "\"finished_monotonic_ns\":8498317540652,\"wait_ns\":123801,\"ttft_ns\":123851,"             \
    "\"router_dispatched_ms\":0.2,\"router_ttft_ms\":212.4,\"router_e2e_ms\":1840.9,"            \
    "\"predicted\":{\"source\":\"events\",\"units\":\"blocks\",\"block_size\":16,"              \
    "\"depth_blocks\":0,\"depth_tokens\":0,\"owner_worker\":\"A\",\"owner_depth_blocks\":12,"    \
    "\"owner_depth_tokens\":192}}\n"

static int write_seed(const char *dir, const char *name, const char *a, const char *b)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 1;
    }
    fwrite(a, 1, strlen(a), f);
    if (b) {
        fputc(0, f);
        fwrite(b, 1, strlen(b), f);
    }
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *d = argv[1];
    int bad = 0;
    bad |= write_seed(d, "pair", DECISION(7, "0", "B", "LIVE", 8498317416741)
                                     OUTCOME(7, "0", "complete", "null", 8498317540481), NULL);
    bad |= write_seed(d, "windows",
                      DECISION(1, "0", "B", "LIVE", 1000) DECISION(2, "0", "A", "GAP", 2000)
                          OUTCOME(2, "0", "incomplete", "\"A\"", 2500)
                              DECISION(3, "1", "B", "DEGRADED", 3000) OUTCOME(1, "0", "error", "null", 3500),
                      NULL);
    /* a decision that asked for a warm-up, the warm-up's decision and both outcomes */
    bad |= write_seed(d, "warm_up",
                      DECISION_WITH(9, "0", "A", "LIVE", 1000,
                                    ",\"warm_up\":{\"worker\":\"B\",\"blocks\":1,"
                                    "\"tokens\":16,\"decision_id\":10},\"warm_up_for\":null")
                          DECISION_WITH(10, "0:warm_up", "B", "LIVE", 1001,
                                        ",\"warm_up\":null,\"warm_up_for\":9")
                              OUTCOME(10, "0:warm_up", "complete", "null", 1500)
                                  OUTCOME(9, "0", "complete", "null", 2000),
                      NULL);
    /* predictions of the time to first token against the times the outcomes report */
    bad |= write_seed(d, "predicted_ttft",
                      DECISION_WITH(11, "0", "B", "LIVE", 1000, ",\"predicted_ttft_ms\":41.3")
                          OUTCOME(11, "0", "complete", "null", 1500)
                              DECISION_WITH(12, "0", "B", "LIVE", 1100,
                                            ",\"predicted_ttft_ms\":null")
                                  OUTCOME(12, "0", "complete", "\"A\"", 1600)
                                      DECISION_WITH(13, "0", "B", "LIVE", 1200,
                                                    ",\"predicted_ttft_ms\":1e-300")
                                          OUTCOME(13, "0", "complete", "null", 1700),
                      NULL);
    bad |= write_seed(d, "rotated", OUTCOME(5, "0", "complete", "\"A\"", 9000),
                      DECISION(5, "0", "B", "LIVE", 8000) "not json\n{\"type\":\"outcome\"}\n");
    return bad;
}
