/* SPDX-License-Identifier: Apache-2.0 */
/* Pool lifetime in the routing service (docs/PROTOCOL.md "POOLS", docs/RELIABILITY.md): POOLS
 * remove ends a pool's workers and releases everything it holds (index, event subscriber with its
 * I/O thread, ZMQ context and sockets, snapshot file). A server that adds and removes event-fed
 * pools a few hundred times ends with the threads and file descriptors it started with and its
 * resident memory back near its start; routes to a removed pool are refused; a name comes free
 * again. A real server in this process on a temporary Unix socket, the C client, the C test
 * publisher on loopback; every test bounds its time. */
#include <dirent.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <msgpack.h>

#include "kv_test_publisher.h"
#include "kvmatch/kvmatch.h"
#include "test_util.h"

#define BS 4u

typedef struct pools_srv {
    km_server *server;
    pthread_t thread;
    char dir[64], sock[128], addr[160], snapshots[128];
    int run_status;
} pools_srv;

static void *pools_run(void *arg)
{
    pools_srv *s = arg;
    s->run_status = km_server_run(s->server, false);
    return NULL;
}

static void pools_quiet(void *user, const char *line)
{
    (void)user;
    if (getenv("KM_TEST_SERVER_LOG"))
        fprintf(stderr, "serve: %s\n", line);
}

/* A server with one approximate-mode pool "main" (workers 0, 1) and a snapshot directory. */
static void pools_start(pools_srv *s)
{
    static km_server_worker workers[2] = {{0, NULL, NULL, NULL, false, 0, NULL}, {1, NULL, NULL, NULL, false, 0, NULL}};
    static km_server_pool main_pool;
    strcpy(s->dir, "/tmp/kvmatch-pools-XXXXXX");
    cr_assert_not_null(mkdtemp(s->dir));
    snprintf(s->sock, sizeof s->sock, "%s/s.sock", s->dir);
    snprintf(s->addr, sizeof s->addr, "unix:%s", s->sock);
    snprintf(s->snapshots, sizeof s->snapshots, "%s/snap", s->dir);
    cr_assert_eq(mkdir(s->snapshots, 0700), 0);
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = s->sock;
    cfg.max_workers = 64;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.index_initial_blocks = 1024;
    cfg.snapshot_dir = s->snapshots;
    cfg.log = pools_quiet;
    memset(&main_pool, 0, sizeof main_pool);
    main_pool.name = "main";
    main_pool.block_size = BS;
    km_policy_config_init(&main_pool.policy);
    main_pool.workers = workers;
    main_pool.n_workers = 2;
    cfg.pools = &main_pool;
    cfg.n_pools = 1;
    char why[256];
    int rc = km_server_create(&cfg, &s->server, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_server_create: %s", why);
    cr_assert_eq(pthread_create(&s->thread, NULL, pools_run, s), 0);
}

static void pools_stop(pools_srv *s)
{
    km_server_stop(s->server);
    pthread_join(s->thread, NULL);
    cr_assert_eq(s->run_status, KM_OK);
    km_server_destroy(s->server);
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", s->dir);
}

/* One POOLS request for one pool; the item's status. */
static int pools_call(km_client *c, km_admin_action action, const char *name)
{
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = name;
    pi.block_size = action == KM_ADMIN_ADD ? BS : 0;
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = action;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    return reply.ack.items[0].status;
}

/* Event-fed workers first..first+n-1 of pool `name`, on the publisher's endpoints. */
static void add_event_workers(km_client *c, const char *name, uint32_t first, uint32_t n,
                              const km_test_publisher *pub)
{
    km_worker_info wi[4];
    cr_assert(n <= 4);
    memset(wi, 0, sizeof wi);
    for (uint32_t i = 0; i < n; i++) {
        wi[i].pool = name;
        wi[i].worker = first + i;
        wi[i].event_endpoint = km_test_publisher_endpoint(pub);
        wi[i].replay_endpoint = km_test_publisher_replay_endpoint(pub);
    }
    km_message m = {.type = KM_MESSAGE_WORKERS}, reply;
    m.workers.action = KM_ADMIN_ADD;
    m.workers.workers = wi;
    m.workers.n_workers = n;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK);
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(reply.ack.items[i].status, KM_OK, "%s", reply.ack.items[i].message);
}

static int route_status(km_client *c, const char *pool_name)
{
    uint64_t hashes[3] = {101, 102, 103};
    static unsigned next_id;
    char id[32];
    snprintf(id, sizeof id, "r%u", next_id++); /* a new request each time: no "already in flight" */
    km_route_request r;
    memset(&r, 0, sizeof r);
    r.request_id = id;
    r.pool = pool_name;
    r.input = KM_ROUTE_INPUT_HASHES;
    r.hashes = hashes;
    r.n_hashes = 3;
    km_message reply;
    cr_assert_eq(km_client_route(c, &r, 1, 10000, &reply), KM_OK);
    if (reply.decision.decisions[0].status != KM_OK && getenv("KM_TEST_SERVER_LOG"))
        fprintf(stderr, "route to %s: %s\n", pool_name,
                reply.decision.decisions[0].message ? reply.decision.decisions[0].message : "");
    return reply.decision.decisions[0].status;
}

