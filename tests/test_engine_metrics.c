/* Engine-reported load (include/kvmatch/engine_metrics.h): the metric text of vLLM and SGLang, in
 * their exact exposition format, parsed; and scraped from a fake /metrics endpoint (libmicrohttpd
 * on a loopback port) whose answers change: good text, an HTTP error, text without the metrics,
 * the other engine, no server at all. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kv_test_publisher.h"
#include "kvmatch/engine_metrics.h"
#include "kvmatch/kvmatch.h"
#include "nats_test_server.h"

/* vLLM 0.1x's /metrics (prometheus_client): two data-parallel engines, a histogram, a waiting
 * metric whose name starts like one read, and a label value holding '}' and an escaped quote. */
static const char VLLM_TEXT[] =
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 3.0\n"
    "vllm:num_requests_running{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 2.0\n"
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"odd}\\\"name\"} 7.0\n"
    "vllm:num_requests_waiting{engine=\"1\",model_name=\"odd}\\\"name\"} 1.0\n"
    "# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.\n"
    "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
    "vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 99.0\n"
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.42\n"
    "vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.61\n"
    "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
    "# TYPE vllm:time_to_first_token_seconds histogram\n"
    "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\"} 0.0\n"
    "vllm:time_to_first_token_seconds_sum{engine=\"0\"} 12.5\n";

/* SGLang's /metrics (its production_metrics reference). */
static const char SGLANG_TEXT[] =
    "# HELP sglang:num_running_reqs The number of running requests.\n"
    "# TYPE sglang:num_running_reqs gauge\n"
    "sglang:num_running_reqs{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 28.0\n"
    "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
    "# TYPE sglang:num_queue_reqs gauge\n"
    "sglang:num_queue_reqs{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 4.0\n"
    "# HELP sglang:token_usage The token usage\n"
    "# TYPE sglang:token_usage gauge\n"
    "sglang:token_usage{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.28\n"
    "# HELP sglang:cache_hit_rate The cache hit rate\n"
    "# TYPE sglang:cache_hit_rate gauge\n"
    "sglang:cache_hit_rate{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0075\n";

Test(engine_metrics, vllm_text_sums_ranks_and_takes_the_fullest_cache, .timeout = 30)
{
    km_engine_reported l;
    memset(&l, 0, sizeof l);
    char why[160];
    cr_assert_eq(km_engine_metrics_parse(VLLM_TEXT, strlen(VLLM_TEXT), &l, why, sizeof why), KM_OK,
                 "%s", why);
    cr_assert_str_eq(l.engine, "vllm");
    cr_assert_float_eq(l.running, 5.0, 1e-12);
    cr_assert_float_eq(l.waiting, 8.0, 1e-12, "waiting_by_reason is another metric");
    cr_assert_float_eq(l.kv_usage, 0.61, 1e-12);
}

Test(engine_metrics, sglang_text_and_text_without_the_metrics, .timeout = 30)
{
    km_engine_reported l;
    memset(&l, 0, sizeof l);
    char why[160];
    cr_assert_eq(km_engine_metrics_parse(SGLANG_TEXT, strlen(SGLANG_TEXT), &l, why, sizeof why),
                 KM_OK, "%s", why);
    cr_assert_str_eq(l.engine, "sglang");
    cr_assert_float_eq(l.running, 28.0, 1e-12);
    cr_assert_float_eq(l.waiting, 4.0, 1e-12);
    cr_assert_float_eq(l.kv_usage, 0.28, 1e-12);
    const char *bad[] = {"", "garbage\n", "# TYPE vllm:num_requests_running gauge\n",
                         "vllm:num_requests_running{engine=\"0\" 3.0\n",
                         "vllm:num_requests_running NaN\n", "vllm:num_requests_running -1\n",
                         /* each finite, their sum not: /status could not show it */
                         "vllm:num_requests_running{engine=\"0\"} 1.7e308\n"
                         "vllm:num_requests_running{engine=\"1\"} 1.7e308\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(km_engine_metrics_parse(bad[i], strlen(bad[i]), &l, why, sizeof why),
                     KM_ERR_PARSE, "case %zu accepted", i);
}

/* ---- a fake /metrics endpoint ---------------------------------------------------------------- */

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static const char *fake_body = VLLM_TEXT;
static unsigned fake_status = 200;

