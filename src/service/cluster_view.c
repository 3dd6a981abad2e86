/* The service's side of the cluster view (docs/CLUSTER.md): the km_cluster handle made from the
 * configuration, this instance's per-worker load published after every change of active work,
 * the other instances' load added to each candidate's, and the label every decision carries;
 * approximate-mode predictions published, and the others' queued for the scheduler role.
 * Without a cluster configured each function is a no-op and decisions say "this_instance". */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <xxhash.h>

#include "base/error_detail.h"
#include "kvmatch/log.h"
#include "kvmatch/metrics.h"
#include "service/server_internal.h"

/* The most bytes of remote predictions queued for the scheduler at once; past it a prediction is
 * dropped and counted (the peers' next decisions teach again). */
#define PREDICTIONS_MAX_BYTES (UINT64_C(64) << 20)

/* km_cluster's on_prediction: copy the prediction for the scheduler role (NATS delivery thread,
 * the cluster handle's lock held; predictions_lock is a leaf). */
static void prediction_received(void *user, const km_cluster_prediction *pr)
{
    km_server *s = user;
    uint64_t bytes = sizeof(remote_prediction) + (uint64_t)pr->n_hashes * sizeof(uint64_t);
    pthread_mutex_lock(&s->predictions_lock);
    remote_prediction *r = s->predictions_bytes + bytes <= PREDICTIONS_MAX_BYTES ? malloc(bytes)
                                                                                 : NULL;
    if (!r) {
        s->predictions_dropped++;
        pthread_mutex_unlock(&s->predictions_lock);
        return;
    }
    r->next = NULL;
    snprintf(r->instance, sizeof r->instance, "%s", pr->instance);
    snprintf(r->pool, sizeof r->pool, "%s", pr->pool);
    r->worker = pr->worker;
    r->lesson = pr->lesson;
    r->n_hashes = pr->n_hashes;
    memcpy(r->hashes, pr->hashes, (size_t)pr->n_hashes * sizeof *r->hashes);
    if (s->predictions_tail)
        s->predictions_tail->next = r;
    else
        s->predictions_head = r;
    s->predictions_tail = r;
    s->predictions_bytes += bytes;
    atomic_store(&s->predictions_queued, true);
    pthread_mutex_unlock(&s->predictions_lock);
}

void km_srv_cluster_publish_prediction(km_server *s, const pool *p, uint32_t worker, bool lesson,
                                       const uint64_t *hashes, uint32_t n_hashes)
{
    if (s->cluster && n_hashes)
        km_cluster_publish_prediction(s->cluster, p->name, worker, lesson, hashes, n_hashes);
}

remote_prediction *km_srv_cluster_take_predictions(km_server *s)
{
    if (!atomic_load(&s->predictions_queued))
        return NULL;
    pthread_mutex_lock(&s->predictions_lock);
    remote_prediction *head = s->predictions_head;
    s->predictions_head = s->predictions_tail = NULL;
    s->predictions_bytes = 0;
    atomic_store(&s->predictions_queued, false);
    pthread_mutex_unlock(&s->predictions_lock);
    return head;
}

void km_srv_cluster_prediction_outcome(km_server *s, const remote_prediction *r,
                                       srv_prediction_outcome outcome)
{
    bool log_it = false;
    char line[sizeof s->predictions_last_refusal];
    pthread_mutex_lock(&s->predictions_lock);
    switch (outcome) {
    case SRV_PREDICTION_APPLIED: s->predictions_applied++; break;
    case SRV_PREDICTION_OBSERVED: s->predictions_observed++; break;
    case SRV_PREDICTION_DROPPED: s->predictions_dropped++; break;
    case SRV_PREDICTION_REFUSED:
        s->predictions_refused++;
        snprintf(line, sizeof line, "instance %s: pool %s has no worker %u here", r->instance,
                 r->pool, r->worker);
        /* Logged when the reason changes: one misconfigured peer does not flood the log. */
        log_it = strcmp(line, s->predictions_last_refusal) != 0;
        memcpy(s->predictions_last_refusal, line, sizeof line);
        break;
    }
    pthread_mutex_unlock(&s->predictions_lock);
    if (log_it)
        km_srv_log(s, KM_LOG_WARNING
                   "cluster: refused a prediction (%s): the instances' pools or workers differ",
                   line);
}