static long proc_status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    cr_assert(f);
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':')
            v = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return v;
}

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    cr_assert(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static bool file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Remove, then what follows: routes refused, the list without it, the name free, unknown names
 * refused, the other pool untouched. */
Test(pools, remove_ends_the_pool_and_frees_its_name, .timeout = 60)
{
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    km_test_publisher *pub = NULL;
    cr_assert_eq(km_test_publisher_start(&pc, &pub), KM_OK);
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);

    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, "extra"), KM_OK);
    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, "extra"), KM_ERR_INVALID_ARGUMENT, "added twice");
    add_event_workers(c, "extra", 10, 2, pub);
    cr_assert_eq(route_status(c, "extra"), KM_OK);
    /* The snapshot written at this point is the pool's own and goes with it. */
    char snap[256];
    snprintf(snap, sizeof snap, "%s/extra.snap", s.snapshots);
    FILE *f = fopen(snap, "w");
    cr_assert(f);
    fputs("stale", f);
    fclose(f);

    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "extra"), KM_OK);
    cr_assert_eq(route_status(c, "extra"), KM_ERR_NOT_FOUND);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "extra"), KM_ERR_NOT_FOUND);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "never-added"), KM_ERR_NOT_FOUND);
    cr_assert(!file_exists(snap), "the removed pool's snapshot file is still there");

    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.pools.n_pools, 1);
    cr_assert_str_eq(reply.pools.pools[0].name, "main");
    m = (km_message){.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 2, "the removed pool's workers are still listed");

    /* The name and the worker ids come free: added again, it starts empty and routes. */
    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, "extra"), KM_OK);
    add_event_workers(c, "extra", 10, 2, pub);
    cr_assert_eq(route_status(c, "extra"), KM_OK);
    /* Pools after a removed one keep routing (they moved down one place). */
    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, "later"), KM_OK);
    add_event_workers(c, "later", 20, 1, pub);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "extra"), KM_OK);
    cr_assert_eq(route_status(c, "later"), KM_OK);
    cr_assert_eq(route_status(c, "main"), KM_OK);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "later"), KM_OK);
    km_client_close(c);
    pools_stop(&s);
    km_test_publisher_stop(pub);
}

/* One POOLS add / update of `name` with hash_lookahead_tokens; the item's status. */
static int pools_call_lookahead(km_client *c, km_admin_action action, const char *name,
                                uint32_t lookahead)
{
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = name;
    pi.block_size = action == KM_ADMIN_ADD ? BS : 0;
    pi.hash_lookahead_tokens = lookahead;
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = action;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    return reply.ack.items[0].status;
}

/* Publish one batch holding a BlockStored of two blocks (engine hashes 501, 502), tokens 1..8,
 * with one lookahead token per block (5 and 9), as vLLM 0.33 encodes it under EAGLE. */
static void publish_lookahead_blocks(km_test_publisher *pub)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 6);
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "BlockStored", 11);
    msgpack_pack_str_with_body(&pk, "block_hashes", 12);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint64(&pk, 501);
    msgpack_pack_uint64(&pk, 502);
    msgpack_pack_str_with_body(&pk, "parent_block_hash", 17);
    msgpack_pack_nil(&pk);
    msgpack_pack_str_with_body(&pk, "token_ids", 9);
    msgpack_pack_array(&pk, 2 * BS);
    for (uint32_t t = 1; t <= 2 * BS; t++)
        msgpack_pack_uint32(&pk, t);
    msgpack_pack_str_with_body(&pk, "block_size", 10);
    msgpack_pack_uint32(&pk, BS);
    msgpack_pack_str_with_body(&pk, "lookahead_token_ids", 19);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint32(&pk, BS + 1);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint32(&pk, 2 * BS + 1);
    msgpack_pack_nil(&pk);
    km_test_publisher_publish(pub, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
}

/* The owner depth of a route of `tokens` to pool_name. */
static uint32_t route_tokens_depth(km_client *c, const char *pool_name, const uint32_t *tokens,
                                   uint32_t n)
{
    static unsigned next_id;
    char id[32];
    snprintf(id, sizeof id, "t%u", next_id++);
    km_route_request r;
    memset(&r, 0, sizeof r);
    r.request_id = id;
    r.pool = pool_name;
    r.input = KM_ROUTE_INPUT_TOKENS;
    r.tokens = tokens;
    r.n_tokens = n;
    km_message reply;
    cr_assert_eq(km_client_route(c, &r, 1, 10000, &reply), KM_OK);
    cr_assert_eq(reply.decision.decisions[0].status, KM_OK, "%s",
                 reply.decision.decisions[0].message);
    return reply.decision.decisions[0].has_owner ? reply.decision.decisions[0].owner_depth : 0;
}

/* POOLS add sets a pool's hash_lookahead_tokens: POOL_LIST shows it, update cannot change it,
 * a value over the limit is refused, the pool's workers' stores with that many lookahead tokens
 * are indexed, and token routes hash with it (a prompt diverging right after block 1 holds only
 * block 0). */
Test(pools, add_sets_hash_lookahead_tokens, .timeout = 60)
{
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    km_test_publisher *pub = NULL;
    cr_assert_eq(km_test_publisher_start(&pc, &pub), KM_OK);
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);

    cr_assert_eq(pools_call_lookahead(c, KM_ADMIN_ADD, "eagle", 1), KM_OK);
    cr_assert_eq(pools_call_lookahead(c, KM_ADMIN_ADD, "huge", KM_HASH_MAX_LOOKAHEAD + 1),
                 KM_ERR_PARSE);
    cr_assert_eq(pools_call_lookahead(c, KM_ADMIN_UPDATE, "eagle", 2), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(pools_call_lookahead(c, KM_ADMIN_UPDATE, "eagle", 1), KM_OK);
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.pools.n_pools, 2);
    cr_assert_str_eq(reply.pools.pools[0].name, "main");
    cr_assert_eq(reply.pools.pools[0].hash_lookahead_tokens, 0);
    cr_assert_str_eq(reply.pools.pools[1].name, "eagle");
    cr_assert_eq(reply.pools.pools[1].hash_lookahead_tokens, 1);

    add_event_workers(c, "eagle", 10, 1, pub);
    cr_assert(km_test_publisher_wait_subscribers(pub, 1, 5000));
    publish_lookahead_blocks(pub);
    uint32_t same[2 * BS + 2], diverging[2 * BS + 2];
    for (uint32_t t = 0; t < 2 * BS + 2; t++)
        same[t] = diverging[t] = t + 1;
    diverging[2 * BS] = 99; /* block 1's lookahead token differs */
    uint32_t depth = 0;
    for (int i = 0; i < 500 && depth < 2; i++, km_test_sleep_ms(10))
        depth = route_tokens_depth(c, "eagle", same, 2 * BS + 2);
    cr_assert_eq(depth, 2, "the stored blocks never matched");
    cr_assert_eq(route_tokens_depth(c, "eagle", diverging, 2 * BS + 2), 1);
    km_client_close(c);
    pools_stop(&s);
    km_test_publisher_stop(pub);
}

