/* SPDX-License-Identifier: Apache-2.0 */
/* What the service reports about itself: readiness, /status (JSON), /metrics (the registered
 * metrics and the per-worker and records samples), and km_server_get_stats. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <jansson.h>

#include "kvmatch/server.h"
#include "kvmatch/version.h"
#include "service/server_internal.h"
#include "base/utf8.h"

/* Ready to take traffic: not draining, the records writer not failing (its last write reached
 * the file: decisions are still served while it fails, but their records are lost, and an
 * orchestrator should send traffic elsewhere), and at least ready_share of the event-fed workers
 * LIVE (approximate-mode workers do not count); the reason says which, either way. Takes
 * admin_lock. */
bool km_srv_readiness(km_server *s, char *reason, size_t reason_size)
{
    uint32_t events = 0, live = 0, approx = 0;
    pthread_mutex_lock(&s->admin_lock);
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        if (!w->events) {
            approx++;
            continue;
        }
        events++;
        km_feed_worker_info info;
        /* A worker whose every store is refused for its configuration is not ready: LIVE with no
         * blocks, forever. */
        if (km_srv_feed_info(s, id, &info) == KM_OK && info.state == KM_FEED_STATE_LIVE &&
            !info.config_refused)
            live++;
    }
    pthread_mutex_unlock(&s->admin_lock);
    km_record_writer_counters rc;
    km_record_writer_stats(s->records, &rc); /* zeroes when there is no writer */
    char records[KM_RECORD_WRITER_ERROR_BYTES + 64] = "";
    if (rc.failing) {
        char last[KM_RECORD_WRITER_ERROR_BYTES];
        km_record_writer_last_error(s->records, last, sizeof last);
        snprintf(records, sizeof records, "records cannot be written (%s); ", last);
    }
    bool ready = !s->draining && !rc.failing &&
                 (events == 0 || (double)live >= s->cfg.ready_share * events - 1e-9);
    snprintf(reason, reason_size,
             "%s%s%u/%u event-fed workers LIVE and accepting stores (need %.0f%%), %u approximate",
             s->draining ? "shutting down; " : "", records, live, events,
             s->cfg.ready_share * 100.0, approx);
    return ready;
}

/* Active work's counters (the bytes bound: max_active_bytes). Takes active_lock. */
static km_active_stats active_work_stats(km_server *s)
{
    km_active_stats st;
    memset(&st, 0, sizeof st);
    pthread_mutex_lock(&s->active_lock);
    km_active_get_stats(s->active, &st);
    pthread_mutex_unlock(&s->active_lock);
    return st;
}

/* The readiness reason quotes the records writer's last error, which names the records path (any
 * bytes) and may be cut inside a character: /readyz and /status give it as UTF-8, each ill-formed
 * sequence replaced by U+FFFD, so /status never loses ready_reason. */
static bool http_readiness(void *user, km_text *reason)
{
    char buf[KM_SRV_READINESS_REASON_BYTES];
    bool ready = km_srv_readiness(user, buf, sizeof buf);
    char *clean = km_utf8_clean_dup(buf);
    km_text_append_cstr(reason, clean ? clean : "(no memory for the reason)");
    free(clean);
    return ready;
}