void km_srv_cluster_predictions_free(km_server *s)
{
    remote_prediction *r = s->predictions_head;
    while (r) {
        remote_prediction *next = r->next;
        free(r);
        r = next;
    }
    s->predictions_head = s->predictions_tail = NULL;
    s->predictions_bytes = 0;
}

/* What a pool's worker ids mean on this instance: XXH3 of its block size and its workers' ids
 * and names, ascending by id. Instances sharing the configuration agree; one whose worker 3 is
 * another engine (another name) or that has other workers does not. Whether a worker is fed by KV
 * events is not part of it: observations and predictions mix by design. */
static uint64_t pool_fingerprint(km_server *s, const pool *p, km_text *buf)
{
    km_text_clear(buf);
    km_text_printf(buf, "block_size %u\n", p->block_size);
    for (uint32_t i = 0; i < p->n_members; i++)
        km_text_printf(buf, "%u %s\n", p->members[i], s->workers[p->members[i]].name);
    return XXH3_64bits(buf->data, buf->length);
}

/* This instance's pools as the cluster handle compares them (names and members point into the
 * pools, valid while they are unchanged); the first KM_CLUSTER_MAX_POOLS. */
static uint32_t cluster_pools_of(km_server *s, km_cluster_pool *pools, km_text *buf)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->n_pools && n < KM_CLUSTER_MAX_POOLS; i++) {
        const pool *p = s->pools[i];
        pools[n++] = (km_cluster_pool){p->name, pool_fingerprint(s, p, buf), p->members,
                                       p->n_members};
    }
    return n;
}

void km_srv_cluster_pools_changed(km_server *s)
{
    if (!s->cluster)
        return;
    km_cluster_pool pools[KM_CLUSTER_MAX_POOLS];
    km_text buf;
    km_text_init(&buf, 4096);
    uint32_t n = cluster_pools_of(s, pools, &buf);
    if (s->n_pools > KM_CLUSTER_MAX_POOLS)
        km_srv_log(s, KM_LOG_WARNING
                   "cluster: %u pools, the first %u are compared with the other instances'",
                   s->n_pools, KM_CLUSTER_MAX_POOLS);
    int rc = km_cluster_set_pools(s->cluster, pools, n);
    if (rc != KM_OK)
        km_srv_log(s, KM_LOG_WARNING "cluster: announcing the pools' workers: %s",
                   km_strerror(rc));
    km_text_free(&buf);
}