/* One POOLS add / update of `name` with offload_chunk_blocks; the item's status. */
static int pools_call_chunk(km_client *c, km_admin_action action, const char *name,
                            uint32_t chunk)
{
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = name;
    pi.block_size = action == KM_ADMIN_ADD ? BS : 0;
    pi.offload_chunk_blocks = chunk;
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = action;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    return reply.ack.items[0].status;
}

/* POOLS add sets a pool's offload_chunk_blocks as the configuration file does: POOL_LIST shows it
 * (above 1), update may repeat it but not change it (chunks are held with it), a value over the
 * limit is refused. */
Test(pools, add_sets_offload_chunk_blocks, .timeout = 60)
{
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(pools_call_chunk(c, KM_ADMIN_ADD, "chunks", 2), KM_OK);
    cr_assert_eq(pools_call_chunk(c, KM_ADMIN_ADD, "huge", KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS + 1),
                 KM_ERR_PARSE);
    cr_assert_eq(pools_call_chunk(c, KM_ADMIN_UPDATE, "chunks", 3), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(pools_call_chunk(c, KM_ADMIN_UPDATE, "chunks", 2), KM_OK);
    cr_assert_eq(pools_call_chunk(c, KM_ADMIN_UPDATE, "main", 2), KM_ERR_INVALID_ARGUMENT,
                 "a pool of one-block chunks cannot become one of two");
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.pools.n_pools, 2);
    cr_assert_str_eq(reply.pools.pools[0].name, "main");
    cr_assert_eq(reply.pools.pools[0].offload_chunk_blocks, 0);
    cr_assert_str_eq(reply.pools.pools[1].name, "chunks");
    cr_assert_eq(reply.pools.pools[1].offload_chunk_blocks, 2);
    km_client_close(c);
    pools_stop(&s);
}

/* `kvmatch route --remove-pool NAME` (exit 0 with the ACK's status, 1 when the server refuses). */
Test(pools, cli_remove_pool, .timeout = 60)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    if (access(bin, X_OK) != 0)
        cr_skip_test("%s not built", bin);
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, "by-cli"), KM_OK);
    for (int attempt = 0; attempt < 2; attempt++) {
        char cmd[512], out[512] = "";
        snprintf(cmd, sizeof cmd, "'%s' route --connect '%s' --remove-pool by-cli 2>&1", bin,
                 s.addr);
        FILE *p = popen(cmd, "r");
        cr_assert(p);
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        int status = pclose(p);
        cr_assert(WIFEXITED(status));
        if (attempt == 0) {
            cr_assert_eq(WEXITSTATUS(status), 0, "%s", out);
            cr_assert(strstr(out, "\"status\":0"), "%s", out);
        } else {
            cr_assert_eq(WEXITSTATUS(status), 1, "%s", out);
            cr_assert(strstr(out, "KM_ERR_NOT_FOUND") && strstr(out, "no pool by-cli"), "%s", out);
        }
    }
    km_client_close(c);
    pools_stop(&s);
}

/* Adding and removing an event-fed pool a few hundred times leaks nothing: threads and file
 * descriptors return exactly to their count after the first rounds, and resident memory stays
 * within a bound far below what the pools held together (each held an index, a subscriber
 * thread and a ZMQ context). */
Test(pools, add_and_remove_hundreds_of_times_leaves_nothing, .timeout = 240)
{
    enum { WARMUP = 10, ROUNDS = 300 };
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    km_test_publisher *pub = NULL;
    cr_assert_eq(km_test_publisher_start(&pc, &pub), KM_OK);
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);
    long threads0 = 0, rss0 = 0, peak_threads = 0;
    int fds0 = 0;
    for (int round = 0; round < WARMUP + ROUNDS; round++) {
        if (round == WARMUP) {
            malloc_trim(0);
            threads0 = proc_status_kb("Threads");
            fds0 = open_fds();
            rss0 = proc_status_kb("VmRSS");
        }
        char name[32];
        snprintf(name, sizeof name, "p%d", round);
        cr_assert_eq(pools_call(c, KM_ADMIN_ADD, name), KM_OK, "round %d", round);
        add_event_workers(c, name, 30, 2, pub);
        cr_assert_eq(route_status(c, name), KM_OK);
        long t = proc_status_kb("Threads");
        if (t > peak_threads)
            peak_threads = t;
        cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, name), KM_OK, "round %d", round);
    }
    malloc_trim(0);
    long threads1 = proc_status_kb("Threads"), rss1 = proc_status_kb("VmRSS");
    int fds1 = open_fds();
    /* A removed pool's threads are joined before POOLS remove answers, but the kernel may list a
     * joined thread for a moment longer on a busy machine: wait up to 2 s for the count to settle.
     * The counts may also end below the start (something transient of the server or the test's
     * publisher was open when the start was taken); only a count above it is a leak, and a leak
     * per round would show hundreds. */
    for (int wait = 0; wait < 200 && (threads1 > threads0 || fds1 > fds0); wait++) {
        km_test_sleep_ms(10);
        threads1 = proc_status_kb("Threads");
        fds1 = open_fds();
    }
    cr_log_info("pools added and removed %d times: threads %ld -> %ld (peak %ld with one pool), "
                "fds %d -> %d, RSS %ld -> %ld kB",
                ROUNDS, threads0, threads1, peak_threads, fds0, fds1, rss0, rss1);
    cr_assert_gt(peak_threads, threads0, "a pool with event-fed workers runs no thread of its own: "
                 "the test measures nothing");
    cr_assert_leq(threads1, threads0, "threads %ld -> %ld", threads0, threads1);
    cr_assert_leq(fds1, fds0, "fds %d -> %d", fds0, fds1);
    /* 300 pools kept would be hundreds of MB; allocator slack stays within a few MB. Under
     * AddressSanitizer freed memory stays in quarantine, so resident memory says nothing there. */
