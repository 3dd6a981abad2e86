/* The engine-metrics scraper (include/kvmatch/engine_metrics.h): one thread that keeps every due
 * target's scrape in flight at once in a libcurl multi handle, each target on its own schedule
 * (so a target that hangs costs the others nothing), one easy handle per target kept
 * across scrapes (its connection is reused), the body read within KM_ENGINE_METRICS_BODY_MAX,
 * and the Prometheus text exposition format read line by line for the six metric names it needs
 * (comments skipped, label values' quotes and escapes honoured, the value read with strtod). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>

#include "base/error_detail.h"
#include "kvmatch/engine_metrics.h"

#define NS_PER_MS UINT64_C(1000000)

typedef struct target {
    char *url;           /* NULL: no target */
    km_engine_reported load; /* under the lock */
    uint64_t due_ns;
} target;

typedef struct scrape_slot scrape_slot;

struct km_engine_metrics {
    km_engine_metrics_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    target *targets;
    pthread_t thread;
    bool started;
    /* The scraper thread's own (created before it starts, freed after it ends): */
    CURLM *multi;        /* curl_multi_wakeup (destroy, set_target) ends its wait */
    CURL **easy;         /* max_workers: a target's handle, NULL until its first scrape */
    scrape_slot *slots;  /* max_workers: a target's scrape in progress */
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

void km_engine_metrics_config_init(km_engine_metrics_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_workers = 1024;
    cfg->interval_ms = 1000;
    cfg->timeout_ms = 500;
}

/* ---- parsing -------------------------------------------------------------------------------- */

enum { RUNNING, WAITING, KV_USAGE };

static const struct {
    const char *name;
    const char *engine;
    int what;
} KNOWN[] = {
    {"vllm:num_requests_running", "vllm", RUNNING},
    {"vllm:num_requests_waiting", "vllm", WAITING},
    {"vllm:kv_cache_usage_perc", "vllm", KV_USAGE},
    {"vllm:gpu_cache_usage_perc", "vllm", KV_USAGE},
    {"sglang:num_running_reqs", "sglang", RUNNING},
    {"sglang:num_queue_reqs", "sglang", WAITING},
    {"sglang:token_usage", "sglang", KV_USAGE},
};

/* The end of a label set that starts at p ('{'), or NULL when it does not close on this line. */
static const char *skip_labels(const char *p, const char *end)
{
    bool quoted = false;
    for (p++; p < end && *p != '\n'; p++) {
        if (quoted && *p == '\\' && p + 1 < end)
            p++;
        else if (*p == '"')
            quoted = !quoted;
        else if (!quoted && *p == '}')
            return p + 1;
    }
    return NULL;
}

uint64_t km_engine_reported_age_ns(const km_engine_reported *reported, uint64_t now_ns)
{
    if (!reported || !reported->has_values)
        return UINT64_MAX;
    return reported->scraped_ns <= now_ns ? now_ns - reported->scraped_ns : 0;
}

int km_engine_metrics_parse(const char *text, size_t len, km_engine_reported *out, char *why,
                            size_t why_size)
{
    if (!text || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "text or out is NULL");
    double v[3] = {NAN, NAN, NAN};
    const char *engine = NULL;
    const char *p = text, *end = text + len;
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol)
            eol = end;
        const char *q = p;
        while (q < eol && (*q == ' ' || *q == '\t'))
            q++;
        if (q < eol && *q != '#') {
            const char *name = q;
            while (q < eol && *q != '{' && *q != ' ' && *q != '\t')
                q++;
            size_t name_len = (size_t)(q - name);
            int known = -1;
            for (size_t k = 0; k < sizeof KNOWN / sizeof KNOWN[0] && known < 0; k++)
                if (strlen(KNOWN[k].name) == name_len && !memcmp(KNOWN[k].name, name, name_len))
                    known = (int)k;
            if (known >= 0 && q < eol && *q == '{')
                q = skip_labels(q, eol);
            if (known >= 0 && q) {
                char num[64];
                while (q < eol && (*q == ' ' || *q == '\t'))
                    q++;
                size_t n = 0;
                while (q + n < eol && q[n] != ' ' && q[n] != '\t' && q[n] != '\r' && n < sizeof num - 1)
                    n++;
                memcpy(num, q, n);
                num[n] = '\0';
                char *stop = NULL;
                errno = 0;
                double x = strtod(num, &stop);
                if (n && stop && !*stop && errno == 0 && isfinite(x) && x >= 0) {
                    int what = KNOWN[known].what;
                    if (isnan(v[what]))
                        v[what] = x;
                    else if (what == KV_USAGE)
                        v[what] = x > v[what] ? x : v[what];
                    else
                        v[what] += x;
                    if (!isfinite(v[what])) /* series whose sum no double holds: not a load */
                        return km_why(why, why_size, KM_ERR_PARSE,
                                      "%.*s summed over its series is not finite",
                                      (int)name_len, name);
                    engine = KNOWN[known].engine;
                }
            }
        }
        p = eol + 1;
    }
    if (!engine)
        return km_why(why, why_size, KM_ERR_PARSE,
                      "none of vLLM's or SGLang's load metrics in %zu bytes", len);
    out->engine = engine;
    out->running = v[RUNNING];
    out->waiting = v[WAITING];
    out->kv_usage = v[KV_USAGE];
    return KM_OK;
}

