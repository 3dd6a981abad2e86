/* SPDX-License-Identifier: Apache-2.0 */
/* The service's JSON configuration file (km_server_config_load_json, docs/SERVICE.md): the
 * documented example, read from docs/SERVICE.md itself, loads with every value it shows; files
 * that are not JSON, hold a field of the wrong type or a value out of range, or cannot be read are
 * refused with a code and a message naming the field; fields a file leaves out keep their
 * defaults. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#include "kvmatch/server.h"
#include "kvmatch/records.h"

/* Write text into a fresh temporary file; returns its path (static buffer per call site). */
static void write_temp(char *path, size_t size, const char *text)
{
    snprintf(path, size, "/tmp/kvmatch-config-XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0, "mkstemp: %s", strerror(errno));
    size_t n = strlen(text);
    cr_assert_eq(write(fd, text, n), (ssize_t)n);
    close(fd);
}

/* The ```json block under "## Configuration file" in docs/SERVICE.md (the caller frees it). */
static char *documented_example(void)
{
    FILE *f = fopen("docs/SERVICE.md", "r");
    cr_assert_not_null(f, "docs/SERVICE.md: %s (tests run from the repository root)",
                       strerror(errno));
    char line[1024];
    size_t cap = 1 << 16, len = 0;
    char *out = calloc(1, cap);
    cr_assert_not_null(out);
    int state = 0; /* 0: before the heading, 1: before the block, 2: inside, 3: done */
    while (state < 3 && fgets(line, sizeof line, f)) {
        if (state == 0 && !strncmp(line, "## Configuration file", 21))
            state = 1;
        else if (state == 1 && !strncmp(line, "```json", 7))
            state = 2;
        else if (state == 2 && !strncmp(line, "```", 3))
            state = 3;
        else if (state == 2) {
            size_t n = strlen(line);
            cr_assert_lt(len + n, cap);
            memcpy(out + len, line, n);
            len += n;
        }
    }
    fclose(f);
    cr_assert_eq(state, 3, "no complete ```json block under \"## Configuration file\"");
    return out;
}

Test(server_config, documented_example_loads_with_every_value, .timeout = 10)
{
    char *text = documented_example();
    char path[64], why[256] = "";
    write_temp(path, sizeof path, text);
    free(text);
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = NULL;
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "the documented example does not load: %s", why);
    cr_assert_str_eq(cfg.socket_path, "/run/kvmatch/kvmatch.sock");
    cr_assert_str_eq(cfg.tcp, "127.0.0.1:7700");
    cr_assert_str_eq(cfg.http, "127.0.0.1:7701");
    cr_assert_str_eq(cfg.records_path, "/var/log/kvmatch/records.jsonl");
    cr_assert_eq(cfg.records_max_file_bytes, 268435456);
    cr_assert_eq(cfg.records_keep_files, 8);
    cr_assert_eq(cfg.records_max_kept_bytes, UINT64_C(2147483648));
    cr_assert_eq(cfg.records_max_age_s, 604800);
    cr_assert_str_eq(cfg.snapshot_dir, "/var/lib/kvmatch");
    cr_assert_eq(cfg.snapshot_interval_ms, 60000);
    cr_assert_eq(cfg.engine_metrics_interval_ms, 1000);
    cr_assert_eq(cfg.engine_metrics_timeout_ms, 500);
    cr_assert_eq(cfg.engine_metrics_max_age_ms, 3000);
    cr_assert_eq(cfg.max_workers, 1024);
    cr_assert_eq(cfg.backend, KM_BACKEND_AUTO);
    cr_assert_eq(cfg.index_threads, 0);
    cr_assert_eq(cfg.index_memory_cap_bytes, 0);
    cr_assert_eq(cfg.index_initial_blocks, 1048576);
    cr_assert_eq(cfg.max_batch_routes, 512);
    cr_assert_eq(cfg.max_queued_routes, 65536);
    cr_assert_eq(cfg.max_queue_wait_ms, 50);
    cr_assert_eq(cfg.max_connection_routes, 4096);
    cr_assert_eq(cfg.inline_routes, 16);
    cr_assert_eq(cfg.limits.max_frame_bytes, 16777216);
    cr_assert_eq(cfg.limits.max_batch_items, 4096);
    cr_assert_eq(cfg.kv_events.max_events_per_batch, 262144);
    cr_assert_eq(cfg.kv_events.max_payload_bytes, 67108864);
    cr_assert_eq(cfg.kv_events.max_hashes_per_event, 1u << 20, "left out: the default");
    cr_assert_eq(cfg.max_connections, 1024);
    cr_assert_eq(cfg.max_outbox_bytes, 67108864);
    cr_assert_eq(cfg.active_ttl_ms, 600000);
    cr_assert_eq(cfg.max_active_entries, 1048576);
    cr_assert_eq(cfg.max_active_bytes, UINT64_C(536870912));
    cr_assert_eq(cfg.approx_dispatch_max_bytes, 33554432);
    cr_assert_eq(cfg.breaker_failures, 3);
    cr_assert_eq(cfg.breaker_cooldown_ms, 30000);
    cr_assert_float_eq(cfg.ready_share, 0.8, 1e-12);
    cr_assert_eq(cfg.drain_timeout_ms, 10000);
    cr_assert_str_eq(cfg.default_pool, "llama");
    cr_assert_eq(cfg.n_pools, 2);
    const km_server_pool *llama = &cfg.pools[0], *small = &cfg.pools[1];
    cr_assert_str_eq(llama->name, "llama");
    cr_assert_str_eq(llama->model, "meta-llama/Llama-3.1-8B");
    cr_assert_eq(llama->block_size, 16);
    cr_assert_eq(llama->policy.kind, KM_POLICY_KV);
    cr_assert_float_eq(llama->policy.kv.temperature, 0.0, 1e-12);
    cr_assert_float_eq(llama->policy.kv.host_weight, 0.75, 1e-12);
    /* Worker "a" (id 0), then "b" with dp_size 2: ranks 2 and 3 on ports 5557 and 5558. */
    cr_assert_eq(llama->n_workers, 3);
    cr_assert_eq(llama->workers[0].id, 0);
    cr_assert_str_eq(llama->workers[0].name, "a");
    cr_assert_str_eq(llama->workers[0].event_endpoint, "tcp://10.0.0.5:5557");
    cr_assert_str_eq(llama->workers[0].replay_endpoint, "tcp://10.0.0.5:5558");
    cr_assert_eq(llama->workers[1].id, 2);
    cr_assert_str_eq(llama->workers[1].name, "b/dp0");
    cr_assert_str_eq(llama->workers[1].event_endpoint, "tcp://10.0.0.6:5557");
    cr_assert_eq(llama->workers[2].id, 3);
    cr_assert_str_eq(llama->workers[2].name, "b/dp1");
    /* dp_size names each rank's dp_rank (shown in /status); a lone engine has none. */
    cr_assert_not(llama->workers[0].has_dp_rank);
    cr_assert(llama->workers[1].has_dp_rank && llama->workers[1].dp_rank == 0);
    cr_assert(llama->workers[2].has_dp_rank && llama->workers[2].dp_rank == 1);
    cr_assert_str_eq(llama->workers[2].event_endpoint, "tcp://10.0.0.6:5558");
    cr_assert_eq(llama->offload_chunk_blocks, 1);
    cr_assert_eq(small->offload_chunk_blocks, 0, "left out: the default");
    cr_assert_str_eq(small->name, "small");
    cr_assert_eq(small->policy.kind, KM_POLICY_CACHE_AWARE);
    cr_assert_eq(small->approx_ttl_ms, 120000);
    cr_assert_eq(small->n_workers, 2);
    cr_assert_eq(small->workers[0].id, 10);
    cr_assert_null(small->workers[0].event_endpoint, "no events: approximate mode");
    km_server_config_json_free(owner);
}