static int http_status(void *user, km_text *out)
{
    km_server *s = user;
    json_t *root = json_object();
    char reason[KM_SRV_READINESS_REASON_BYTES];
    bool ready = km_srv_readiness(s, reason, sizeof reason);
    char *clean_reason = km_utf8_clean_dup(reason); /* UTF-8 for JSON, as in http_readiness */
    json_object_set_new(root, "kvmatch_version", json_string(KVMATCH_VERSION));
    json_object_set_new(root, "uptime_s", json_real((double)(now_ns() - s->start_ns) / 1e9));
    json_object_set_new(root, "ready", json_boolean(ready));
    json_object_set_new(root, "ready_reason",
                        clean_reason ? json_string(clean_reason) : json_null());
    free(clean_reason);
    json_object_set_new(root, "connections", json_integer((json_int_t)atomic_load(&s->st.open)));
    json_object_set_new(root, "decisions", json_integer((json_int_t)atomic_load(&s->st.decisions)));
    json_object_set_new(root, "warm_ups", json_integer((json_int_t)atomic_load(&s->st.warm_ups)));
    km_active_stats active = active_work_stats(s);
    json_object_set_new(root, "active_work",
                        json_pack("{sI sI sI sI}", "entries", (json_int_t)active.entries, "bytes",
                                  (json_int_t)active.bytes, "max_bytes",
                                  (json_int_t)s->cfg.max_active_bytes, "refused_bytes",
                                  (json_int_t)active.refused_bytes));
    json_t *workers = json_array();
    bool engine_fresh = false; /* some worker's engine scrape is fresh */
    pthread_mutex_lock(&s->admin_lock);
    json_t *pools = json_array();
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        json_t *jp = json_object();
        json_object_set_new(jp, "name", json_string(p->name));
        json_object_set_new(jp, "model", p->model ? json_string(p->model) : json_null());
        json_object_set_new(jp, "block_size", json_integer(p->block_size));
        json_object_set_new(jp, "policy", json_string(km_policy_kind_name(p->policy.kind)));
        const char *engine = km_engine_model_preset_of(&p->policy.engine);
        json_object_set_new(jp, "engine", engine ? json_string(engine) : json_null());
        json_object_set_new(jp, "backend", json_string(km_index_backend_name(p->index)));
        km_index_stats is;
        if (km_index_get_stats(p->index, &is) == KM_OK) {
            json_object_set_new(jp, "blocks", json_integer((json_int_t)is.blocks));
            json_object_set_new(jp, "pairs", json_integer((json_int_t)is.pairs));
            json_object_set_new(jp, "memory_bytes", json_integer((json_int_t)is.memory_bytes));
            json_object_set_new(jp, "block_capacity", json_integer((json_int_t)is.block_capacity));
            json_object_set_new(jp, "table_growths", json_integer((json_int_t)is.table_growths));
            json_object_set_new(jp, "table_growth_ms_max", json_real(is.table_growth_ms_max));
            json_object_set_new(jp, "host_scored_batches",
                                json_integer((json_int_t)is.host_scored_batches));
        }
        /* A snapshot that did not restore at start, and where it is kept (EVENTS.md, "Restart
         * of kvmatch"). */
        km_subscriber_stats ss;
        if (p->snapshot_path && p->sub && km_subscriber_get_stats(p->sub, &ss) == KM_OK) {
            char error[3 * sizeof ss.restore_error], kept[3 * sizeof ss.unrestorable_kept_as];
            char *path = km_utf8_clean_dup(p->snapshot_path);
            km_utf8_clean_copy(error, ss.restore_error);
            km_utf8_clean_copy(kept, ss.unrestorable_kept_as);
            json_object_set_new(
                jp, "snapshot",
                json_pack("{ss sb so so sI sI}", "path", path ? path : "", "restored",
                          ss.restored, "restore_error",
                          ss.restore_status ? json_string(error) : json_null(),
                          "unrestorable_kept_as", kept[0] ? json_string(kept) : json_null(),
                          "snapshots", (json_int_t)ss.snapshots, "snapshot_failures",
                          (json_int_t)ss.snapshot_failures));
            free(path);
        }
        json_array_append_new(pools, jp);
    }
    uint64_t now = now_ns();
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        pool *p = s->pools[w->pool];
        json_t *jw = json_object();
        json_object_set_new(jw, "id", json_integer(id));
        json_object_set_new(jw, "name", json_string(w->name));
        json_object_set_new(jw, "pool", json_string(p->name));
        json_object_set_new(jw, "mode", json_string(w->events ? "events" : "approx"));
        json_object_set_new(jw, "dp_rank", w->has_dp_rank ? json_integer(w->dp_rank) : json_null());
        pthread_mutex_lock(&s->active_lock);
        json_object_set_new(jw, "healthy", json_boolean(!w->unhealthy));
        json_object_set_new(jw, "breaker",
                            json_string(km_srv_breaker_state_name(km_srv_worker_breaker(w, now))));
        json_object_set_new(jw, "failures", json_integer(w->failures));
        json_object_set_new(jw, "eligible",
                            json_boolean(km_srv_worker_eligibility(s, id, now) == ELIGIBLE));
        pthread_mutex_unlock(&s->active_lock);
        /* The feed's position first, then the index: the index then holds at least every
         * message before expected_seq (a flush in between only adds to it). */
        km_feed_worker_info info;
        bool fed = w->events && km_srv_feed_info(s, id, &info) == KM_OK;
        km_worker_stats ws;
        if (km_index_worker_stats(p->index, id, &ws) == KM_OK)
            json_object_set_new(jw, "blocks", json_integer((json_int_t)ws.blocks));
        if (fed) {
            json_object_set_new(jw, "state", json_string(km_feed_state_name(info.state)));
            json_object_set_new(jw, "expected_seq", info.has_indexed_seq
                                                        ? json_integer((json_int_t)info.indexed_seq)
                                                        : json_null());
            json_object_set_new(jw, "last_event_age_s",
                                info.has_last_receive
                                    ? json_real((double)(now - info.last_receive_ns) / 1e9)
                                    : json_null());
            json_object_set_new(jw, "gaps", json_integer((json_int_t)info.counters.gaps));
            json_object_set_new(jw, "replayed", json_integer((json_int_t)info.counters.replayed));
            json_object_set_new(jw, "lost", json_integer((json_int_t)info.counters.lost));
            json_object_set_new(jw, "restarts", json_integer((json_int_t)info.counters.restarts));
            json_object_set_new(jw, "history_unavailable",
                                json_integer((json_int_t)info.counters.history_unavailable));
            json_object_set_new(jw, "config_refused", json_boolean(info.config_refused));
            json_t *jref = json_object();
            for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT; r++)
                json_object_set_new(jref, km_feed_refusal_name((km_feed_refusal)r),
                                    json_integer((json_int_t)info.counters.refused[r]));
            json_object_set_new(jw, "refused_events", jref);
            /* The sentence may quote an engine's strings: made UTF-8 for JSON. */
            char latest[3 * KM_FEED_REFUSAL_EXAMPLE_MAX];
            km_utf8_clean_copy(latest, info.latest_refusal);
            json_object_set_new(jw, "latest_refusal",
                                latest[0] ? json_string(latest) : json_null());
            /* Messages the feed dropped, by cause: the index's memory cap, no memory, a full
             * update queue (SERVICE.md, "/status"). */
            const km_feed_worker_counters *fc = &info.counters;
            json_t *dropped = json_object();
            json_object_set_new(dropped, "memory_cap",
                                json_integer((json_int_t)fc->memory_cap_refusals));
            json_object_set_new(dropped, "out_of_memory",
                                json_integer((json_int_t)(fc->refused_messages -
                                                          fc->memory_cap_refusals)));
            json_object_set_new(dropped, "queue_full",
                                json_integer((json_int_t)(fc->dropped_messages -
                                                          fc->refused_messages)));
            json_object_set_new(jw, "dropped_messages", dropped);
            json_object_set_new(jw, "index_refused_events",
                                json_integer((json_int_t)fc->refused_events));
            km_feed_window win[16];
            uint32_t nw = 0;
            json_t *jwin = json_array();
            if (km_srv_feed_windows(s, id, win, 16, &nw) == KM_OK)
                for (uint32_t k = 0; k < nw && k < 16; k++) {
                    json_t *o = json_object();
                    json_object_set_new(o, "cause", json_string(km_feed_window_cause_name(win[k].cause)));
                    json_object_set_new(o, "end", json_string(km_feed_window_end_name(win[k].end)));
                    json_object_set_new(o, "start_age_s", json_real((double)(now - win[k].start_ns) / 1e9));
                    json_object_set_new(o, "duration_s",
                                        win[k].end_ns ? json_real((double)win[k].duration_ns / 1e9)
                                                      : json_null());
                    json_object_set_new(o, "lost", json_integer((json_int_t)win[k].lost));
                    json_array_append_new(jwin, o);
                }
            json_object_set_new(jw, "recovery_windows", jwin);
        } else {
            json_object_set_new(jw, "state", json_string(w->events ? "UNKNOWN" : "APPROX"));
        }
        bool fresh = false;
        json_object_set_new(jw, "engine_reported",
                            km_srv_engine_reported_status(s, id, now_ns(), &fresh));
        engine_fresh |= fresh;
        json_array_append_new(workers, jw);
    }
    pthread_mutex_unlock(&s->admin_lock);
    json_object_set_new(root, "pools", pools);
    json_object_set_new(root, "workers", workers);
    json_object_set_new(root, "cluster", km_srv_cluster_status(s));
    /* The scope a decision would state now: the load view's, engine_reported joined while some
     * worker's scrape is fresh (a decision joins it when one of its candidates' is). */
    srv_load_view view;
    km_srv_cluster_label(s, now_ns(), &view);
    char scope[64];
    snprintf(scope, sizeof scope, "%s%s", view.scope, engine_fresh ? "+engine_reported" : "");
    json_object_set_new(root, "load_scope", json_string(scope));
    /* 10 significant digits: 1.513605972, not 1.5136059719999999 */
    char *text = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (!text) {
        km_text_append_cstr(out, "out of memory building the status");
        return KM_ERR_OUT_OF_MEMORY;
    }
    km_text_append_cstr(out, text);
    free(text);
    return KM_OK;
}