#if !defined(__SANITIZE_ADDRESS__)
    cr_assert_lt(rss1 - rss0, 16 * 1024, "RSS %ld -> %ld kB", rss0, rss1);
#endif
    km_client_close(c);
    pools_stop(&s);
    km_test_publisher_stop(pub);
}

/* ---- a configuration file read again (km_server_reload, as kvmatch serve's SIGHUP runs it) */

/* A server started from a JSON configuration file, whose SIGHUP reads the file again and hands it
 * to km_server_reload on the loop thread, as kvmatch serve does; its log lines kept in memory. */
typedef struct reload_srv {
    pools_srv base;
    char config[160];
    km_server_config_json *owner;
    pthread_mutex_t log_lock;
    char log[1 << 16];
    size_t log_len;
    int reloads;      /* reloads run (log_lock) */
    int load_status;  /* the last reload's km_server_config_load_json */
    int reload_status; /* the last reload's km_server_reload */
    const km_server_config *next; /* when set, what the next reload applies instead of the file */
} reload_srv;

static void reload_log(void *user, const char *line)
{
    reload_srv *r = user;
    pthread_mutex_lock(&r->log_lock);
    size_t n = strlen(line);
    if (r->log_len + n + 2 < sizeof r->log) {
        memcpy(r->log + r->log_len, line, n);
        r->log_len += n;
        r->log[r->log_len++] = '\n';
        r->log[r->log_len] = '\0';
    }
    pthread_mutex_unlock(&r->log_lock);
    if (getenv("KM_TEST_SERVER_LOG"))
        fprintf(stderr, "serve: %s\n", line);
}

static bool reload_logged(reload_srv *r, const char *text)
{
    pthread_mutex_lock(&r->log_lock);
    bool found = strstr(r->log, text) != NULL;
    pthread_mutex_unlock(&r->log_lock);
    return found;
}

static void reload_on_hangup(km_server *server, void *user)
{
    reload_srv *r = user;
    km_server_config fresh;
    km_server_config_init(&fresh);
    km_server_config_json *owner = NULL;
    char why[512];
    int load = r->next ? KM_OK
                       : km_server_config_load_json(r->config, &fresh, &owner, why, sizeof why);
    int rc = KM_OK;
    if (load != KM_OK)
        reload_log(r, why);
    else
        rc = km_server_reload(server, r->next ? r->next : &fresh);
    km_server_config_json_free(owner);
    pthread_mutex_lock(&r->log_lock);
    r->load_status = load;
    r->reload_status = rc;
    r->reloads++;
    pthread_mutex_unlock(&r->log_lock);
}

static void reload_write(reload_srv *r, const char *json)
{
    FILE *f = fopen(r->config, "w");
    cr_assert_not_null(f);
    cr_assert_geq(fputs(json, f), 0);
    cr_assert_eq(fclose(f), 0);
}

static void *reload_run(void *arg)
{
    pools_srv *s = arg;
    s->run_status = km_server_run(s->server, true);
    return NULL;
}

/* Start from `json` (its pools; the rest of the settings the test's) and connect *c. */
static void reload_start(reload_srv *r, const char *json, km_client **c)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->log_lock, NULL);
    pools_srv *s = &r->base;
    strcpy(s->dir, "/tmp/kvmatch-reload-XXXXXX");
    cr_assert_not_null(mkdtemp(s->dir));
    snprintf(s->sock, sizeof s->sock, "%s/s.sock", s->dir);
    snprintf(s->addr, sizeof s->addr, "unix:%s", s->sock);
    snprintf(r->config, sizeof r->config, "%s/kvmatch.json", s->dir);
    reload_write(r, json);
    km_server_config cfg;
    km_server_config_init(&cfg);
    char why[512];
    cr_assert_eq(km_server_config_load_json(r->config, &cfg, &r->owner, why, sizeof why), KM_OK,
                 "%s", why);
    cfg.socket_path = s->sock;
    cfg.records_path = NULL;
    cfg.max_workers = 64;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.index_initial_blocks = 1024;
    cfg.log = reload_log;
    cfg.log_user = r;
    cfg.on_hangup = reload_on_hangup;
    cfg.hangup_user = r;
    int rc = km_server_create(&cfg, &s->server, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_server_create: %s", why);
    cr_assert_eq(pthread_create(&s->thread, NULL, reload_run, s), 0);
    cr_assert_eq(km_client_connect(s->addr, 5000, c, why, sizeof why), KM_OK, "%s", why);
}