Test(server_config, fields_left_out_keep_their_defaults, .timeout = 10)
{
    char path[64], why[256] = "";
    write_temp(path, sizeof path, "{\"scheduler\": {\"inline_routes\": 0}}");
    km_server_config cfg, defaults;
    km_server_config_init(&cfg);
    km_server_config_init(&defaults);
    km_server_config_json *owner = NULL;
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_eq(cfg.inline_routes, 0);
    cr_assert_eq(cfg.max_batch_routes, defaults.max_batch_routes);
    cr_assert_eq(cfg.index_initial_blocks, 0);
    cr_assert_str_eq(cfg.socket_path, defaults.socket_path);
    cr_assert_eq(cfg.active_ttl_ms, defaults.active_ttl_ms);
    cr_assert_eq(cfg.approx_dispatch_max_bytes, UINT64_C(64) << 20);
    cr_assert_eq(cfg.breaker_failures, 5);
    cr_assert_eq(cfg.breaker_cooldown_ms, 10000);
    cr_assert_eq(cfg.n_pools, 0);
    km_server_config_json_free(owner);
}

/* `none` means off in the config file as it does for the flags that take it (--socket,
 * --records, --cluster): no Unix socket, no records, no cluster; never a file named "none". */
Test(server_config, none_turns_a_setting_off_as_its_flag_does, .timeout = 10)
{
    static const char *const files[] = {
        "{\"socket\": \"none\", \"tcp\": \"127.0.0.1:0\", \"records\": \"none\", "
        "\"cluster\": {\"url\": \"none\"}}",
        "{\"socket\": \"none\", \"records\": {\"path\": \"none\", \"keep_files\": 2}, "
        "\"cluster\": {\"url\": \"none\", \"instance\": \"a\"}}",
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[64], why[256] = "";
        write_temp(path, sizeof path, files[i]);
        km_server_config cfg;
        km_server_config_init(&cfg);
        cfg.cluster_url = "nats://127.0.0.1:1"; /* as a flag read earlier could have set it */
        km_server_config_json *owner = NULL;
        int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
        unlink(path);
        cr_assert_eq(rc, KM_OK, "file %zu: %s", i, why);
        cr_assert_null(cfg.socket_path, "file %zu: socket \"%s\"", i, cfg.socket_path);
        cr_assert_null(cfg.records_path, "file %zu: records \"%s\"", i, cfg.records_path);
        cr_assert_null(cfg.cluster_url, "file %zu: cluster.url \"%s\"", i, cfg.cluster_url);
        km_server_config_json_free(owner);
    }
    /* Any other text is a path as before. */
    char path[64], why[256] = "";
    write_temp(path, sizeof path, "{\"socket\": \"nonesuch.sock\", \"records\": \"None\"}");
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = NULL;
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_str_eq(cfg.socket_path, "nonesuch.sock");
    cr_assert_str_eq(cfg.records_path, "None");
    km_server_config_json_free(owner);
}