int km_srv_cluster_start(km_server *s, char *why, size_t why_size)
{
    const km_server_config *cfg = &s->cfg;
    if (!cfg->cluster_url)
        return KM_OK;
    char url[256]; /* what the log says: without a password or token the URL carries */
    km_cluster_url_shown(cfg->cluster_url, url, sizeof url);
    if (!cfg->cluster_instance)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "cluster %s: an instance id is required (--instance, cluster.instance)",
                      url);
    km_cluster_config cc;
    km_cluster_config_init(&cc);
    cc.url = cfg->cluster_url;
    cc.instance = cfg->cluster_instance;
    if (cfg->cluster_subject)
        cc.subject_prefix = cfg->cluster_subject;
    cc.max_workers = cfg->max_workers;
    if (cfg->cluster_heartbeat_ms)
        cc.heartbeat_ms = cfg->cluster_heartbeat_ms;
    if (cfg->cluster_expire_ms)
        cc.expire_ms = cfg->cluster_expire_ms;
    else if (cc.expire_ms <= cc.heartbeat_ms)
        cc.expire_ms = 5 * cc.heartbeat_ms;
    if (cfg->cluster_sync_timeout_ms)
        cc.sync_timeout_ms = cfg->cluster_sync_timeout_ms;
    if (cfg->cluster_sync_quiet_ms)
        cc.sync_quiet_ms = cfg->cluster_sync_quiet_ms;
    cc.on_prediction = prediction_received;
    cc.on_prediction_user = s;
    cc.log = s->log;
    cc.log_user = s->log_user;
    /* The pools go in at create, so the peers' states and predictions that come during its
     * sync are compared with them; pools_changed then logs what the create could not say. */
    km_cluster_pool pools[KM_CLUSTER_MAX_POOLS];
    km_text buf;
    km_text_init(&buf, 4096);
    cc.pools = pools;
    cc.n_pools = cluster_pools_of(s, pools, &buf);
    char detail[256] = "";
    int rc = km_cluster_create(&cc, &s->cluster, detail, sizeof detail);
    km_text_free(&buf);
    if (rc != KM_OK)
        return km_why(why, why_size, rc, "cluster: %s", detail);
    km_srv_cluster_pools_changed(s);
    km_cluster_stats st;
    km_cluster_get_stats(s->cluster, &st);
    if (st.connected)
        km_srv_log(s, KM_LOG_INFO
                   "cluster %s as %s: took the view of %u peer%s in %.3f s", url,
                   cfg->cluster_instance, st.sync_peers, st.sync_peers == 1 ? "" : "s",
                   st.sync_seconds);
    else
        km_srv_log(s, KM_LOG_WARNING
                   "cluster %s unreachable: routing on this instance's view (load scope "
                   "this_instance) until it is", url);
    return KM_OK;
}

void km_srv_cluster_publish(km_server *s, uint32_t worker)
{
    km_active_load load;
    if (!s->cluster || km_active_worker_load(s->active, worker, &load) != KM_OK)
        return;
    /* With the load, what a ttft decision elsewhere reads of this worker's requests: their
     * shared-prefix keys and queued prefills' promised blocks. The cluster handle reads no more
     * than a work row carries, so no more are gathered; it is given the full counts, and counts
     * what it cuts. */
    uint64_t prefixes_small[64], queued_small[256];
    uint64_t *prefixes = prefixes_small, *queued = queued_small;
    uint32_t np = 0, nq = 0;
    if (km_active_worker_work(s->active, worker, prefixes, 64, &np, queued, 256, &nq) != KM_OK)
        return;
    if (np > 64 || nq > 256) {
        uint32_t max_p = np < KM_CLUSTER_WORK_MAX_PREFIXES ? np : KM_CLUSTER_WORK_MAX_PREFIXES;
        uint32_t max_q = nq < KM_CLUSTER_WORK_MAX_QUEUED ? nq : KM_CLUSTER_WORK_MAX_QUEUED;
        prefixes = malloc(((size_t)max_p + 1) * sizeof *prefixes);
        queued = malloc(((size_t)max_q + 1) * sizeof *queued);
        if (!prefixes || !queued ||
            km_active_worker_work(s->active, worker, prefixes, max_p, &np, queued, max_q,
                                  &nq) != KM_OK) {
            free(prefixes);
            free(queued);
            km_cluster_publish_load(s->cluster, worker, &load); /* out of memory: load only */
            return;
        }
        /* Past a bound the full count is passed on (the handle reads only the bound's worth);
         * below it, never more than was gathered, should the lists have grown between the two
         * calls. */
        if (np > max_p && max_p < KM_CLUSTER_WORK_MAX_PREFIXES)
            np = max_p;
        if (nq > max_q && max_q < KM_CLUSTER_WORK_MAX_QUEUED)
            nq = max_q;
    }
    km_cluster_publish_work(s->cluster, worker, &load, prefixes, np, queued, nq);
    if (prefixes != prefixes_small) {
        free(prefixes);
        free(queued);
    }
}