/* Per event-fed worker: refused or skipped events by reason, the engine history that was gone
 * before the worker joined, and the configuration flag (admin_lock held). */
static void worker_refusal_samples(km_server *s, km_text *out)
{
    static const char refused[] = "kvmatch_worker_refused_events_total";
    static const char history[] = "kvmatch_worker_history_unavailable_total";
    static const char config[] = "kvmatch_worker_config_refused";
    km_prom_write_family(out, refused,
                         "Events refused or kept out of the index per worker, by reason "
                         "(undecodable: messages).",
                         KM_METRIC_COUNTER);
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 1)
            km_prom_write_family(out, history,
                                 "Event seqs the engine no longer held when the worker joined.",
                                 KM_METRIC_COUNTER);
        if (pass == 2)
            km_prom_write_family(out, config,
                                 "1 when every store of the worker is refused for its block size.",
                                 KM_METRIC_GAUGE);
        for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
            worker_slot *w = &s->workers[id];
            km_feed_worker_info info;
            if (!w->used || !w->events || km_srv_feed_info(s, id, &info) != KM_OK)
                continue;
            char ids[16];
            snprintf(ids, sizeof ids, "%u", id);
            km_metric_label labels[4] = {{"worker", ids}, {"name", w->name},
                                         {"pool", s->pools[w->pool]->name}, {"reason", NULL}};
            if (pass == 0) {
                for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT; r++) {
                    labels[3].value = km_feed_refusal_name((km_feed_refusal)r);
                    km_prom_write_sample_u64(out, refused, labels, 4, info.counters.refused[r]);
                }
            } else if (pass == 1) {
                km_prom_write_sample_u64(out, history, labels, 3,
                                         info.counters.history_unavailable);
            } else {
                km_prom_write_sample_u64(out, config, labels, 3, info.config_refused ? 1 : 0);
            }
        }
    }
}