/* Records rotation: defaults as the writer's; 0 means what it means to the writer (never rotate),
 * never "the default". */
Test(server_config, records_rotation_zero_means_never, .timeout = 10)
{
    km_record_writer_config wc;
    km_record_writer_config_init(&wc);
    km_server_config cfg;
    km_server_config_init(&cfg);
    cr_assert_eq(cfg.records_max_file_bytes, wc.max_file_bytes);
    cr_assert_eq(cfg.records_keep_files, wc.keep_files);
    cr_assert_eq(cfg.records_max_kept_bytes, wc.max_kept_bytes);
    cr_assert_eq(cfg.records_max_age_s, wc.max_age_s);
    char path[64], why[256] = "";
    write_temp(path, sizeof path,
               "{\"records\": {\"path\": \"r.jsonl\", \"max_file_bytes\": 0, \"keep_files\": 0}}");
    km_server_config_json *owner = NULL;
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_eq(cfg.records_max_file_bytes, 0);
    cr_assert_eq(cfg.records_keep_files, 0);
    km_server_config_json_free(owner);
}

typedef struct bad_file {
    const char *text;
    int status;
    const char *names; /* a substring the message must hold */
} bad_file;

Test(server_config, bad_files_are_refused_naming_the_field, .timeout = 10)
{
    static const bad_file cases[] = {
        {"{\"socket\": ", KM_ERR_PARSE, ":1:"},
        {"[1, 2]", KM_ERR_PARSE, "top level"},
        {"{\"a\": 1, \"a\": 2}", KM_ERR_PARSE, "duplicate"},
        {"{\"scheduler\": 5}", KM_ERR_PARSE, "scheduler"},
        {"{\"scheduler\": {\"inline_routes\": -1}}", KM_ERR_PARSE, "inline_routes"},
        {"{\"scheduler\": {\"max_batch_routes\": 0}}", KM_ERR_INVALID_ARGUMENT, "max_batch_routes"},
        {"{\"index\": {\"backend\": \"gpu\"}}", KM_ERR_PARSE, "index.backend"},
        {"{\"index\": {\"initial_blocks\": \"many\"}}", KM_ERR_PARSE, "initial_blocks"},
        {"{\"index\": {\"initial_blocks\": 99999999999999}}", KM_ERR_INVALID_ARGUMENT, "initial_blocks"},
        {"{\"ready_share\": 2}", KM_ERR_INVALID_ARGUMENT, "ready_share"},
        {"{\"pools\": [{\"name\": \"p\"}]}", KM_ERR_INVALID_ARGUMENT,
         "pools[0].block_size is required"},
        {"{\"max_connections\": 0}", KM_ERR_INVALID_ARGUMENT, "max_connections"},
        {"{\"max_outbox_bytes\": 5368709120}", KM_ERR_INVALID_ARGUMENT, "max_outbox_bytes"},
        {"{\"max_active_entries\": 0}", KM_ERR_INVALID_ARGUMENT, "max_active_entries"},
        {"{\"max_active_bytes\": -1}", KM_ERR_PARSE, "max_active_bytes"},
        {"{\"max_active_bytes\": \"1G\"}", KM_ERR_PARSE, "max_active_bytes"},
        {"{\"socket\": \"/tmp/x.sock\", \"pools\": [{\"name\": \"p\", \"block_size\": 16}], "
         "\"max_connections\": 0}", KM_ERR_INVALID_ARGUMENT, "max_connections"},
        {"{\"approx_dispatch_max_bytes\": -1}", KM_ERR_PARSE, "approx_dispatch_max_bytes"},
        {"{\"breaker_failures\": \"five\"}", KM_ERR_PARSE, "breaker_failures"},
        {"{\"breaker_cooldown_ms\": 0}", KM_ERR_INVALID_ARGUMENT, "breaker_cooldown_ms"},
        {"{\"limits\": {\"max_frame_bytes\": 1}}", KM_ERR_INVALID_ARGUMENT, "max_frame_bytes"},
        {"{\"kv_events\": {\"max_events_per_batch\": 0}}", KM_ERR_INVALID_ARGUMENT,
         "kv_events.max_events_per_batch: 0 is outside 1..4294967295"},
        {"{\"kv_events\": {\"max_payload_bytes\": 4294967296}}", KM_ERR_INVALID_ARGUMENT,
         "kv_events.max_payload_bytes"},
        {"{\"kv_events\": {\"max_string_bytes\": \"1k\"}}", KM_ERR_PARSE,
         "kv_events.max_string_bytes"},
        {"{\"kv_events\": {\"max_events\": 5}}", KM_ERR_PARSE, "max_events"},
        {"{\"kv_events\": 7}", KM_ERR_PARSE, "kv_events"},
        {"{\"records\": 7}", KM_ERR_PARSE, "records"},
        {"{\"engine_metrics\": {\"max_age_ms\": 0}}", KM_ERR_INVALID_ARGUMENT,
         "engine_metrics.max_age_ms"},
        {"{\"engine_metrics\": {\"max_age\": 10}}", KM_ERR_PARSE, "max_age"},
        {"{\"pools\": {}}", KM_ERR_PARSE, "pools"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 0}]}", KM_ERR_INVALID_ARGUMENT,
         "pools[0].block_size"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"offload_chunk_blocks\": 0}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[0].offload_chunk_blocks: 0 is outside 1..4096"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"offload_chunk_blocks\": 4097}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[0].offload_chunk_blocks: 4097 is outside 1..4096"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"offload_chunk_blocks\": \"2\"}]}",
         KM_ERR_PARSE, "pools[0].offload_chunk_blocks"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"offload_chunk_block\": 2}]}",
         KM_ERR_PARSE, "offload_chunk_block"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"fastest\"}]}",
         KM_ERR_PARSE, "pools[0].policy"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"kv\", "
         "\"params\": {\"temperature\": -1}}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[0].params"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"engine\": \"llama-9000\"}]}",
         KM_ERR_PARSE, "pools[0].engine"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"engine\": 70}]}", KM_ERR_PARSE,
         "pools[0].engine"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"llmd\", "
         "\"params\": {\"prefix_weight\": -1}}]}",
         KM_ERR_INVALID_ARGUMENT, "llmd.prefix_weight"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"llmd\", "
         "\"params\": {\"prefix_weight\": 0, "
         "\"queue_weight\": 0, \"kv_usage_weight\": 0}}]}",
         KM_ERR_INVALID_ARGUMENT, "llmd weights"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"llmd\", "
         "\"params\": {\"host_tier_weight\": 2}}]}",
         KM_ERR_INVALID_ARGUMENT, "host_tier_weight"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"preble\", "
         "\"params\": {\"exploit_ratio\": -0.5}}]}",
         KM_ERR_INVALID_ARGUMENT, "preble.exploit_ratio"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"params\": {\"load_bound\": 0.9}}]}",
         KM_ERR_INVALID_ARGUMENT, "ttft.load_bound"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"params\": {\"hot_prefix_sharers\": 1.5}}]}",
         KM_ERR_INVALID_ARGUMENT, "hot_prefix_sharers"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"cache_aware\", "
         "\"params\": {\"balance_abs_threshold\": 1.5}}]}",
         KM_ERR_INVALID_ARGUMENT, "balance_abs_threshold"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"params\": {\"hot_prefix_share\": -1}}]}",
         KM_ERR_INVALID_ARGUMENT, "ttft.hot_prefix_share"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"params\": {\"spread_ms\": -0.5}}]}",
         KM_ERR_INVALID_ARGUMENT, "ttft.spread_ms"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"workers\": [{\"name\": \"x\"}]}]}",
         KM_ERR_PARSE, "pools[0].workers[0].id"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"workers\": [{\"id\": 1, "
         "\"events\": \"ipc:///tmp/x\", \"dp_size\": 2}]}]}",
         KM_ERR_INVALID_ARGUMENT, "no port for rank"},
        /* 0 would read as unset (the default 2 s), not as "no wait": refused, as out of range. */
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16}], \"cluster\": "
         "{\"sync_timeout_ms\": 0}}",
         KM_ERR_INVALID_ARGUMENT, "cluster.sync_timeout_ms"},
        /* Below twice the peers' 20 ms answer spacing a due answer could miss it. */
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16}], \"cluster\": "
         "{\"sync_quiet_ms\": 39}}",
         KM_ERR_INVALID_ARGUMENT, "cluster.sync_quiet_ms"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16}, {\"name\": \"q\", "
         "\"block_size\": 16}, {\"name\": \"p\", \"block_size\": 16}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[2].name: pool p is listed twice (pools[0])"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"workers\": [{\"id\": 3}, "
         "{\"id\": 3}]}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[0].workers[1]: worker 3 is listed twice "
         "(pools[0].workers[0])"},
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"workers\": [{\"id\": 4}]}, "
         "{\"name\": \"q\", \"block_size\": 16, \"workers\": [{\"id\": 2, \"dp_size\": 4}]}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[1].workers[0]: worker 4 is listed twice "
         "(pools[0].workers[0])"},
        /* 60 bytes: a name of its own, but not with /dp0 after it. */
        {"{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"workers\": [{\"id\": 0, "
         "\"name\": \"abcdefghijabcdefghijabcdefghijabcdefghijabcdefghijabcdefghij\", "
         "\"dp_size\": 2}]}]}",
         KM_ERR_INVALID_ARGUMENT, "pools[0].workers[0].name: "},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[64], why[256] = "";
        write_temp(path, sizeof path, cases[i].text);
        km_server_config cfg;
        km_server_config_init(&cfg);
        km_server_config_json *owner = NULL;
        int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
        unlink(path);
        cr_assert_eq(rc, cases[i].status, "case %zu (%s): %s, expected %s: %s", i, cases[i].text,
                     km_error_name(rc), km_error_name(cases[i].status), why);
        cr_assert_null(owner, "case %zu: a refused file hands nothing back", i);
        /* ... and leaves the caller's config as it was: no pointer into the JSON it freed. */
        km_server_config defaults;
        km_server_config_init(&defaults);
        cr_assert(memcmp(&cfg, &defaults, sizeof cfg) == 0, "case %zu: the config was changed", i);
        cr_assert(strstr(why, cases[i].names), "case %zu: \"%s\" does not name %s", i, why,
                  cases[i].names);
    }
    /* A file that is not there. */
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = NULL;
    char why[256] = "";
    cr_assert_eq(km_server_config_load_json("/nonexistent/kvmatch.json", &cfg, &owner, why,
                                            sizeof why),
                 KM_ERR_IO);
    cr_assert(strstr(why, "/nonexistent/kvmatch.json"), "%s", why);
    cr_assert_eq(km_server_config_load_json(NULL, &cfg, &owner, why, sizeof why),
                 KM_ERR_NULL_POINTER);
}