/* Write `json` into the file, SIGHUP, and wait (up to 5 s) for the reload to end. The settings
 * outside the pools must be the ones reload_start gave the server, so the file sets only pools. */
static void reload_with(reload_srv *r, const char *json)
{
    reload_write(r, json);
    pthread_mutex_lock(&r->log_lock);
    int before = r->reloads;
    pthread_mutex_unlock(&r->log_lock);
    cr_assert_eq(kill(getpid(), SIGHUP), 0);
    for (int wait = 0; wait < 500; wait++) {
        pthread_mutex_lock(&r->log_lock);
        int now = r->reloads;
        pthread_mutex_unlock(&r->log_lock);
        if (now > before)
            return;
        km_test_sleep_ms(10);
    }
    cr_assert_fail("the reload did not run within 5 s");
}

static void reload_stop(reload_srv *r, km_client *c)
{
    km_client_close(c);
    r->base.snapshots[0] = '\0';
    pools_stop(&r->base);
    km_server_config_json_free(r->owner);
    pthread_mutex_destroy(&r->log_lock);
}

/* POOL_LIST's entry for pool `name` (valid until the next call on c); fails the test if absent. */
static const km_pool_info *listed_pool(km_client *c, km_message *reply, const char *name)
{
    km_message m = {.type = KM_MESSAGE_POOLS};
    m.pools.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply->type, KM_MESSAGE_POOL_LIST);
    for (uint32_t i = 0; i < reply->pools.n_pools; i++)
        if (!strcmp(reply->pools.pools[i].name, name))
            return &reply->pools.pools[i];
    cr_assert_fail("pool %s is not listed", name);
    return NULL;
}

/* One POOLS update of `name`'s engine preset; the item's status, its message into msg. */
static int pools_update_engine(km_client *c, const char *name, const char *engine, char *msg,
                               size_t msg_size)
{
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = name;
    pi.engine = engine;
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_UPDATE;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    snprintf(msg, msg_size, "%s", reply.ack.items[0].message ? reply.ack.items[0].message : "");
    return reply.ack.items[0].status;
}

/* A pool's engine preset is fixed for its life, in a reload as in POOLS update (its approximate
 * mode's capacity and the policy's timing were set from it): both refuse a change with a message
 * that names the pool, both presets and what to do, and the pool keeps its engine, policy and
 * workers. The same preset is accepted by both. */
Test(pools, engine_change_is_refused_by_reload_and_update_alike, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 16, \"policy\": \"ttft\","
                     " \"engine\": \"llama3-8b-h100\", \"workers\": [{\"id\": 0}]}]}", &c);
    km_message reply;
    const km_pool_info *p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->engine, "llama3-8b-h100");
    double capacity = -1;
    for (uint32_t k = 0; k < p->n_params; k++)
        if (!strcmp(p->params[k].name, "approx_capacity_blocks"))
            capacity = p->params[k].value;
    cr_assert_gt(capacity, 0);

    /* The file asks for another engine and another spread_ms: the pool is refused whole. */
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 16, \"policy\": \"ttft\","
                    " \"engine\": \"llama3-70b-h100x4\", \"params\": {\"spread_ms\": 7},"
                    " \"workers\": [{\"id\": 0}, {\"id\": 1}]}]}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "the reload accepted another engine");
    cr_assert(reload_logged(&r, "reload: pool main refused: engine cannot change "
                                "(llama3-8b-h100 -> llama3-70b-h100x4"), "%s", r.log);
    cr_assert(reload_logged(&r, "POOLS remove"), "the refusal does not say what to do: %s", r.log);
    p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->engine, "llama3-8b-h100");
    for (uint32_t k = 0; k < p->n_params; k++) {
        if (!strcmp(p->params[k].name, "approx_capacity_blocks"))
            cr_assert_eq(p->params[k].value, capacity);
        if (!strcmp(p->params[k].name, "spread_ms"))
            cr_assert_eq(p->params[k].value, 1.0, "the refused pool's parameters changed");
    }
    km_message m = {.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused pool's workers changed");

    /* POOLS update says the same. */
    char msg[256];
    cr_assert_eq(pools_update_engine(c, "main", "llama3-70b-h100x4", msg, sizeof msg),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(msg, "pool main: engine cannot change (llama3-8b-h100 -> "
                          "llama3-70b-h100x4"), "%s", msg);
    cr_assert(strstr(msg, "POOLS remove"), "%s", msg);
    cr_assert_eq(pools_update_engine(c, "main", "llama3-8b-h100", msg, sizeof msg), KM_OK, "%s",
                 msg);

    /* The same engine in the file: the rest of the pool's change applies. */
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 16, \"policy\": \"ttft\","
                    " \"engine\": \"llama3-8b-h100\", \"params\": {\"spread_ms\": 7},"
                    " \"workers\": [{\"id\": 0}, {\"id\": 1}]}]}");
    cr_assert_eq(r.reload_status, KM_OK, "%s", r.log);
    p = listed_pool(c, &reply, "main");
    bool spread = false;
    for (uint32_t k = 0; k < p->n_params; k++)
        if (!strcmp(p->params[k].name, "spread_ms"))
            spread = p->params[k].value == 7.0;
    cr_assert(spread, "the accepted reload's parameter is not applied");
    reload_stop(&r, c);
}

/* A file that lists a pool twice, or a worker twice, is refused whole at a reload, as at the
 * start: nothing changes (applied entry by entry, the second entry of the pool would remove the
 * workers the first lists, and the first would add them again without their index state or their
 * active work). */