static enum MHD_Result fake_handler(void *cls, struct MHD_Connection *c, const char *url,
                                    const char *method, const char *version,
                                    const char *upload, size_t *upload_size, void **state)
{
    (void)cls, (void)url, (void)method, (void)version, (void)upload, (void)upload_size;
    (void)state;
    pthread_mutex_lock(&fake_lock);
    const char *b = fake_body;
    unsigned status = fake_status;
    pthread_mutex_unlock(&fake_lock);
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(b), (void *)b, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static void serve(const char *body, unsigned status)
{
    pthread_mutex_lock(&fake_lock);
    fake_body = body;
    fake_status = status;
    pthread_mutex_unlock(&fake_lock);
}

static km_engine_reported get(km_engine_metrics *m, uint32_t w)
{
    km_engine_reported l;
    cr_assert_eq(km_engine_metrics_get(m, w, &l), KM_OK);
    return l;
}

#define WAIT_UNTIL(cond, ms)                                           \
    do {                                                               \
        for (int waited_ = 0; !(cond) && waited_ < (ms); waited_ += 5) \
            km_test_sleep_ms(5);                                       \
    } while (0)

/* A scraper of max_workers targets, every interval_ms, each scrape at most timeout_ms. */
static km_engine_metrics *scraper(uint32_t max_workers, uint32_t interval_ms, uint32_t timeout_ms)
{
    km_engine_metrics_config cfg;
    km_engine_metrics_config_init(&cfg);
    cfg.max_workers = max_workers;
    cfg.interval_ms = interval_ms;
    cfg.timeout_ms = timeout_ms;
    km_engine_metrics *m = NULL;
    char why[160];
    cr_assert_eq(km_engine_metrics_create(&cfg, &m, why, sizeof why), KM_OK, "%s", why);
    return m;
}

Test(engine_metrics, scraped_from_a_fake_endpoint_failures_keep_the_last_values, .timeout = 30)
{
    uint16_t port = km_test_free_port();
    struct MHD_Daemon *d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, port, NULL, NULL,
                                            fake_handler, NULL, MHD_OPTION_END);
    cr_assert_not_null(d, "fake endpoint on 127.0.0.1:%u", port);
    km_engine_metrics *m = scraper(4, 20, 500);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/metrics", port);
    cr_assert_eq(km_engine_metrics_set_target(m, 2, url), KM_OK);
    cr_assert_eq(km_engine_metrics_set_target(m, 3, "http://127.0.0.1:1/metrics"), KM_OK);
    cr_assert_eq(km_engine_metrics_set_target(m, 1, "ftp://x/"), KM_ERR_INVALID_ARGUMENT);
    km_engine_reported l;
    cr_assert_eq(km_engine_metrics_get(m, 0, &l), KM_ERR_NOT_FOUND);

    WAIT_UNTIL(get(m, 2).has_values, 5000);
    l = get(m, 2);
    cr_assert(l.has_values);
    cr_assert_str_eq(l.engine, "vllm");
    cr_assert_float_eq(l.running, 5.0, 1e-12);
    cr_assert_float_eq(l.kv_usage, 0.61, 1e-12);
    cr_assert_gt(l.scraped_ns, 0);

    serve(VLLM_TEXT, 503); /* the engine is unhappy: the last values stay, the failure shows */
    uint64_t failures = l.failures;
    WAIT_UNTIL(get(m, 2).failures > failures, 5000);
    l = get(m, 2);
    cr_assert_gt(l.failures, failures);
    cr_assert(strstr(l.last_error, "503"), "%s", l.last_error);
    cr_assert_float_eq(l.running, 5.0, 1e-12);

    serve("# nothing we read\nprocess_cpu_seconds_total 1.0\n", 200);
    failures = get(m, 2).failures;
    WAIT_UNTIL(get(m, 2).failures > failures, 5000);
    cr_assert(strstr(get(m, 2).last_error, "none of"), "%s", get(m, 2).last_error);

    serve(SGLANG_TEXT, 200);
    WAIT_UNTIL(!strcmp(get(m, 2).engine, "sglang"), 5000);
    l = get(m, 2);
    cr_assert_str_eq(l.engine, "sglang");
    cr_assert_float_eq(l.running, 28.0, 1e-12);
    cr_assert_float_eq(l.waiting, 4.0, 1e-12);

    WAIT_UNTIL(get(m, 3).failures > 0, 5000);
    l = get(m, 3);
    cr_assert(!l.has_values, "nothing listens there");
    cr_assert_neq(l.last_error[0], '\0');

    cr_assert_eq(km_engine_metrics_set_target(m, 2, NULL), KM_OK);
    cr_assert_eq(km_engine_metrics_get(m, 2, &l), KM_ERR_NOT_FOUND);
    km_engine_metrics_destroy(m);
    MHD_stop_daemon(d);
    serve(VLLM_TEXT, 200);
}

