/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_protocol into the directory given as argv[1]: one framed message
 * of every type, with most optional fields set, encoded by km_protocol_encode. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/protocol.h"

static int write_msg(const char *dir, const char *name, const km_message *m)
{
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    char why[256] = "";
    if (km_protocol_encode(m, 0, &b, why, sizeof why) != KM_OK) {
        fprintf(stderr, "seed %s: %s\n", name, why);
        return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(b.data, 1, b.size, f) != b.size || fclose(f) != 0) {
        perror(path);
        return 1;
    }
    km_frame_buffer_free(&b);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int bad = 0;
    km_message m;

    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_HELLO, m.has_id = true, m.id = 1;
    m.hello.protocol_version = KM_PROTOCOL_VERSION, m.hello.client_name = "router-a";
    bad |= write_msg(dir, "hello", &m);

    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_WELCOME, m.has_id = true, m.id = 1;
    m.welcome.protocol_version = 1, m.welcome.kvmatch_version = "0.1", m.welcome.server_name = "s";
    km_protocol_limits_init(&m.welcome.limits);
    bad |= write_msg(dir, "welcome", &m);

    static const uint32_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
    static const uint64_t hashes[] = {0x1234567890abcdefull, 42, UINT64_MAX};
    static const uint32_t cands[] = {0, 3, 7};
    km_route_request routes[2] = {
        {.request_id = "req-1", .attempt_id = "2", .model = "llama", .pool = "p0",
         .endpoint = "/v1/completions", .input = KM_ROUTE_INPUT_TOKENS, .tokens = tokens,
         .n_tokens = 17, .block_size = 16, .lora_name = "lora", .cache_salt = "salt",
         .candidates = cands, .n_candidates = 3, .policy = "kv", .has_prompt_tokens = true,
         .prompt_tokens = 17, .has_expected_output_tokens = true, .expected_output_tokens = 100,
         .brief = true, .warm_ups = true},
        {.request_id = "req-2", .input = KM_ROUTE_INPUT_HASHES, .hashes = hashes, .n_hashes = 3,
         .block_size = 16},
    };
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_ROUTE, m.has_id = true, m.id = 7;
    m.route.routes = routes, m.route.n_routes = 2;
    bad |= write_msg(dir, "route", &m);

    km_candidate_score cs[2] = {
        {.worker = 1, .depth = 2, .device_blocks = 1, .host_blocks = 1, .load = {1, 200, 3},
         .cost = 0.5, .state = "LIVE", .eligible = true},
        {.worker = 2, .cost = NAN, .state = "GAP"},
    };
    km_route_decision ds[2] = {
        {.request_id = "req-1", .attempt_id = "2", .decision_id = 99, .pool = "p0",
         .chosen_worker = 1, .chosen_depth = 2, .chosen_state = "LIVE", .has_owner = true,
         .owner_worker = 1, .owner_depth = 2, .owner_state = "LIVE", .n_blocks = 3,
         .block_size = 16, .source = KM_PREDICTION_EVENTS, .policy = "kv", .reason = "min_cost",
         .load_kind = "active_decode_blocks", .load_scope = "this_instance", .load_value = 3,
         .candidates = cs, .n_candidates = 2, .has_warm_up = true, .warm_up_worker = 2,
         .warm_up_blocks = 1, .warm_up_tokens = 16, .warm_up_decision_id = 100,
         .warm_up_attempt_id = "2:warm_up"},
        {.status = KM_ERR_NOT_FOUND, .message = "no such pool", .request_id = "req-2",
         .load_value = NAN},
    };
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_DECISION, m.has_id = true, m.id = 7;
    m.decision.kvmatch_version = "0.1", m.decision.decisions = ds, m.decision.n_decisions = 2;
    bad |= write_msg(dir, "decision", &m);

    km_lifecycle_event evs[3] = {
        {.kind = KM_LIFECYCLE_DISPATCHED, .has_decision_id = true, .decision_id = 99,
         .has_worker = true, .worker = 1, .has_elapsed_ms = true, .elapsed_ms = 1.5},
        {.kind = KM_LIFECYCLE_FIRST_TOKEN, .request_id = "req-1", .attempt_id = "2"},
        {.kind = KM_LIFECYCLE_FINISHED, .has_decision_id = true, .decision_id = 99,
         .outcome = KM_OUTCOME_COMPLETE, .finish_reason = "stop", .done_seen = true,
         .has_http_status = true, .http_status = 200, .has_cached_tokens = true,
         .cached_tokens = 16, .has_prompt_tokens = true, .prompt_tokens = 17,
         .has_output_tokens = true, .output_tokens = 5, .retries = 1},
    };
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_LIFECYCLE, m.has_id = true, m.id = 8;
    m.lifecycle.events = evs, m.lifecycle.n_events = 3;
    bad |= write_msg(dir, "lifecycle", &m);
    m.type = KM_MESSAGE_LIFECYCLE, m.lifecycle.events = &evs[2], m.lifecycle.n_events = 1;
    bad |= write_msg(dir, "lifecycle_one", &m);

    km_item_status items[2] = {{KM_OK, NULL}, {KM_ERR_NOT_FOUND, "no such decision"}};
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_ACK, m.has_id = true, m.id = 8;
    m.ack.items = items, m.ack.n_items = 2;
    bad |= write_msg(dir, "ack", &m);

    km_worker_info ws[2] = {
        {.pool = "p0", .worker = 1, .name = "w1", .event_endpoint = "tcp://h:5557",
         .replay_endpoint = "tcp://h:5558", .has_dp_rank = true, .dp_rank = 0},
        {.pool = "p0", .worker = 2, .name = "w2", .state = "LIVE", .has_blocks = true,
         .blocks = 10, .has_last_event_age_s = true, .last_event_age_s = 0.25,
         .has_expected_seq = true, .expected_seq = 5, .has_load = true, .load = {1, 2, 3}},
    };
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_WORKERS, m.has_id = true, m.id = 9;
    m.workers.action = KM_ADMIN_ADD, m.workers.workers = ws, m.workers.n_workers = 1;
    bad |= write_msg(dir, "workers_add", &m);
    m.workers.action = KM_ADMIN_LIST, m.workers.workers = NULL, m.workers.n_workers = 0;
    m.workers.pool = "p0";
    bad |= write_msg(dir, "workers_list", &m);
    m.type = KM_MESSAGE_WORKER_LIST, m.workers.pool = NULL;
    m.workers.workers = ws, m.workers.n_workers = 2;
    bad |= write_msg(dir, "worker_list", &m);

    km_param params[2] = {{"temperature", 0.5}, {"cache_threshold", 0.25}};
    km_pool_info pools[1] = {{.name = "p0", .model = "llama", .block_size = 16, .policy = "kv",
                              .params = params, .n_params = 2}};
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_POOLS, m.has_id = true, m.id = 10;
    m.pools.action = KM_ADMIN_ADD, m.pools.pools = pools, m.pools.n_pools = 1;
    bad |= write_msg(dir, "pools_add", &m);
    m.pools.action = KM_ADMIN_UPDATE;
    bad |= write_msg(dir, "pools_update", &m);
    m.type = KM_MESSAGE_POOL_LIST, m.pools.action = KM_ADMIN_LIST;
    bad |= write_msg(dir, "pool_list", &m);

    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_STATUS, m.has_id = true, m.id = 11;
    bad |= write_msg(dir, "status", &m);
    m.type = KM_MESSAGE_STATUS_REPLY;
    m.status_reply.kvmatch_version = "0.1", m.status_reply.uptime_s = 12.5;
    m.status_reply.ready = true, m.status_reply.connections = 2, m.status_reply.decisions = 5;
    m.status_reply.backend = "cpu", m.status_reply.workers = ws, m.status_reply.n_workers = 2;
    bad |= write_msg(dir, "status_reply", &m);

    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_ERROR, m.has_id = true, m.id = 12;
    m.error.code = KM_ERR_PROTOCOL, m.error.name = km_error_name(KM_ERR_PROTOCOL);
    m.error.message = "expected HELLO first";
    bad |= write_msg(dir, "error", &m);
    return bad;
}