/* A pool names its engine preset and the new policies' parameters. */
Test(server_config, pool_engine_and_peer_policy_params, .timeout = 10)
{
    char path[64], why[256] = "";
    write_temp(path, sizeof path,
               "{\"pools\": [{\"name\": \"p\", \"block_size\": 16, \"policy\": \"llmd\", "
               "\"engine\": \"llama3-70b-h100x4\", \"params\": {\"prefix_weight\": 3, "
               "\"queue_weight\": 2, \"kv_usage_weight\": 2, \"host_tier_weight\": 0.5}}, "
               "{\"name\": \"q\", \"block_size\": 16, \"policy\": \"preble\", "
               "\"params\": {\"exploit_ratio\": 2}}, "
               "{\"name\": \"r\", \"block_size\": 16, \"hash_lookahead_tokens\": 2, "
               "\"offload_chunk_blocks\": 3, \"policy\": \"ttft\", "
               "\"params\": {\"load_bound\": 2, \"hot_prefix_sharers\": 3, "
               "\"hot_prefix_share\": 0.5, \"spread_ms\": 2.5}}]}");
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = NULL;
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_eq(cfg.n_pools, 3);
    const km_policy_config *p = &cfg.pools[0].policy;
    cr_assert_eq(p->kind, KM_POLICY_LLMD);
    km_engine_model m;
    cr_assert_eq(km_engine_model_preset("llama3-70b-h100x4", &m), KM_OK);
    cr_assert(memcmp(&p->engine, &m, sizeof m) == 0, "the preset's model");
    cr_assert_eq(p->llmd.prefix_weight, 3);
    cr_assert_eq(p->llmd.queue_weight, 2);
    cr_assert_eq(p->llmd.kv_usage_weight, 2);
    cr_assert_eq(p->llmd.host_tier_weight, 0.5);
    cr_assert_eq(cfg.pools[1].policy.preble.exploit_ratio, 2);
    cr_assert_eq(cfg.pools[2].policy.ttft.load_bound, 2);
    cr_assert_eq(cfg.pools[2].policy.ttft.hot_prefix_sharers, 3);
    cr_assert_eq(cfg.pools[2].policy.ttft.hot_prefix_share, 0.5);
    cr_assert_eq(cfg.pools[2].policy.ttft.spread_ms, 2.5);
    cr_assert_eq(cfg.pools[2].hash_lookahead_tokens, 2, "a pool key of its own, not unknown");
    cr_assert_eq(cfg.pools[2].offload_chunk_blocks, 3, "a pool key of its own, not unknown");
    cr_assert_eq(cfg.pools[0].offload_chunk_blocks, 0, "left out: the default (one block)");
    km_server_config_json_free(owner);
}