/* The process_* metrics every Prometheus client library exports, from /proc/self (Linux): CPU
 * time, resident and virtual memory, open and allowed file descriptors, start time. A value that
 * cannot be read is left out, never reported as 0. */
static void write_process_metrics(km_text *out, const km_server *s)
{
    long ticks = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    FILE *f = fopen("/proc/self/stat", "r");
    char buf[1024];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    const char *after = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long utime = 0, stime = 0, vsize = 0, rss = 0;
    if (after && ticks > 0 &&
        sscanf(after + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d "
                          "%*d %*d %*u %llu %llu", &utime, &stime, &vsize, &rss) == 4) {
        km_prom_write_family(out, "process_cpu_seconds_total",
                             "Total user and system CPU time spent in seconds.", KM_METRIC_COUNTER);
        km_prom_write_sample(out, "process_cpu_seconds_total", NULL, 0,
                             (double)(utime + stime) / (double)ticks);
        km_prom_write_family(out, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
                             KM_METRIC_GAUGE);
        km_prom_write_sample_u64(out, "process_virtual_memory_bytes", NULL, 0, vsize);
        km_prom_write_family(out, "process_resident_memory_bytes",
                             "Resident memory size in bytes.", KM_METRIC_GAUGE);
        km_prom_write_sample_u64(out, "process_resident_memory_bytes", NULL, 0,
                                 rss * (unsigned long long)page);
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        uint64_t fds = 0;
        for (struct dirent *e; (e = readdir(d));)
            fds += e->d_name[0] != '.';
        closedir(d);
        km_prom_write_family(out, "process_open_fds", "Number of open file descriptors.",
                             KM_METRIC_GAUGE);
        km_prom_write_sample_u64(out, "process_open_fds", NULL, 0, fds > 0 ? fds - 1 : 0);
    }
    struct rlimit lim;
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
        km_prom_write_family(out, "process_max_fds", "Maximum number of open file descriptors.",
                             KM_METRIC_GAUGE);
        km_prom_write_sample_u64(out, "process_max_fds", NULL, 0, (uint64_t)lim.rlim_cur);
    }
    km_prom_write_family(out, "process_start_time_seconds",
                         "Start time of the process since unix epoch in seconds.", KM_METRIC_GAUGE);
    km_prom_write_sample(out, "process_start_time_seconds", NULL, 0, s->start_wall_s);
}

/* Per worker with a metrics URL: what its engine last reported, how old that is, whether
 * decisions use it, and the scrapes (admin_lock held). A value the last good scrape did not carry,
 * or any value before the first good scrape, has no sample. */
static void engine_reported_samples(km_server *s, km_text *out)
{
    enum { RUNNING, WAITING, KV_USAGE, AGE, FRESH, SCRAPES, FAILURES, FAMILIES };
    static const struct {
        const char *name, *help;
        km_metric_type type;
    } fam[FAMILIES] = {
        {"kvmatch_worker_engine_running", "Requests running, as the worker's engine reports them.",
         KM_METRIC_GAUGE},
        {"kvmatch_worker_engine_waiting", "Requests waiting, as the worker's engine reports them.",
         KM_METRIC_GAUGE},
        {"kvmatch_worker_engine_kv_usage", "KV-cache usage (0..1), as the worker's engine reports it.",
         KM_METRIC_GAUGE},
        {"kvmatch_worker_engine_scrape_age_seconds", "Since the worker's last good scrape.",
         KM_METRIC_GAUGE},
        {"kvmatch_worker_engine_fresh",
         "1 while decisions use the worker's scraped values (younger than engine_metrics.max_age_ms).",
         KM_METRIC_GAUGE},
        {"kvmatch_worker_engine_scrapes_total", "Scrapes of the worker's metrics endpoint.",
         KM_METRIC_COUNTER},
        {"kvmatch_worker_engine_scrape_failures_total",
         "Of them, failed (the last good values are kept).", KM_METRIC_COUNTER},
    };
    uint64_t now = now_ns();
    for (int f = 0; s->engine_metrics && f < FAMILIES; f++) {
        km_prom_write_family(out, fam[f].name, fam[f].help, fam[f].type);
        for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
            worker_slot *w = &s->workers[id];
            km_engine_reported e;
            if (!w->used || km_engine_metrics_get(s->engine_metrics, id, &e) != KM_OK)
                continue;
            bool fresh = km_srv_engine_reported_fresh(s, id, now, &e);
            double v = NAN;
            switch (f) {
            case RUNNING: v = e.has_values ? e.running : NAN; break;
            case WAITING: v = e.has_values ? e.waiting : NAN; break;
            case KV_USAGE: v = e.has_values ? e.kv_usage : NAN; break;
            case AGE:
                v = e.has_values ? (double)km_engine_reported_age_ns(&e, now) / 1e9 : NAN;
                break;
            case FRESH: v = fresh; break;
            case SCRAPES: v = (double)e.scrapes; break;
            case FAILURES: v = (double)e.failures; break;
            }
            if (isnan(v))
                continue;
            char ids[16];
            snprintf(ids, sizeof ids, "%u", id);
            km_metric_label labels[3] = {{"worker", ids}, {"name", w->name},
                                         {"pool", s->pools[w->pool]->name}};
            km_prom_write_sample(out, fam[f].name, labels, 3, v);
        }
    }
}