Test(pools, reload_refuses_a_file_listing_a_pool_or_a_worker_twice, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"workers\": "
                     "[{\"id\": 0}]}]}", &c);
    cr_assert_eq(route_status(c, "main"), KM_OK);
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"workers\": "
                    "[{\"id\": 0}]}, {\"name\": \"main\", \"block_size\": 4, \"workers\": "
                    "[{\"id\": 1}]}]}");
    cr_assert_eq(r.load_status, KM_ERR_INVALID_ARGUMENT, "a pool listed twice was read: %s",
                 r.log);
    cr_assert(reload_logged(&r, "pools[1].name: pool main is listed twice (pools[0])"), "%s",
              r.log);
    cr_assert(!reload_logged(&r, "worker 0 removed"), "%s", r.log);
    km_message m = {.type = KM_MESSAGE_WORKERS}, reply;
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused file's workers were applied");

    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"workers\": "
                    "[{\"id\": 0}, {\"id\": 1}]}, {\"name\": \"other\", \"block_size\": 4, "
                    "\"workers\": [{\"id\": 2, \"dp_size\": 2}, {\"id\": 1}]}]}");
    cr_assert_eq(r.load_status, KM_ERR_INVALID_ARGUMENT, "a worker listed twice was read: %s",
                 r.log);
    cr_assert(reload_logged(&r, "pools[1].workers[1]: worker 1 is listed twice "
                                "(pools[0].workers[1])"), "%s", r.log);
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused file's workers were applied");
    km_message reply2;
    listed_pool(c, &reply2, "main");
    cr_assert_eq(reply2.pools.n_pools, 1, "the refused file's pool was added");
    reload_stop(&r, c);
}

/* km_server_reload refuses a configuration that lists a pool twice, or a worker twice, as
 * km_server_create does (kvmatch serve's flags can add such a pool or worker to a file that
 * lists it): nothing changes, the log says why, and the workers keep their state. */
Test(pools, reload_refuses_a_configuration_listing_a_pool_or_a_worker_twice, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"workers\": "
                     "[{\"id\": 0}]}]}", &c);
    cr_assert_eq(route_status(c, "main"), KM_OK);
    km_server_config next;
    km_server_config_init(&next);
    next.socket_path = r.base.sock;
    next.records_path = NULL;
    km_server_worker w0 = {0, NULL, NULL, NULL, false, 0, NULL};
    km_server_worker w1 = {1, NULL, NULL, NULL, false, 0, NULL};
    km_server_pool pools[2];
    memset(pools, 0, sizeof pools);
    for (int i = 0; i < 2; i++) {
        pools[i].name = "main";
        pools[i].block_size = 4;
        km_policy_config_init(&pools[i].policy);
    }
    pools[0].workers = &w1;
    pools[0].n_workers = 1;
    pools[1].workers = &w0;
    pools[1].n_workers = 1;
    next.pools = pools;
    next.n_pools = 2;
    r.next = &next;
    reload_with(&r, "{}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload refused, nothing changed: pool main is listed twice"),
              "%s", r.log);
    cr_assert(!reload_logged(&r, "worker 0 removed"), "%s", r.log);
    km_message m = {.type = KM_MESSAGE_WORKERS}, reply;
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused configuration's workers were applied");

    km_server_worker both[2] = {w0, w1};
    pools[0].name = "main";
    pools[0].workers = both;
    pools[0].n_workers = 2;
    pools[1].name = "other";
    pools[1].workers = &w1;
    pools[1].n_workers = 1;
    reload_with(&r, "{}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload refused, nothing changed: worker 1 is listed twice "
                                "(pools main and other)"), "%s", r.log);
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused configuration's workers were applied");
    km_message lr;
    listed_pool(c, &lr, "main");
    cr_assert_eq(lr.pools.n_pools, 1, "the refused configuration's pool was added");
    reload_stop(&r, c);
}

/* ---- a copy the service cannot allocate: refused whole, nothing changed -------------------- */

/* strdup, failing for any string that contains STRDUP_FAILS: the service copies a pool's model
 * and a worker's endpoints with it, so a request naming such a string meets the out-of-memory
 * path of that copy and no other allocation. Every other string is copied as libc's would. */
#define STRDUP_FAILS "strdup-fails"

char *strdup(const char *s)
{
    if (strstr(s, STRDUP_FAILS))
        return NULL;
    size_t n = strlen(s) + 1;
    char *copy = malloc(n);
    return copy ? memcpy(copy, s, n) : NULL;
}

/* POOLS update whose model cannot be copied fails with KM_ERR_OUT_OF_MEMORY, and the pool keeps
 * its policy as well as its model: the update is all of the item or none of it. */
Test(pools, update_whose_model_cannot_be_copied_changes_nothing, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"prefix\","
                     " \"model\": \"m1\", \"workers\": [{\"id\": 0}]}]}", &c);
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = "main";
    pi.model = STRDUP_FAILS "-model";
    pi.policy = "kv";
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_UPDATE;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    cr_assert_eq(reply.ack.items[0].status, KM_ERR_OUT_OF_MEMORY, "the update was reported done");
    cr_assert(reply.ack.items[0].message && strstr(reply.ack.items[0].message, "out of memory"),
              "%s", reply.ack.items[0].message ? reply.ack.items[0].message : "(no message)");
    const km_pool_info *p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->policy, "prefix", "the refused update's policy was applied");
    cr_assert_str_eq(p->model, "m1");
    cr_assert(!reload_logged(&r, "pool main updated"), "%s", r.log);
    reload_stop(&r, c);
}

/* A reload whose model for a listed pool the service would refuse at the start or in POOLS update
 * (a control character), or cannot copy, refuses that pool whole: its policy, model and workers
 * stay as they are, the log says why, and the reload's status is the refusal's. */