/* ---- scraping ------------------------------------------------------------------------------- */

typedef struct body {
    char *data;
    size_t len, cap;
    bool too_large;
} body;

static size_t on_body(char *ptr, size_t size, size_t nmemb, void *user)
{
    body *b = user;
    size_t n = size * nmemb;
    if (b->len + n > KM_ENGINE_METRICS_BODY_MAX) {
        b->too_large = true;
        return 0; /* libcurl fails the transfer */
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, ptr, n);
    b->len += n;
    b->data[b->len] = '\0';
    return n;
}

/* A target's scrape in progress. */
struct scrape_slot {
    char *url; /* copied under the lock when the scrape began */
    body b;
    char err[CURL_ERROR_SIZE];
    CURLcode rc;
    bool in_flight; /* in the multi handle */
    bool done;      /* finished, rc set, not yet applied */
};

/* Start worker w's scrape of url (taken over); false (url freed) when libcurl refused it. */
static bool scrape_start(km_engine_metrics *m, uint32_t w, char *url)
{
    scrape_slot *sl = &m->slots[w];
    memset(sl, 0, sizeof *sl);
    sl->url = url;
    CURL **easy = &m->easy[w];
    if (!*easy && !(*easy = curl_easy_init())) {
        free(url);
        sl->url = NULL;
        return false;
    }
    CURL *curl = *easy;
    curl_easy_setopt(curl, CURLOPT_URL, sl->url);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &sl->b);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, (long)m->cfg.timeout_ms);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, (long)m->cfg.timeout_ms);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, sl->err);
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(curl, CURLOPT_PRIVATE, (char *)sl);
    if (curl_multi_add_handle(m->multi, curl) != CURLM_OK) {
        free(url);
        sl->url = NULL;
        return false;
    }
    sl->in_flight = true;
    return true;
}

/* A finished scrape's result: *got and true, or why it failed. */
static bool scrape_result(km_engine_metrics *m, uint32_t w, km_engine_reported *got, char *why,
                          size_t why_size)
{
    scrape_slot *sl = &m->slots[w];
    long status = 0;
    if (sl->rc == CURLE_OK)
        curl_easy_getinfo(m->easy[w], CURLINFO_RESPONSE_CODE, &status);
    if (sl->b.too_large)
        snprintf(why, why_size, "body over %u bytes", KM_ENGINE_METRICS_BODY_MAX);
    else if (sl->rc != CURLE_OK)
        snprintf(why, why_size, "%.150s", sl->err[0] ? sl->err : curl_easy_strerror(sl->rc));
    else if (status != 200)
        snprintf(why, why_size, "HTTP status %ld", status);
    else
        return km_engine_metrics_parse(sl->b.data ? sl->b.data : "", sl->b.len, got, why,
                                       why_size) == KM_OK;
    return false;
}