static int http_metrics(void *user, km_text *out)
{
    km_server *s = user;
    km_prom_write_family(out, "kvmatch_worker_blocks", "Blocks the index holds per worker.",
                         KM_METRIC_GAUGE);
    /* One series per worker and state, 1 for the state it is in: a state change moves the 1,
     * never renames a series (a state label on the blocks would). */
    static const char *const states[] = {"LIVE", "SYNCING", "GAP", "DEGRADED", "APPROX"};
    km_text state_samples;
    km_text_init(&state_samples, 0);
    pthread_mutex_lock(&s->admin_lock);
    uint32_t degraded = 0, ineligible = 0;
    uint64_t gaps = 0, replayed = 0, restarts = 0, lost = 0, events = 0, refused_events = 0,
             now = now_ns();
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        pool *p = s->pools[w->pool];
        km_worker_stats ws;
        char ids[16];
        snprintf(ids, sizeof ids, "%u", id);
        const char *state = km_srv_worker_state(s, id);
        km_metric_label labels[4] = {{"worker", ids}, {"name", w->name}, {"pool", p->name},
                                     {"state", NULL}};
        if (km_index_worker_stats(p->index, id, &ws) == KM_OK)
            km_prom_write_sample_u64(out, "kvmatch_worker_blocks", labels, 3, ws.blocks);
        for (size_t k = 0; k < sizeof states / sizeof states[0]; k++) {
            labels[3].value = states[k];
            km_prom_write_sample_u64(&state_samples, "kvmatch_worker_state", labels, 4,
                                     !strcmp(state, states[k]));
        }
        pthread_mutex_lock(&s->active_lock);
        ineligible += km_srv_worker_eligibility(s, id, now) != ELIGIBLE;
        pthread_mutex_unlock(&s->active_lock);
        km_feed_worker_info info;
        if (w->events && km_srv_feed_info(s, id, &info) == KM_OK) {
            degraded += info.state == KM_FEED_STATE_DEGRADED;
            gaps += info.counters.gaps;
            replayed += info.counters.replayed;
            restarts += info.counters.restarts;
            lost += info.counters.lost;
            events += info.counters.events;
            refused_events += info.counters.refused_events;
        }
    }
    /* Messages each event-fed worker's feed dropped, by cause (the /status "dropped_messages"). */
    km_prom_write_family(out, "kvmatch_worker_dropped_messages_total",
                         "KV-event messages dropped per worker, by cause: memory_cap (the index's "
                         "memory cap refused them), out_of_memory, queue_full.",
                         KM_METRIC_COUNTER);
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        km_feed_worker_info info;
        if (!w->used || !w->events || km_srv_feed_info(s, id, &info) != KM_OK)
            continue;
        const km_feed_worker_counters *fc = &info.counters;
        char ids[16];
        snprintf(ids, sizeof ids, "%u", id);
        const char *causes[3] = {"memory_cap", "out_of_memory", "queue_full"};
        uint64_t counts[3] = {fc->memory_cap_refusals, fc->refused_messages - fc->memory_cap_refusals,
                              fc->dropped_messages - fc->refused_messages};
        for (int k = 0; k < 3; k++) {
            km_metric_label labels[4] = {{"worker", ids}, {"name", w->name},
                                         {"pool", s->pools[w->pool]->name}, {"cause", causes[k]}};
            km_prom_write_sample_u64(out, "kvmatch_worker_dropped_messages_total", labels, 4,
                                     counts[k]);
        }
    }
    worker_refusal_samples(s, out);
    engine_reported_samples(s, out);
    pthread_mutex_unlock(&s->admin_lock);
    km_prom_write_family(out, "kvmatch_worker_state",
                         "1 for the index state each worker is in (LIVE, SYNCING, GAP, DEGRADED: "
                         "fed by KV events; APPROX: approximate mode), 0 for the others.",
                         KM_METRIC_GAUGE);
    km_text_append(out, state_samples.data, state_samples.length);
    km_text_free(&state_samples);
    km_metric_label build[2] = {{"version", KVMATCH_VERSION}, {"cuda", KM_HAVE_CUDA ? "true" : "false"}};
    km_prom_write_family(out, "kvmatch_build_info",
                         "1, labelled with this binary's version and whether it was built with the "
                         "CUDA backend.", KM_METRIC_GAUGE);
    km_prom_write_sample_u64(out, "kvmatch_build_info", build, 2, 1);
    write_process_metrics(out, s);
    km_srv_cluster_metrics(s, out);
    struct {
        const char *name, *help;
        km_metric_type type;
        uint64_t v;
    } rows[] = {
        {"kvmatch_degraded_workers", "Event-fed workers whose history was lost.", KM_METRIC_GAUGE,
         degraded},
        {"kvmatch_ineligible_workers",
         "Workers a route cannot choose now: unhealthy by the router's word or held back by their "
         "circuit breaker.",
         KM_METRIC_GAUGE, ineligible},
        {"kvmatch_kv_events_total", "KV events applied (taken by the index), all workers.",
         KM_METRIC_COUNTER, events},
        {"kvmatch_kv_events_refused_total",
         "KV events of messages the index refused (memory cap or out of memory), all workers.",
         KM_METRIC_COUNTER, refused_events},
        {"kvmatch_event_gaps_total", "Sequence gaps detected.", KM_METRIC_COUNTER, gaps},
        {"kvmatch_event_replayed_total", "Messages applied from replays.", KM_METRIC_COUNTER,
         replayed},
        {"kvmatch_event_lost_total", "Sequence numbers lost for good.", KM_METRIC_COUNTER, lost},
        {"kvmatch_engine_restarts_total", "Engine restarts detected.", KM_METRIC_COUNTER, restarts},
        {"kvmatch_connections", "Router connections open.", KM_METRIC_GAUGE,
         atomic_load(&s->st.open)},
        {"kvmatch_lifecycle_errors_total", "Lifecycle reports answered with an error.",
         KM_METRIC_COUNTER, atomic_load(&s->st.lifecycle_errors)},
        {"kvmatch_replies_cut_total",
         "ACK replies sent with their failed items' messages cut short to fit max_frame_bytes.",
         KM_METRIC_COUNTER, atomic_load(&s->st.replies_cut)},
        {"kvmatch_approx_dispatch_learned_total",
         "Router overrides to an approximate-mode worker that taught it the request's blocks.",
         KM_METRIC_COUNTER, atomic_load(&s->st.dispatch_learned)},
        {"kvmatch_approx_dispatch_unlearned_total",
         "Router overrides to an approximate-mode worker that could not teach it "
         "(approx_dispatch_max_bytes).",
         KM_METRIC_COUNTER, atomic_load(&s->st.dispatch_unlearned)},
        {"kvmatch_breaker_opened_total",
         "Circuit breakers opened or reopened by failed attempts (breaker_failures).",
         KM_METRIC_COUNTER, atomic_load(&s->st.breaker_opened)},
        {"kvmatch_no_healthy_worker_total",
         "Routes refused because no candidate was eligible (unhealthy or breaker open).",
         KM_METRIC_COUNTER, atomic_load(&s->st.no_healthy)},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        km_prom_write_family(out, rows[i].name, rows[i].help, rows[i].type);
        km_prom_write_sample_u64(out, rows[i].name, NULL, 0, rows[i].v);
    }
    struct {
        const char *reason;
        uint64_t v;
    } rejected[] = {
        {"max_connections", atomic_load(&s->st.refused_limit)},
        {"shutting_down", atomic_load(&s->st.refused_draining)},
        {"out_of_memory", atomic_load(&s->st.refused_memory)},
    };
    km_prom_write_family(out, "kvmatch_connections_rejected_total",
                         "Router connections refused when accepted (an ERROR frame, then closed), "
                         "by reason.",
                         KM_METRIC_COUNTER);
    for (size_t i = 0; i < sizeof rejected / sizeof rejected[0]; i++) {
        km_metric_label label = {"reason", rejected[i].reason};
        km_prom_write_sample_u64(out, "kvmatch_connections_rejected_total", &label, 1,
                                 rejected[i].v);
    }
    km_active_stats active = active_work_stats(s);
    km_prom_write_family(out, "kvmatch_active_bytes",
                         "Bytes active work's entries are counted as holding (max_active_bytes).",
                         KM_METRIC_GAUGE);
    km_prom_write_sample_u64(out, "kvmatch_active_bytes", NULL, 0, active.bytes);
    km_prom_write_family(out, "kvmatch_active_refused_bytes_total",
                         "Routes refused with KM_ERR_MEMORY_CAP: their active work would pass "
                         "max_active_bytes.",
                         KM_METRIC_COUNTER);
    km_prom_write_sample_u64(out, "kvmatch_active_refused_bytes_total", NULL, 0,
                             active.refused_bytes);
    km_record_writer_counters rc;
    memset(&rc, 0, sizeof rc);
    if (s->records)
        km_record_writer_stats(s->records, &rc);
    /* Every writer counter (docs/RECORDS.md): dropped, failed and invalid records are the ones
     * an analyzer will not find. */
    struct {
        const char *name, *help;
        km_metric_type type;
        uint64_t v;
    } records[] = {
        {"kvmatch_records_submitted_total", "Records the writer took into its queue.",
         KM_METRIC_COUNTER, rc.submitted},
        {"kvmatch_records_dropped_total", "Records the writer could not take (queue full).",
         KM_METRIC_COUNTER, rc.dropped},
        {"kvmatch_records_written_total", "Records written to the records file.",
         KM_METRIC_COUNTER, rc.written},
        {"kvmatch_records_failed_total",
         "Records lost to an I/O error (full disk, unwritable or missing directory).",
         KM_METRIC_COUNTER, rc.failed},
        {"kvmatch_records_invalid_total", "Records that did not format (a bad field).",
         KM_METRIC_COUNTER, rc.invalid},
        {"kvmatch_records_pending", "Records taken, not yet written, failed or invalid.",
         KM_METRIC_GAUGE, rc.pending},
        {"kvmatch_records_failing",
         "1 while the records writer's last write failed (records are being lost; /readyz is "
         "503), else 0.",
         KM_METRIC_GAUGE, rc.failing},
        {"kvmatch_records_bytes_total", "Bytes written to the records files.", KM_METRIC_COUNTER,
         rc.bytes},
        {"kvmatch_records_rotations_total", "Records files rotated.", KM_METRIC_COUNTER,
         rc.rotations},
        {"kvmatch_records_deleted_total",
         "Records in files that rotation deleted (keep_files, max_kept_bytes, max_age_s).",
         KM_METRIC_COUNTER, rc.deleted_records},
        {"kvmatch_records_deleted_files_total", "Records files that rotation deleted.",
         KM_METRIC_COUNTER, rc.deleted_files},
        {"kvmatch_records_write_errors_total",
         "Failed system calls of the records writer (open, write, fdatasync, rename).",
         KM_METRIC_COUNTER, rc.write_errors},
    };
    for (size_t i = 0; i < sizeof records / sizeof records[0]; i++) {
        km_prom_write_family(out, records[i].name, records[i].help, records[i].type);
        km_prom_write_sample_u64(out, records[i].name, NULL, 0, records[i].v);
    }
    return out->status;
}