/* Engines that accept a connection and never answer cost the others nothing: every target is
 * scraped on its own schedule, the hanging ones' scrapes in flight beside the healthy one's. With
 * eight such engines at a 400 ms timeout, scraping one target after another would scrape the
 * healthy engine at most once every 3.2 s; here it is scraped every interval. */
Test(engine_metrics, engines_that_never_answer_do_not_hold_back_the_others, .timeout = 30)
{
    uint16_t port = km_test_free_port();
    struct MHD_Daemon *d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, port, NULL, NULL,
                                            fake_handler, NULL, MHD_OPTION_END);
    cr_assert_not_null(d, "fake endpoint on 127.0.0.1:%u", port);
    int hang = socket(AF_INET, SOCK_STREAM, 0); /* listens, never accepts: connects, no answer */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    cr_assert(hang >= 0 && bind(hang, (struct sockaddr *)&a, sizeof a) == 0 &&
              listen(hang, 64) == 0 && getsockname(hang, (struct sockaddr *)&a, &alen) == 0);
    km_engine_metrics *m = scraper(16, 50, 400);
    char url[64];
    for (uint32_t w = 1; w <= 8; w++) {
        snprintf(url, sizeof url, "http://127.0.0.1:%u/metrics", ntohs(a.sin_port));
        cr_assert_eq(km_engine_metrics_set_target(m, w, url), KM_OK);
    }
    snprintf(url, sizeof url, "http://127.0.0.1:%u/metrics", port);
    cr_assert_eq(km_engine_metrics_set_target(m, 0, url), KM_OK);
    WAIT_UNTIL(get(m, 0).has_values, 5000);
    cr_assert(get(m, 0).has_values);
    uint64_t before = get(m, 0).scrapes;
    km_test_sleep_ms(2000);
    uint64_t scraped = get(m, 0).scrapes - before;
    cr_assert_geq(scraped, 5, "the healthy engine was scraped %llu times in 2 s beside eight "
                  "that never answer", (unsigned long long)scraped);
    for (uint32_t w = 1; w <= 8; w++) {
        km_engine_reported l = get(m, w);
        cr_assert(!l.has_values && l.failures >= 1, "worker %u: %llu failures", w,
                  (unsigned long long)l.failures);
        cr_assert(strstr(l.last_error, "imeout") || strstr(l.last_error, "imed out"), "%s",
                  l.last_error);
    }
    km_engine_metrics_destroy(m);
    close(hang);
    MHD_stop_daemon(d);
}

/* ---- in kvmatch serve: /status shows what each worker's engine reports ----------------------- */

static void *serve_thread(void *arg)
{
    km_server_run(arg, false);
    return NULL;
}

static int http_get(uint16_t port, const char *path, char *body, size_t body_size)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[128];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                     path);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    static char resp[1 << 16];
    size_t got = 0;
    ssize_t k;
    while (got < sizeof resp - 1 && (k = read(fd, resp + got, sizeof resp - 1 - got)) > 0)
        got += (size_t)k;
    resp[got] = '\0';
    close(fd);
    int status = 0;
    sscanf(resp, "HTTP/1.%*d %d", &status);
    const char *b = strstr(resp, "\r\n\r\n");
    snprintf(body, body_size, "%s", b ? b + 4 : "");
    return status;
}