/* Apply worker w's finished scrape to its target (under the lock) and free the slot. */
static void scrape_apply(km_engine_metrics *m, uint32_t w)
{
    scrape_slot *sl = &m->slots[w];
    target *t = &m->targets[w];
    km_engine_reported got = {0};
    char why[160] = "";
    bool ok = scrape_result(m, w, &got, why, sizeof why);
    /* the target may have changed meanwhile: apply only to the same URL */
    if (t->url && !strcmp(t->url, sl->url)) {
        t->load.scrapes++;
        if (ok) {
            t->load.has_values = true;
            t->load.engine = got.engine;
            t->load.running = got.running;
            t->load.waiting = got.waiting;
            t->load.kv_usage = got.kv_usage;
            t->load.scraped_ns = mono_ns();
        } else {
            t->load.failures++;
            snprintf(t->load.last_error, sizeof t->load.last_error, "%s", why);
            if (m->cfg.log && (t->load.failures == 1 || t->load.failures % 100 == 0)) {
                char line[320];
                snprintf(line, sizeof line, "engine metrics: worker %u (%.100s): %s "
                         "(%llu failures)", w, sl->url, why, (unsigned long long)t->load.failures);
                m->cfg.log(m->cfg.log_user, line);
            }
        }
        t->due_ns = mono_ns() + (uint64_t)m->cfg.interval_ms * NS_PER_MS;
    }
    free(sl->url);
    free(sl->b.data);
    memset(sl, 0, sizeof *sl);
}

/* Each target is scraped on its own schedule, every scrape in flight at once in the multi handle:
 * a target that hangs holds up only its own next scrape, by at most timeout_ms. */
static void *scraper_main(void *arg)
{
    km_engine_metrics *m = arg;
    uint32_t in_flight = 0;
    pthread_mutex_lock(&m->lock);
    while (!m->stop) {
        /* Apply what finished, then start what is due. */
        uint64_t now = mono_ns(), next = now + (uint64_t)m->cfg.interval_ms * NS_PER_MS;
        for (uint32_t w = 0; w < m->cfg.max_workers; w++) {
            scrape_slot *sl = &m->slots[w];
            if (sl->done) {
                curl_multi_remove_handle(m->multi, m->easy[w]);
                scrape_apply(m, w);
                in_flight--;
            }
            target *t = &m->targets[w];
            if (!t->url || sl->in_flight)
                continue;
            if (t->due_ns > now) {
                next = t->due_ns < next ? t->due_ns : next;
                continue;
            }
            char *url = strdup(t->url);
            if (url && scrape_start(m, w, url)) {
                in_flight++;
            } else { /* out of memory: try again at the next interval */
                t->due_ns = now + (uint64_t)m->cfg.interval_ms * NS_PER_MS;
                next = t->due_ns < next ? t->due_ns : next;
            }
        }
        if (!in_flight) {
            struct timespec ts = {(time_t)(next / UINT64_C(1000000000)),
                                  (long)(next % UINT64_C(1000000000))};
            pthread_cond_timedwait(&m->cond, &m->lock, &ts);
            continue;
        }
        pthread_mutex_unlock(&m->lock);
        int running = 0;
        curl_multi_perform(m->multi, &running);
        int left;
        CURLMsg *msg;
        while ((msg = curl_multi_info_read(m->multi, &left)))
            if (msg->msg == CURLMSG_DONE) {
                char *priv = NULL;
                curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &priv);
                scrape_slot *sl = (scrape_slot *)(void *)priv;
                sl->rc = msg->data.result;
                sl->done = true;
                running = -1; /* apply at once */
            }
        if (running >= 0) {
            uint64_t after = mono_ns();
            uint64_t wait_ms = next > after ? (next - after) / NS_PER_MS + 1 : 0;
            curl_multi_poll(m->multi, NULL, 0, wait_ms < 1000 ? (int)wait_ms : 1000, NULL);
        }
        pthread_mutex_lock(&m->lock);
    }
    pthread_mutex_unlock(&m->lock);
    for (uint32_t w = 0; w < m->cfg.max_workers; w++) /* stopping: drop what is in flight */
        if (m->slots[w].in_flight) {
            curl_multi_remove_handle(m->multi, m->easy[w]);
            free(m->slots[w].url);
            free(m->slots[w].b.data);
            memset(&m->slots[w], 0, sizeof m->slots[w]);
        }
    return NULL;
}