/* The HTTP server's callbacks (service/http.h): /readyz, /status and the service's samples in
 * /metrics; they run on the HTTP thread and take admin_lock and active_lock briefly. */
km_http_callbacks km_srv_http_callbacks(km_server *s)
{
    km_http_callbacks cb = {s, http_readiness, http_status, http_metrics};
    return cb;
}

/* The service's registered metrics (counters and histograms); the per-worker and records
 * samples are appended at each scrape (http_metrics). */
int km_srv_metrics_setup(km_server *s)
{
    int rc = km_metrics_create(&s->metrics);
    size_t nb, nl;
    const double *bb = km_metrics_batch_size_buckets(&nb);
    const double *lb = km_metrics_latency_buckets_seconds(&nl);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_decisions_total", "Routes decided.", NULL, 0,
                                    &s->m_decisions);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_warm_ups_total",
                                    "Warm-ups decisions asked for: a prefill of a request's "
                                    "leading blocks on another worker, decided as its own "
                                    "decision.", NULL, 0, &s->m_warm_ups);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_route_errors_total",
                                    "Routes answered with an error.", NULL, 0, &s->m_route_errors);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_frames_total", "Frames received.", NULL, 0,
                                    &s->m_frames);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_bad_frames_total",
                                    "Frames that failed as a whole: framing errors, frames not "
                                    "complete within frame_timeout_ms, frames that did not "
                                    "decode.", NULL, 0, &s->m_bad_frames);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_reading_pauses_total",
                                    "Times a connection's reading paused while its replies waited "
                                    "(over max_outbox_bytes / 4).", NULL, 0, &s->m_reading_paused);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_slow_clients_closed_total",
                                    "Connections closed for not reading their replies (outbox over "
                                    "max_outbox_bytes, or none taken for stalled_reader_timeout_ms).",
                                    NULL, 0, &s->m_slow_closed);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_routes_dropped_closed_total",
                                    "Routes still queued when their connection closed: dropped "
                                    "undecided.", NULL, 0, &s->m_dropped_closed);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_decisions_undelivered_total",
                                    "Decisions whose reply was not written whole before their "
                                    "connection closed (or could not be encoded): their active "
                                    "work ended, outcome cancelled.", NULL, 0, &s->m_undelivered);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_prefill_progress_blocks_total",
                                    "Blocks promised by queued prefills that their workers' events "
                                    "reported stored, each lowering its prefill's pending tokens.",
                                    NULL, 0, &s->m_progress_blocks);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_prefill_progress_dropped_total",
                                    "Runs of stored blocks not kept for the queued prefills' "
                                    "progress (more than fit between two batches): their blocks "
                                    "count as not computed until a later run or the first token.",
                                    NULL, 0, &s->m_progress_dropped);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_lifecycle_events_total",
                                    "DISPATCHED / FIRST_TOKEN / FINISHED reports.", NULL, 0,
                                    &s->m_lifecycle);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_outcomes_total",
                                    "Outcome records (FINISHED and expiries).", NULL, 0, &s->m_outcomes);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_active_expired_total",
                                    "Active work that expired without FINISHED.", NULL, 0,
                                    &s->m_expired);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_active_evicted_total",
                                    "Active work ended early to make room (max_active_entries).",
                                    NULL, 0, &s->m_evicted);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_overloaded_total",
                                    "ROUTE frames refused: queue full.", NULL, 0, &s->m_overloaded);
    if (!rc) {
        static const char shed_help[] =
            "Routes answered KM_ERR_OVERLOADED at once: queued past max_queue_wait_ms "
            "(queue_wait), or their frame over its connection's max_connection_routes "
            "(connection_budget).";
        km_metric_label wait = {"reason", "queue_wait"}, budget = {"reason", "connection_budget"};
        rc = km_metrics_add_counter(s->metrics, "kvmatch_routes_shed_total", shed_help, &wait, 1,
                                    &s->m_shed_wait);
        if (!rc)
            rc = km_metrics_add_counter(s->metrics, "kvmatch_routes_shed_total", shed_help,
                                        &budget, 1, &s->m_shed_connection);
    }
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_batch_routes", "Routes per scoring batch.",
                                      NULL, 0, bb, nb, &s->m_batch_routes);
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_batch_seconds",
                                      "Time to score and decide one batch.", NULL, 0, lb, nl,
                                      &s->m_batch_seconds);
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_queue_wait_seconds",
                                      "Time a ROUTE frame waited for its batch.", NULL, 0, lb, nl,
                                      &s->m_queue_seconds);
    return rc;
}