static double reported_running(uint16_t http_port, uint32_t worker)
{
    static char body[1 << 16];
    cr_assert_eq(http_get(http_port, "/status", body, sizeof body), 200);
    json_t *st = json_loads(body, 0, NULL);
    cr_assert_not_null(st);
    size_t i;
    json_t *w;
    double running = -1;
    json_array_foreach(json_object_get(st, "workers"), i, w)
    {
        if (json_integer_value(json_object_get(w, "id")) != worker)
            continue;
        json_t *er = json_object_get(w, "engine_reported");
        running = json_is_object(er) && json_is_number(json_object_get(er, "running"))
                      ? json_number_value(json_object_get(er, "running"))
                      : json_is_null(er) ? -2 : -1;
    }
    json_decref(st);
    return running;
}

Test(engine_metrics, serve_shows_each_workers_engine_reported_load, .timeout = 30)
{
    serve(SGLANG_TEXT, 200);
    uint16_t port = km_test_free_port();
    struct MHD_Daemon *d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, port, NULL, NULL,
                                            fake_handler, NULL, MHD_OPTION_END);
    cr_assert_not_null(d);
    char dir[] = "/tmp/kvmatch-engine-XXXXXX", sock[96], url[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(sock, sizeof sock, "%s/s.sock", dir);
    snprintf(url, sizeof url, "http://127.0.0.1:%u/metrics", port);
    km_server_worker workers[2] = {{.id = 0, .metrics_url = url}, {.id = 1}};
    km_server_pool pool = {.name = "main", .block_size = 4, .workers = workers, .n_workers = 2};
    km_policy_config_init(&pool.policy);
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = sock;
    cfg.records_path = NULL;
    cfg.http = "127.0.0.1:0";
    cfg.max_workers = 8;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.engine_metrics_interval_ms = 20;
    cfg.pools = &pool;
    cfg.n_pools = 1;
    km_server *s = NULL;
    char why[256];
    cr_assert_eq(km_server_create(&cfg, &s, why, sizeof why), KM_OK, "%s", why);
    pthread_t t;
    pthread_create(&t, NULL, serve_thread, s);
    uint16_t http_port = km_server_http_port(s);
    WAIT_UNTIL(reported_running(http_port, 0) == 28.0, 5000);
    cr_assert_float_eq(reported_running(http_port, 0), 28.0, 1e-9);
    cr_assert_eq(reported_running(http_port, 1), -2, "worker 1 has no metrics URL: null");
    km_server_stop(s);
    pthread_join(t, NULL);
    km_server_destroy(s);
    MHD_stop_daemon(d);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    serve(VLLM_TEXT, 200);
}

/* ---- in kvmatch serve: decisions weigh what the engines report, and say so ------------------- */

/* vLLM answering many more requests than kvmatch routed to it (traffic that bypassed kvmatch). */
static const char BUSY_TEXT[] =
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 40.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.9\n";
static const char IDLE_TEXT[] =
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.05\n";

/* An engine with nothing running or waiting but its KV cache nearly full. */
static const char FULL_TEXT[] =
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.95\n";

static unsigned engines_status = 200; /* under fake_lock */

/* /busy, /full and /idle: one engine each; all answer engines_status (the body only with 200). */
static enum MHD_Result engines_handler(void *cls, struct MHD_Connection *c, const char *url,
                                       const char *method, const char *version,
                                       const char *upload, size_t *upload_size, void **state)
{
    (void)cls, (void)method, (void)version, (void)upload, (void)upload_size, (void)state;
    pthread_mutex_lock(&fake_lock);
    unsigned status = engines_status;
    pthread_mutex_unlock(&fake_lock);
    const char *b = status != 200            ? "unavailable\n"
                    : !strcmp(url, "/busy") ? BUSY_TEXT
                    : !strcmp(url, "/full") ? FULL_TEXT
                                            : IDLE_TEXT;
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(b), (void *)b, MHD_RESPMEM_MUST_COPY);
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static json_t *status_json(uint16_t http_port)
{
    static char body[1 << 16];
    cr_assert_eq(http_get(http_port, "/status", body, sizeof body), 200);
    json_t *st = json_loads(body, 0, NULL);
    cr_assert_not_null(st);
    return st;
}

/* How many workers /status says decisions use the engine's values of. */
static int fresh_workers(uint16_t http_port)
{
    json_t *st = status_json(http_port), *w;
    size_t i;
    int fresh = 0;
    json_array_foreach(json_object_get(st, "workers"), i, w)
    {
        json_t *er = json_object_get(w, "engine_reported");
        fresh += json_is_true(json_object_get(er, "used_by_decisions"));
    }
    json_decref(st);
    return fresh;
}