Test(pools, reload_refuses_a_model_it_cannot_take_and_keeps_the_pool, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"prefix\","
                     " \"model\": \"m1\", \"workers\": [{\"id\": 0}]}]}", &c);
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"kv\","
                    " \"model\": \"bad\\u0007model\", \"workers\": [{\"id\": 0}, {\"id\": 1}]}]}");
    cr_assert_eq(r.load_status, KM_OK, "%s", r.log);
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "a control character was taken");
    cr_assert(reload_logged(&r, "reload: pool main refused: model must be UTF-8 without control "
                                "characters"), "%s", r.log);
    km_message reply;
    const km_pool_info *p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->policy, "prefix", "the refused pool's policy was applied");
    cr_assert_str_eq(p->model, "m1");
    km_message m = {.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 1, "the refused pool's workers changed");

    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"kv\","
                    " \"model\": \"" STRDUP_FAILS "-model\", \"workers\": [{\"id\": 0}]}]}");
    cr_assert_eq(r.reload_status, KM_ERR_OUT_OF_MEMORY, "the reload was reported done: %s", r.log);
    cr_assert(reload_logged(&r, "reload: pool main refused: out of memory"), "%s", r.log);
    p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->policy, "prefix", "the refused pool's policy was applied");
    cr_assert_str_eq(p->model, "m1");

    /* The same file with a model it can take applies whole. */
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"kv\","
                    " \"model\": \"m2\", \"workers\": [{\"id\": 0}]}]}");
    cr_assert_eq(r.reload_status, KM_OK, "%s", r.log);
    p = listed_pool(c, &reply, "main");
    cr_assert_str_eq(p->policy, "kv");
    cr_assert_str_eq(p->model, "m2");
    reload_stop(&r, c);
}

/* WORKERS add whose endpoint cannot be copied fails with KM_ERR_OUT_OF_MEMORY and adds nothing:
 * a worker kept without its endpoint would be listed without it, and the next reload would take
 * it for one whose endpoints changed and remove it with its index. */
Test(pools, worker_add_whose_endpoint_cannot_be_copied_adds_nothing, .timeout = 60)
{
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);
    km_worker_info wi;
    memset(&wi, 0, sizeof wi);
    wi.pool = "main";
    wi.worker = 7;
    wi.event_endpoint = "ipc:///tmp/kvmatch-" STRDUP_FAILS;
    km_message m = {.type = KM_MESSAGE_WORKERS}, reply;
    m.workers.action = KM_ADMIN_ADD;
    m.workers.workers = &wi;
    m.workers.n_workers = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    cr_assert_eq(reply.ack.items[0].status, KM_ERR_OUT_OF_MEMORY, "the add was reported done");
    cr_assert(reply.ack.items[0].message && strstr(reply.ack.items[0].message, "out of memory"),
              "%s", reply.ack.items[0].message ? reply.ack.items[0].message : "(no message)");
    m = (km_message){.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.workers.n_workers, 2, "the refused worker was added");
    /* The id stays free: added with an endpoint it can copy, the worker is taken. */
    wi.event_endpoint = "ipc:///tmp/kvmatch-pools-worker-7";
    m = (km_message){.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_ADD;
    m.workers.workers = &wi;
    m.workers.n_workers = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK);
    cr_assert_eq(reply.ack.items[0].status, KM_OK, "%s", reply.ack.items[0].message);
    km_client_close(c);
    pools_stop(&s);
}

/* POOLS remove deletes the pool's snapshot file however little memory is left: a file kept would
 * be restored into a pool added later under the same name, which must start empty. */
Test(pools, remove_deletes_the_snapshot_without_copying_its_path, .timeout = 60)
{
    pools_srv s;
    pools_start(&s);
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(s.addr, 5000, &c, why, sizeof why), KM_OK, "%s", why);
    /* The pool's name is in its snapshot path, so a copy of that path would fail. */
    cr_assert_eq(pools_call(c, KM_ADMIN_ADD, STRDUP_FAILS), KM_OK);
    char snap[256];
    snprintf(snap, sizeof snap, "%s/" STRDUP_FAILS ".snap", s.snapshots);
    FILE *f = fopen(snap, "w");
    cr_assert(f);
    fputs("stale", f);
    fclose(f);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, STRDUP_FAILS), KM_OK);
    cr_assert(!file_exists(snap), "the removed pool's snapshot file is still there");
    km_client_close(c);
    pools_stop(&s);
}

/* A refused POOLS or WORKERS item is logged as well as answered, as a reload's refusals are: the
 * service's log holds what an operator was refused, not only what was done. */
Test(pools, refused_admin_items_are_logged, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"policy\": \"prefix\","
                     " \"workers\": [{\"id\": 0}]}]}", &c);
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = "main";
    pi.policy = "no-such-policy";
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = KM_ADMIN_UPDATE;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.ack.items[0].status, KM_ERR_INVALID_ARGUMENT);
    cr_assert(reload_logged(&r, "POOLS update of pool main refused: unknown policy "
                                "\"no-such-policy\""), "%s", r.log);
    cr_assert_eq(pools_call(c, KM_ADMIN_REMOVE, "never-added"), KM_ERR_NOT_FOUND);
    cr_assert(reload_logged(&r, "POOLS remove of pool never-added refused: no pool never-added"),
              "%s", r.log);

    km_worker_info wi;
    memset(&wi, 0, sizeof wi);
    wi.pool = "elsewhere";
    wi.worker = 5;
    m = (km_message){.type = KM_MESSAGE_WORKERS};
    m.workers.action = KM_ADMIN_ADD;
    m.workers.workers = &wi;
    m.workers.n_workers = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.ack.items[0].status, KM_ERR_NOT_FOUND);
    cr_assert(reload_logged(&r, "WORKERS add of worker 5 refused: no pool elsewhere"), "%s",
              r.log);
    reload_stop(&r, c);
}