uint32_t km_srv_cluster_prefix_sharers(km_server *s, uint32_t worker, uint64_t prefix_key)
{
    uint32_t n = km_active_prefix_sharers(s->active, worker, prefix_key);
    if (s->cluster)
        n += km_cluster_remote_prefix_sharers(s->cluster, worker, prefix_key);
    return n;
}

uint32_t km_srv_cluster_queued_depth(km_server *s, uint32_t worker, const uint64_t *hashes,
                                     uint32_t n, uint32_t from)
{
    /* A block promised here and the next one promised by another instance both extend it. */
    uint32_t depth = km_active_queued_depth(s->active, worker, hashes, n, from);
    while (s->cluster && depth < n) {
        uint32_t more = km_cluster_remote_queued_depth(s->cluster, worker, hashes, n, depth);
        if (more == depth)
            break;
        depth = km_active_queued_depth(s->active, worker, hashes, n, more);
    }
    return depth;
}

void km_srv_cluster_publish_all(km_server *s)
{
    for (uint32_t w = 0; s->cluster && w < s->cfg.max_workers; w++)
        km_srv_cluster_publish(s, w);
}

void km_srv_cluster_add_load(km_server *s, uint32_t worker, km_active_load *load)
{
    if (s->cluster)
        km_cluster_add_remote_load(s->cluster, worker, load);
}

void km_srv_cluster_label(km_server *s, uint64_t now, srv_load_view *v)
{
    memset(v, 0, sizeof *v);
    v->scope = KM_ACTIVE_LOAD_SCOPE;
    v->oldest_age_ms = NAN;
    km_cluster_view cv;
    if (!s->cluster || km_cluster_get_view(s->cluster, now, &cv) != KM_OK)
        return;
    v->scope = cv.scope;
    v->instances = cv.instances;
    v->oldest_age_ms = cv.oldest_age_ms;
    size_t at = 0;
    for (uint32_t i = 0; i < cv.n_stale && i < 8; i++) {
        int n = snprintf(v->stale + at, sizeof v->stale - at, "%s%s", i ? "," : "", cv.stale[i]);
        if (n < 0 || (size_t)n >= sizeof v->stale - at)
            break;
        at += (size_t)n;
    }
}