static const char *status_load_scope(uint16_t http_port, char *out, size_t size)
{
    json_t *st = status_json(http_port);
    snprintf(out, size, "%s", json_string_value(json_object_get(st, "load_scope")));
    json_decref(st);
    return out;
}

/* The value of /metrics sample `series` (name and labels, as written); NAN when absent. */
static double metrics_sample(uint16_t http_port, const char *series)
{
    static char body[1 << 17];
    cr_assert_eq(http_get(http_port, "/metrics", body, sizeof body), 200);
    char *at = strstr(body, series);
    return at ? strtod(at + strlen(series), NULL) : NAN;
}

/* Route request `id` among `candidates` (two worker ids) with `policy` (NULL: the pool's). */
static const km_route_decision *route_one(km_client *c, const char *id, const uint32_t *candidates,
                                          const char *policy, km_message *reply)
{
    static uint32_t tokens[8];
    for (uint32_t i = 0; i < 8; i++)
        tokens[i] = 900 + i;
    km_route_request r;
    memset(&r, 0, sizeof r);
    r.request_id = id;
    r.pool = "main";
    r.input = KM_ROUTE_INPUT_TOKENS;
    r.tokens = tokens;
    r.n_tokens = 8;
    r.candidates = candidates;
    r.n_candidates = 2;
    r.policy = policy;
    cr_assert_eq(km_client_route(c, &r, 1, 5000, reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply->decision.n_decisions, 1);
    const km_route_decision *d = &reply->decision.decisions[0];
    cr_assert_eq(d->status, KM_OK, "%s", d->message ? d->message : "");
    return d;
}

static double row_cost(const km_route_decision *d, uint32_t worker)
{
    for (uint32_t i = 0; i < d->n_candidates; i++)
        if (d->candidates[i].worker == worker)
            return d->candidates[i].cost;
    cr_assert_fail("worker %u not among the candidates", worker);
    return 0;
}

static uint32_t row_in_flight(const km_route_decision *d, uint32_t worker)
{
    for (uint32_t i = 0; i < d->n_candidates; i++)
        if (d->candidates[i].worker == worker)
            return d->candidates[i].load.in_flight;
    cr_assert_fail("worker %u not among the candidates", worker);
    return 0;
}

/* The decision record of request `id`, waited for (the writer is asynchronous); a new reference. */
static json_t *decision_record(const char *path, const char *id)
{
    for (int t = 0; t < 300; t++) {
        FILE *f = fopen(path, "r");
        char *line = NULL;
        size_t cap = 0;
        json_t *found = NULL;
        while (f && !found && getline(&line, &cap, f) > 0) {
            json_t *o = json_loads(line, 0, NULL);
            if (o && !strcmp(json_string_value(json_object_get(o, "type")) ?: "", "decision") &&
                !strcmp(json_string_value(json_object_get(o, "request_id")) ?: "", id))
                found = o;
            else
                json_decref(o);
        }
        free(line);
        if (f)
            fclose(f);
        if (found)
            return found;
        km_test_sleep_ms(10);
    }
    cr_assert_fail("no decision record of %s in %s", id, path);
    return NULL;
}

/* The scraper thread stores a scrape's time at any moment, so a reader that took `now` first can
 * find a scrape newer than it: its age is 0 (fresh), never missing nor a wrapped-around one. */
Test(engine_metrics, a_scrape_newer_than_the_readers_now_is_zero_seconds_old, .timeout = 10)
{
    km_engine_reported e;
    memset(&e, 0, sizeof e);
    cr_assert_eq(km_engine_reported_age_ns(&e, 1000), UINT64_MAX, "no scrape yet");
    cr_assert_eq(km_engine_reported_age_ns(NULL, 1000), UINT64_MAX);
    e.has_values = true;
    e.scraped_ns = 400;
    cr_assert_eq(km_engine_reported_age_ns(&e, 1000), 600);
    cr_assert_eq(km_engine_reported_age_ns(&e, 400), 0);
    cr_assert_eq(km_engine_reported_age_ns(&e, 399), 0, "a scrape after the reader's now");
    cr_assert_eq(km_engine_reported_age_ns(&e, 0), 0);
}

Test(engine_metrics, decisions_weigh_fresh_engine_load_and_state_the_scope, .timeout = 30)
{
    engines_status = 200;
    uint16_t port = km_test_free_port();
    struct MHD_Daemon *d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, port, NULL, NULL,
                                            engines_handler, NULL, MHD_OPTION_END);
    cr_assert_not_null(d);
    char dir[] = "/tmp/kvmatch-engine-XXXXXX", sock[96], addr[104], records[96], busy[64],
         full[64], idle[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(sock, sizeof sock, "%s/s.sock", dir);
    snprintf(addr, sizeof addr, "unix:%s", sock);
    snprintf(records, sizeof records, "%s/records.jsonl", dir);
    snprintf(busy, sizeof busy, "http://127.0.0.1:%u/busy", port);
    snprintf(full, sizeof full, "http://127.0.0.1:%u/full", port);
    snprintf(idle, sizeof idle, "http://127.0.0.1:%u/idle", port);
    km_server_worker workers[3] = {{.id = 0, .name = "busy", .metrics_url = busy},
                                   {.id = 1, .name = "full", .metrics_url = full},
                                   {.id = 2, .name = "idle", .metrics_url = idle}};
    km_server_pool pool = {.name = "main", .block_size = 4, .workers = workers, .n_workers = 3};
    km_policy_config_init(&pool.policy);
    pool.policy.kind = KM_POLICY_LEAST_LOAD; /* ties go to the lower worker id, as llmd's do */
    const uint32_t busy_or_idle[2] = {0, 2}, full_or_idle[2] = {1, 2};
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = sock;
    cfg.records_path = records;
    cfg.http = "127.0.0.1:0";
    cfg.max_workers = 8;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.max_queue_wait_ms = 0;
    cfg.engine_metrics_interval_ms = 20;
    cfg.engine_metrics_max_age_ms = 1000; /* 50 intervals: a late scrape stays fresh */
    cfg.pools = &pool;
    cfg.n_pools = 1;
    km_server *s = NULL;
    char why[256], scope[64];
    cr_assert_eq(km_server_create(&cfg, &s, why, sizeof why), KM_OK, "%s", why);
    pthread_t t;
    pthread_create(&t, NULL, serve_thread, s);
    uint16_t http_port = km_server_http_port(s);
    km_client *c = NULL;
    cr_assert_eq(km_client_connect(addr, 3000, &c, why, sizeof why), KM_OK, "%s", why);
    WAIT_UNTIL(fresh_workers(http_port) == 3, 5000);
    cr_assert_eq(fresh_workers(http_port), 3);
    cr_assert_str_eq(status_load_scope(http_port, scope, sizeof scope),
                     "this_instance+engine_reported");

    /* llmd, kvmatch having routed nothing: its scores tie and the tie goes to worker 1, whose
     * engine reports its KV cache 95% used: its KV-usage term loses it the decision. */
    km_message reply;
    const km_route_decision *r = route_one(c, "k1", full_or_idle, "llmd", &reply);
    cr_assert_eq(r->chosen_worker, 2, "the full cache loses");
    /* Scores: prefix 0 (no holder), queue 1 (equal), 1 - KV usage. The pool hashes 4-token blocks,
     * the engine model counts 16-token ones: the usage is the engine's own either way. */
    cr_assert_float_eq(row_cost(r, 1), 1.0 + (1.0 - 0.95), 1e-3);
    cr_assert_float_eq(row_cost(r, 2), 1.0 + (1.0 - 0.05), 1e-3);
    cr_assert_str_eq(r->load_scope, "this_instance+engine_reported");
    /* least_load: on kvmatch's own view worker 0 (nothing routed there) beats worker 2 (k1);
     * worker 0's engine reports 2 running and 40 waiting. Worker 2's engine reports 0 while k1 is
     * in flight there: kvmatch's fresher view is not lowered. */
    r = route_one(c, "r1", busy_or_idle, NULL, &reply);
    cr_assert_eq(r->chosen_worker, 2, "the busy engine loses");
    cr_assert_eq(row_in_flight(r, 0), 42);
    cr_assert_eq(row_in_flight(r, 2), 1);
    cr_assert_str_eq(r->load_scope, "this_instance+engine_reported");
    cr_assert_eq(r->load_instances, 0);
    cr_assert(r->load_oldest_age_ms >= 0 && r->load_oldest_age_ms < 1000, "age %f",
              r->load_oldest_age_ms);
    r = route_one(c, "r2", busy_or_idle, NULL, &reply);
    cr_assert_eq(row_in_flight(r, 2), 2);
    cr_assert_eq(r->chosen_worker, 2);
    /* ttft: the 40 requests worker 0's engine has waiting, none of them kvmatch's, are taken to
     * be like this route (8 tokens each): a queue of 320 tokens there, not an idle worker. */
    r = route_one(c, "t1", busy_or_idle, "ttft", &reply);
    const km_candidate_score *busy_row = NULL;
    for (uint32_t i = 0; i < r->n_candidates; i++)
        if (r->candidates[i].worker == 0)
            busy_row = &r->candidates[i];
    cr_assert_not_null(busy_row);
    cr_assert_eq(busy_row->load.pending_prefill_tokens, 40 * 8,
                 "the engine's waiting requests charged %llu tokens",
                 (unsigned long long)busy_row->load.pending_prefill_tokens);
    cr_assert_eq(r->chosen_worker, 2, "the engine's queue made worker 0 look cheaper");

    json_t *rec = decision_record(records, "r2");
    json_t *load = json_object_get(json_object_get(rec, "decision"), "load");
    cr_assert_str_eq(json_string_value(json_object_get(load, "scope")),
                     "this_instance+engine_reported");
    cr_assert(json_is_number(json_object_get(load, "oldest_age_ms")));
    json_decref(rec);

    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_running{worker=\"0\","
                                                 "name=\"busy\",pool=\"main\"} "), 2.0, 1e-9);
    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_waiting{worker=\"0\","
                                                 "name=\"busy\",pool=\"main\"} "), 40.0, 1e-9);
    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_kv_usage{worker=\"1\","
                                                 "name=\"full\",pool=\"main\"} "), 0.95, 1e-9);
    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_fresh{worker=\"0\","
                                                 "name=\"busy\",pool=\"main\"} "), 1.0, 1e-9);
    double age = metrics_sample(http_port, "kvmatch_worker_engine_scrape_age_seconds{worker=\"0\","
                                           "name=\"busy\",pool=\"main\"} ");
    cr_assert(age >= 0 && age < 1.0, "age %f", age);

    /* The engines stop answering: their last values stay (/status, /metrics) but grow stale, and
     * decisions return to kvmatch's own view. */
    pthread_mutex_lock(&fake_lock);
    engines_status = 503;
    pthread_mutex_unlock(&fake_lock);
    WAIT_UNTIL(fresh_workers(http_port) == 0, 5000);
    cr_assert_eq(fresh_workers(http_port), 0);
    cr_assert_str_eq(status_load_scope(http_port, scope, sizeof scope), "this_instance");
    r = route_one(c, "r3", busy_or_idle, NULL, &reply);
    cr_assert_eq(r->chosen_worker, 0, "worker 0 is idle on kvmatch's view (worker 2 holds 4)");
    cr_assert_eq(row_in_flight(r, 0), 0);
    cr_assert_str_eq(r->load_scope, "this_instance");
    rec = decision_record(records, "r3");
    load = json_object_get(json_object_get(rec, "decision"), "load");
    cr_assert_str_eq(json_string_value(json_object_get(load, "scope")), "this_instance");
    cr_assert_null(json_object_get(load, "oldest_age_ms"));
    json_decref(rec);
    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_fresh{worker=\"0\","
                                                 "name=\"busy\",pool=\"main\"} "), 0.0, 1e-9);
    cr_assert_float_eq(metrics_sample(http_port, "kvmatch_worker_engine_waiting{worker=\"0\","
                                                 "name=\"busy\",pool=\"main\"} "), 40.0, 1e-9,
                       "the last good values are kept");
    cr_assert_gt(metrics_sample(http_port, "kvmatch_worker_engine_scrape_failures_total{worker="
                                           "\"0\",name=\"busy\",pool=\"main\"} "), 0.0);

    km_client_close(c);
    km_server_stop(s);
    pthread_join(t, NULL);
    km_server_destroy(s);
    MHD_stop_daemon(d);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