/* ---- the handle ----------------------------------------------------------------------------- */

/* libcurl's global state, once per process, before the first scraper thread uses it. */
static void init_curl(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

int km_engine_metrics_create(const km_engine_metrics_config *cfg, km_engine_metrics **out,
                             char *why, size_t why_size)
{
    if (!out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "out is NULL");
    *out = NULL;
    km_engine_metrics_config defaults;
    if (!cfg) {
        km_engine_metrics_config_init(&defaults);
        cfg = &defaults;
    }
    if (cfg->max_workers < 1 || cfg->max_workers > 65534 || cfg->interval_ms < 10 ||
        cfg->timeout_ms < 1)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "engine metrics: max_workers 1..65534, interval_ms >= 10, timeout_ms >= 1");
    static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
    pthread_once(&curl_once, init_curl);
    km_engine_metrics *m = calloc(1, sizeof *m);
    if (!m || !(m->targets = calloc(cfg->max_workers, sizeof *m->targets)) ||
        !(m->easy = calloc(cfg->max_workers, sizeof *m->easy)) ||
        !(m->slots = calloc(cfg->max_workers, sizeof *m->slots)) ||
        !(m->multi = curl_multi_init())) {
        if (m) {
            free(m->targets);
            free(m->easy);
            free(m->slots);
        }
        free(m);
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "engine metrics");
    }
    m->cfg = *cfg;
    pthread_mutex_init(&m->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&m->cond, &ca);
    pthread_condattr_destroy(&ca);
    int thread_rc = pthread_create(&m->thread, NULL, scraper_main, m);
    if (thread_rc != 0) {
        km_engine_metrics_destroy(m);
        return km_why(why, why_size, KM_ERR_IO, "engine metrics thread: %s",
                      strerror(thread_rc));
    }
    m->started = true;
    *out = m;
    return KM_OK;
}

void km_engine_metrics_destroy(km_engine_metrics *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->lock);
    m->stop = true;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->lock);
    curl_multi_wakeup(m->multi); /* a round's poll returns at once */
    if (m->started)
        pthread_join(m->thread, NULL);
    for (uint32_t w = 0; w < m->cfg.max_workers; w++) {
        free(m->targets[w].url);
        if (m->easy[w])
            curl_easy_cleanup(m->easy[w]);
    }
    curl_multi_cleanup(m->multi);
    free(m->easy);
    free(m->slots);
    free(m->targets);
    pthread_cond_destroy(&m->cond);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

int km_engine_metrics_set_target(km_engine_metrics *m, uint32_t worker, const char *url)
{
    if (!m)
        return KM_ERR_NULL_POINTER;
    if (worker >= m->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    if (url && strncmp(url, "http://", 7) && strncmp(url, "https://", 8))
        return KM_ERR_INVALID_ARGUMENT;
    char *copy = url ? strdup(url) : NULL;
    if (url && !copy)
        return KM_ERR_OUT_OF_MEMORY;
    pthread_mutex_lock(&m->lock);
    target *t = &m->targets[worker];
    free(t->url);
    t->url = copy;
    memset(&t->load, 0, sizeof t->load);
    t->load.running = t->load.waiting = t->load.kv_usage = NAN;
    t->due_ns = 0;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->lock);
    curl_multi_wakeup(m->multi); /* a scraper waiting on scrapes in flight starts this one too */
    return KM_OK;
}

int km_engine_metrics_get(km_engine_metrics *m, uint32_t worker, km_engine_reported *out)
{
    if (!m || !out)
        return KM_ERR_NULL_POINTER;
    if (worker >= m->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    pthread_mutex_lock(&m->lock);
    int rc = m->targets[worker].url ? KM_OK : KM_ERR_NOT_FOUND;
    if (rc == KM_OK)
        *out = m->targets[worker].load;
    pthread_mutex_unlock(&m->lock);
    return rc;
}