/* /status "cluster": null without one. */
json_t *km_srv_cluster_status(km_server *s)
{
    if (!s->cluster)
        return json_null();
    /* The view first: it drops the contributions silent past expire_ms, so the counts that
     * follow have none of them either. */
    srv_load_view v;
    km_srv_cluster_label(s, now_ns(), &v);
    km_cluster_stats st;
    if (km_cluster_get_stats(s->cluster, &st) != KM_OK)
        return json_null();
    json_t *o = json_object();
    json_object_set_new(o, "instance", json_string(s->cfg.cluster_instance));
    json_object_set_new(o, "connected", json_boolean(st.connected));
    json_object_set_new(o, "synced", json_boolean(st.synced));
    json_object_set_new(o, "sync_seconds", isnan(st.sync_seconds) ? json_null()
                                                                  : json_real(st.sync_seconds));
    json_object_set_new(o, "sync_peers", json_integer(st.sync_peers));
    json_object_set_new(o, "load_scope", json_string(v.scope));
    json_object_set_new(o, "instances", json_integer(v.instances));
    json_object_set_new(o, "oldest_age_ms", isnan(v.oldest_age_ms) ? json_null()
                                                                   : json_real(v.oldest_age_ms));
    json_t *stale = json_array();
    for (char *p = v.stale; *p;) {
        char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        json_array_append_new(stale, json_stringn(p, n));
        p += n + (comma != NULL);
    }
    json_object_set_new(o, "stale_instances", stale);
    json_object_set_new(o, "sent", json_integer((json_int_t)st.sent));
    json_object_set_new(o, "applied", json_integer((json_int_t)st.applied));
    json_object_set_new(o, "lost_messages", json_integer((json_int_t)st.lost_messages));
    json_object_set_new(o, "expired_instances", json_integer((json_int_t)st.expired_instances));
    json_object_set_new(o, "restarted_instances",
                        json_integer((json_int_t)st.restarted_instances));
    json_object_set_new(o, "publish_failures", json_integer((json_int_t)st.publish_failures));
    json_object_set_new(o, "publish_outbox_full",
                        json_integer((json_int_t)st.publish_outbox_full));
    json_object_set_new(o, "publish_too_large", json_integer((json_int_t)st.publish_too_large));
    json_object_set_new(o, "skipped_disconnected",
                        json_integer((json_int_t)st.skipped_disconnected));
    json_object_set_new(o, "reconnects", json_integer((json_int_t)st.reconnects));
    json_object_set_new(o, "sync_requests", json_integer((json_int_t)st.sync_requests));
    json_object_set_new(o, "sync_answers", json_integer((json_int_t)st.sync_answers));
    json_t *work = json_object();
    json_object_set_new(work, "remote_held", json_integer((json_int_t)st.remote_work));
    json_object_set_new(work, "truncated", json_integer((json_int_t)st.work_truncated));
    json_object_set_new(work, "omitted_messages", json_integer((json_int_t)st.work_omitted));
    json_object_set_new(o, "work", work);
    json_t *refused = json_object();
    for (unsigned r = 0; r < KM_CLUSTER_REFUSAL_COUNT; r++)
        json_object_set_new(refused, km_cluster_refusal_name((km_cluster_refusal)r),
                            json_integer((json_int_t)st.refused[r]));
    json_object_set_new(o, "refused", refused);
    json_object_set_new(o, "last_refusal", json_string(st.last_refusal));
    json_object_set_new(o, "nats_errors", json_integer((json_int_t)st.nats_errors));
    json_object_set_new(o, "nats_slow_consumer", json_integer((json_int_t)st.nats_slow_consumer));
    json_object_set_new(o, "last_nats_error", json_string(st.last_nats_error));
    json_t *pred = json_object();
    pthread_mutex_lock(&s->predictions_lock);
    json_object_set_new(pred, "sent", json_integer((json_int_t)st.predictions_sent));
    json_object_set_new(pred, "received", json_integer((json_int_t)st.predictions_received));
    json_object_set_new(pred, "applied", json_integer((json_int_t)s->predictions_applied));
    json_object_set_new(pred, "ignored_observed",
                        json_integer((json_int_t)s->predictions_observed));
    json_object_set_new(pred, "refused", json_integer((json_int_t)s->predictions_refused));
    json_object_set_new(pred, "dropped", json_integer((json_int_t)s->predictions_dropped));
    json_object_set_new(pred, "last_refusal", json_string(s->predictions_last_refusal));
    pthread_mutex_unlock(&s->predictions_lock);
    json_object_set_new(o, "predictions", pred);
    json_t *mismatched = json_array();
    for (uint32_t i = 0; i < st.n_mismatched && i < 8; i++) {
        char theirs[17], ours[17];
        snprintf(theirs, sizeof theirs, "%016" PRIx64, st.mismatched[i].theirs);
        snprintf(ours, sizeof ours, "%016" PRIx64, st.mismatched[i].ours);
        json_array_append_new(mismatched,
                              json_pack("{s:s, s:s, s:s, s:s}", "instance",
                                        st.mismatched[i].instance, "pool", st.mismatched[i].pool,
                                        "their_fingerprint", theirs, "fingerprint", ours));
    }
    json_object_set_new(o, "mismatched_pools", mismatched);
    json_object_set_new(o, "mismatched_pools_total", json_integer(st.n_mismatched));
    return o;
}