int km_srv_metrics_pool_ttft(km_server *s, const char *name, km_histogram **out)
{
    /* Around 1 where a pool's engine model fits its engines (ANALYZE.md, "TTFT prediction"). */
    static const double bounds[] = {0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4};
    km_metric_label label = {"pool", name};
    return km_metrics_add_histogram(
        s->metrics, "kvmatch_ttft_observed_over_predicted",
        "First tokens of attempts run where kvmatch chose: the time to first token (the router's "
        "elapsed_ms, else kvmatch's from the decision) over the pool's engine model's prediction "
        "on the chosen worker.",
        &label, 1, bounds, sizeof bounds / sizeof bounds[0], out);
}

void km_server_get_stats(km_server *s, km_server_stats *o)
{
    memset(o, 0, sizeof *o);
    if (!s)
        return;
    o->connections_accepted = atomic_load(&s->st.accepted);
    o->connections_open = atomic_load(&s->st.open);
    o->connections_refused = atomic_load(&s->st.refused);
    o->slow_clients_closed = atomic_load(&s->st.slow_closed);
    o->reading_pauses = atomic_load(&s->st.reading_paused);
    o->frames = atomic_load(&s->st.frames);
    o->bad_frames = atomic_load(&s->st.bad_frames);
    o->routes = atomic_load(&s->st.routes);
    o->decisions = atomic_load(&s->st.decisions);
    o->warm_ups = atomic_load(&s->st.warm_ups);
    o->route_errors = atomic_load(&s->st.route_errors);
    o->overloaded = atomic_load(&s->st.overloaded);
    o->routes_shed_wait = atomic_load(&s->st.shed_wait);
    o->routes_shed_connection = atomic_load(&s->st.shed_connection);
    o->batches = atomic_load(&s->st.batches);
    o->inline_batches = atomic_load(&s->st.inline_batches);
    o->lifecycle_events = atomic_load(&s->st.lifecycle);
    o->lifecycle_errors = atomic_load(&s->st.lifecycle_errors);
    o->outcomes = atomic_load(&s->st.outcomes);
    o->expired = atomic_load(&s->st.expired);
    o->evicted = atomic_load(&s->st.evicted);
    o->active_refused_bytes = active_work_stats(s).refused_bytes;
    o->routes_dropped_at_shutdown = atomic_load(&s->st.dropped_at_shutdown);
    o->routes_dropped_closed = atomic_load(&s->st.dropped_closed);
    o->decisions_undelivered = atomic_load(&s->st.undelivered);
    o->approx_dispatch_learned = atomic_load(&s->st.dispatch_learned);
    o->approx_dispatch_unlearned = atomic_load(&s->st.dispatch_unlearned);
    o->breaker_opened = atomic_load(&s->st.breaker_opened);
    o->no_healthy_worker = atomic_load(&s->st.no_healthy);
    o->scheduler_replies = atomic_load(&s->st.scheduler_replies);
    o->send_buffer_bytes = atomic_load(&s->st.send_buffer_bytes);
    o->replies_cut = atomic_load(&s->st.replies_cut);
    if (s->records) {
        km_record_writer_counters rc;
        km_record_writer_stats(s->records, &rc);
        o->records_dropped = rc.dropped;
    }
}