/* POOLS add or update naming `model` for pool `name`; the item's status and message. */
static int pool_model_call(km_client *c, km_admin_action action, const char *name,
                           const char *model, char *msg, size_t msg_size)
{
    km_pool_info pi;
    memset(&pi, 0, sizeof pi);
    pi.name = name;
    pi.model = model;
    pi.block_size = action == KM_ADMIN_ADD ? 4 : 0;
    km_message m = {.type = KM_MESSAGE_POOLS}, reply;
    m.pools.action = action;
    m.pools.pools = &pi;
    m.pools.n_pools = 1;
    cr_assert_eq(km_client_call(c, &m, 10000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    snprintf(msg, msg_size, "%s", reply.ack.items[0].message ? reply.ack.items[0].message : "");
    return reply.ack.items[0].status;
}

/* A model names one pool, since a route naming it reaches one: the start, POOLS add and update
 * and a reload refuse a model another pool serves, saying which, and change nothing; a reload
 * may hand a model from one listed pool to another. */
Test(pools, a_model_names_one_pool, .timeout = 60)
{
    reload_srv r;
    km_client *c = NULL;
    reload_start(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"model\": \"m1\"}, "
                     "{\"name\": \"other\", \"block_size\": 4, \"model\": \"m2\"}]}", &c);
    char msg[256];
    cr_assert_eq(pool_model_call(c, KM_ADMIN_ADD, "third", "m1", msg, sizeof msg),
                 KM_ERR_INVALID_ARGUMENT, "a second pool of model m1 was added");
    cr_assert(strstr(msg, "model m1 is served by pool main already"), "%s", msg);
    cr_assert_eq(pool_model_call(c, KM_ADMIN_UPDATE, "other", "m1", msg, sizeof msg),
                 KM_ERR_INVALID_ARGUMENT, "pool other took model m1");
    cr_assert(strstr(msg, "model m1 is served by pool main already"), "%s", msg);
    cr_assert_eq(pool_model_call(c, KM_ADMIN_UPDATE, "main", "m1", msg, sizeof msg), KM_OK,
                 "a pool's own model was refused: %s", msg);
    km_message reply;
    cr_assert_str_eq(listed_pool(c, &reply, "other")->model, "m2");
    km_message m = {.type = KM_MESSAGE_POOLS};
    m.pools.action = KM_ADMIN_LIST;
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.pools.n_pools, 2, "the refused pool was added");

    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"model\": \"m1\"}, "
                    "{\"name\": \"other\", \"block_size\": 4, \"model\": \"m1\"}]}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload refused, nothing changed: model m1 is listed for pools "
                                "main and other"), "%s", r.log);
    cr_assert_str_eq(listed_pool(c, &reply, "other")->model, "m2");

    /* Handed over within one file: main lets m1 go and other takes it. */
    reload_with(&r, "{\"pools\": [{\"name\": \"other\", \"block_size\": 4, \"model\": \"m1\"}, "
                    "{\"name\": \"main\", \"block_size\": 4, \"model\": \"m3\"}]}");
    cr_assert_eq(r.reload_status, KM_OK, "%s", r.log);
    cr_assert_str_eq(listed_pool(c, &reply, "other")->model, "m1");
    cr_assert_str_eq(listed_pool(c, &reply, "main")->model, "m3");

    /* A pool the file does not list keeps its model: no listed pool or new one may take it. */
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"model\": \"m1\"}, "
                    "{\"name\": \"fourth\", \"block_size\": 4, \"model\": \"m1\"}]}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload refused, nothing changed: model m1 is listed for pools "
                                "main and fourth"), "%s", r.log);
    reload_with(&r, "{\"pools\": [{\"name\": \"main\", \"block_size\": 4, \"model\": \"m1\"}]}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload: pool main refused: model m1 is served by pool other "
                                "already"), "%s", r.log);
    cr_assert_str_eq(listed_pool(c, &reply, "main")->model, "m3");
    reload_with(&r, "{\"pools\": [{\"name\": \"fifth\", \"block_size\": 4, \"model\": \"m1\"}]}");
    cr_assert_eq(r.reload_status, KM_ERR_INVALID_ARGUMENT, "%s", r.log);
    cr_assert(reload_logged(&r, "reload: pool fifth refused: model m1 is served by pool other "
                                "already"), "%s", r.log);
    cr_assert_eq(km_client_call(c, &m, 5000, &reply), KM_OK);
    cr_assert_eq(reply.pools.n_pools, 2, "the refused pool was added");
    reload_stop(&r, c);

    /* The start: two pools of one model. */
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = "/tmp/kvmatch-one-model-never-bound.sock";
    cfg.records_path = NULL;
    cfg.backend = KM_BACKEND_CPU;
    cfg.log = pools_quiet;
    km_server_pool pools[2];
    memset(pools, 0, sizeof pools);
    for (int i = 0; i < 2; i++) {
        pools[i].name = i ? "b" : "a";
        pools[i].model = "m";
        pools[i].block_size = 4;
        km_policy_config_init(&pools[i].policy);
    }
    cfg.pools = pools;
    cfg.n_pools = 2;
    km_server *server = NULL;
    char why[256] = "";
    cr_assert_eq(km_server_create(&cfg, &server, why, sizeof why), KM_ERR_INVALID_ARGUMENT,
                 "two pools of one model started");
    cr_assert_null(server);
    cr_assert(strstr(why, "pool b: model m is served by pool a already"), "%s", why);
}