/* The kvmatch_cluster_* series (none without a cluster). */
void km_srv_cluster_metrics(km_server *s, km_text *out)
{
    if (!s->cluster)
        return;
    /* The view first, as in /status: instances and stale_instances count the same peers. */
    srv_load_view v;
    km_srv_cluster_label(s, now_ns(), &v);
    km_cluster_stats st;
    if (km_cluster_get_stats(s->cluster, &st) != KM_OK)
        return;
    static const struct {
        const char *name, *help;
        km_metric_type type;
    } fam[] = {
        {"kvmatch_cluster_connected", "1 while the NATS connection is up.", KM_METRIC_GAUGE},
        {"kvmatch_cluster_instances", "Remote instances whose load is applied.", KM_METRIC_GAUGE},
        {"kvmatch_cluster_stale_instances", "Of them, stale (a lost message, or NATS down).",
         KM_METRIC_GAUGE},
        {"kvmatch_cluster_oldest_contribution_age_seconds",
         "Since the oldest applied contribution's last message (0 when none).", KM_METRIC_GAUGE},
        {"kvmatch_cluster_sync_seconds", "How long taking the peers' state took at start.",
         KM_METRIC_GAUGE},
        {"kvmatch_cluster_mismatched_pools",
         "(instance, pool) pairs whose workers differ from this instance's (fingerprints): that "
         "instance's load on the pool's workers and its predictions for it are left out.",
         KM_METRIC_GAUGE},
        {"kvmatch_cluster_messages_sent_total", "Messages this instance handed to NATS.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_messages_applied_total", "Remote load messages applied.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_lost_messages_total", "Remote messages detected lost (sequence gaps).",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_expired_instances_total", "Contributions dropped for silence.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_publish_failures_total", "Publishes that did not go out.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_publish_outbox_full_total",
         "Of the publishes that did not go out, those a full outbox dropped.", KM_METRIC_COUNTER},
        {"kvmatch_cluster_publish_too_large_total",
         "Of the publishes that did not go out, those over the server's max_payload.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_sync_requests_total", "Sync requests of other instances received.",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_sync_answers_total",
         "States published in answer to sync requests (one answers every request before it).",
         KM_METRIC_COUNTER},
        {"kvmatch_cluster_nats_errors_total",
         "Errors the NATS client reported outside any call (permissions, slow consumer, ...).",
         KM_METRIC_COUNTER},
    };
    double values[] = {st.connected,
                       v.instances,
                       st.stale_instances,
                       isnan(v.oldest_age_ms) ? 0.0 : v.oldest_age_ms / 1e3,
                       isnan(st.sync_seconds) ? 0.0 : st.sync_seconds,
                       st.n_mismatched,
                       (double)st.sent,
                       (double)st.applied,
                       (double)st.lost_messages,
                       (double)st.expired_instances,
                       (double)st.publish_failures,
                       (double)st.publish_outbox_full,
                       (double)st.publish_too_large,
                       (double)st.sync_requests,
                       (double)st.sync_answers,
                       (double)st.nats_errors};
    for (size_t i = 0; i < sizeof fam / sizeof fam[0]; i++) {
        km_prom_write_family(out, fam[i].name, fam[i].help, fam[i].type);
        km_prom_write_sample(out, fam[i].name, NULL, 0, values[i]);
    }
    static const char predictions[] = "kvmatch_cluster_predictions_total";
    km_prom_write_family(out, predictions,
                         "Approximate-mode predictions shared between instances, by outcome "
                         "(sent by this one; received, applied, ignored for KV events, refused "
                         "for an unknown pool or worker, dropped when too many were queued or "
                         "the index refused them).",
                         KM_METRIC_COUNTER);
    pthread_mutex_lock(&s->predictions_lock);
    const struct {
        const char *outcome;
        uint64_t n;
    } pred[] = {{"sent", st.predictions_sent},
                {"received", st.predictions_received},
                {"applied", s->predictions_applied},
                {"ignored_observed", s->predictions_observed},
                {"refused", s->predictions_refused},
                {"dropped", s->predictions_dropped}};
    pthread_mutex_unlock(&s->predictions_lock);
    for (size_t i = 0; i < sizeof pred / sizeof pred[0]; i++) {
        km_metric_label l = {"outcome", pred[i].outcome};
        km_prom_write_sample_u64(out, predictions, &l, 1, pred[i].n);
    }
    static const char refused[] = "kvmatch_cluster_refused_messages_total";
    km_prom_write_family(out, refused, "Messages on the cluster subjects refused, by reason.",
                         KM_METRIC_COUNTER);
    for (unsigned r = 0; r < KM_CLUSTER_REFUSAL_COUNT; r++) {
        km_metric_label l = {"reason", km_cluster_refusal_name((km_cluster_refusal)r)};
        km_prom_write_sample_u64(out, refused, &l, 1, st.refused[r]);
    }
}

/* ---- engine-reported load --------------------------------------------------------------------- */

void km_srv_engine_metrics_target(km_server *s, uint32_t id, const char *url)
{
    if (!url && !s->engine_metrics)
        return;
    if (!s->engine_metrics) {
        km_engine_metrics_config cfg;
        km_engine_metrics_config_init(&cfg);
        cfg.max_workers = s->cfg.max_workers;
        if (s->cfg.engine_metrics_interval_ms)
            cfg.interval_ms = s->cfg.engine_metrics_interval_ms;
        if (s->cfg.engine_metrics_timeout_ms)
            cfg.timeout_ms = s->cfg.engine_metrics_timeout_ms;
        cfg.log = s->log;
        cfg.log_user = s->log_user;
        char why[200];
        if (km_engine_metrics_create(&cfg, &s->engine_metrics, why, sizeof why) != KM_OK) {
            km_srv_log(s, KM_LOG_WARNING
                       "engine metrics: %s; worker %u is served without them", why, id);
            return;
        }
    }
    int rc = km_engine_metrics_set_target(s->engine_metrics, id, url);
    if (rc != KM_OK)
        km_srv_log(s, KM_LOG_WARNING "engine metrics: worker %u: %s", id, km_strerror(rc));
}

uint64_t km_srv_engine_max_age_ns(const km_server *s)
{
    uint64_t ms = s->cfg.engine_metrics_max_age_ms;
    if (!ms)
        ms = 3u * (uint64_t)(s->cfg.engine_metrics_interval_ms ? s->cfg.engine_metrics_interval_ms
                                                                : 1000u);
    return ms * UINT64_C(1000000);
}

bool km_srv_engine_reported_fresh(km_server *s, uint32_t id, uint64_t now, km_engine_reported *out)
{
    return s->engine_metrics && km_engine_metrics_get(s->engine_metrics, id, out) == KM_OK &&
           km_engine_reported_age_ns(out, now) < km_srv_engine_max_age_ns(s);
}

json_t *km_srv_engine_reported_status(km_server *s, uint32_t id, uint64_t now, bool *fresh)
{
    km_engine_reported l;
    *fresh = km_srv_engine_reported_fresh(s, id, now, &l);
    if (!s->engine_metrics || km_engine_metrics_get(s->engine_metrics, id, &l) != KM_OK)
        return json_null();
    json_t *o = json_object();
    json_object_set_new(o, "used_by_decisions", json_boolean(*fresh));
#define REAL_OR_NULL(x) (isnan(x) ? json_null() : json_real(x))
    json_object_set_new(o, "engine", l.engine ? json_string(l.engine) : json_null());
    json_object_set_new(o, "running", REAL_OR_NULL(l.running));
    json_object_set_new(o, "waiting", REAL_OR_NULL(l.waiting));
    json_object_set_new(o, "kv_usage", REAL_OR_NULL(l.kv_usage));
#undef REAL_OR_NULL
    uint64_t age = km_engine_reported_age_ns(&l, now);
    json_object_set_new(o, "age_ms", age != UINT64_MAX ? json_real((double)age / 1e6) : json_null());
    json_object_set_new(o, "scrapes", json_integer((json_int_t)l.scrapes));
    json_object_set_new(o, "failures", json_integer((json_int_t)l.failures));
    json_object_set_new(o, "last_error", json_string(l.last_error));
    return o;
}
