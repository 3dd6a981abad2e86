/* The cluster protocol's wire messages: JSON objects, encoded by hand into a km_text and decoded
 * with jansson within hard limits (size, worker ids, peer count), each refusal named. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "base/error_detail.h"
#include "cluster/cluster_internal.h"

static const char *const KIND_NAMES[] = {"change", "state", "sync", "predict"};

bool km_cluster_id_valid(const char *id, size_t len)
{
    if (!id || len == 0 || len > KM_CLUSTER_INSTANCE_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = id[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

bool km_cluster_pool_name_valid(const char *name, size_t len)
{
    if (!name || len == 0 || len > KM_CLUSTER_POOL_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

int km_cluster_subject(km_text *out, const char *prefix, cluster_kind kind, const char *instance)
{
    km_text_clear(out);
    if (kind == CLUSTER_SYNC)
        return km_text_printf(out, "%s.sync", prefix);
    return km_text_printf(out, "%s.%s.%s", prefix, KIND_NAMES[kind], instance);
}

/* hashes[0..n) as comma-separated "16 hex digits" strings. By hand, a chunk at a time: a
 * prediction goes out at every approximate-mode decision, and a printf per hash costs several
 * times the rest of the message. */
static int append_hashes(km_text *out, const uint64_t *hashes, uint32_t n)
{
    static const char HEX[] = "0123456789abcdef";
    char chunk[64 * 19];
    int rc = KM_OK;
    for (uint32_t i = 0; rc == KM_OK && i < n;) {
        size_t at = 0;
        for (uint32_t end = i + 64 < n ? i + 64 : n; i < end; i++) {
            if (i)
                chunk[at++] = ',';
            chunk[at++] = '"';
            for (int d = 15; d >= 0; d--)
                chunk[at + (size_t)(15 - d)] = HEX[(hashes[i] >> (4 * d)) & 0xf];
            at += 16;
            chunk[at++] = '"';
        }
        rc = km_text_append(out, chunk, at);
    }
    return rc;
}

/* ,"work":[[worker,[prefix keys],[queued hashes]],...] when any row is there. */
static int append_work(km_text *out, const cluster_message *m)
{
    if (m->n_work == 0)
        return KM_OK;
    int rc = km_text_append_cstr(out, ",\"work\":[");
    for (uint32_t i = 0; rc == KM_OK && i < m->n_work; i++) {
        const cluster_worker_work *w = &m->work[i];
        rc = km_text_printf(out, "%s[%" PRIu32 ",[", i ? "," : "", w->worker);
        if (rc == KM_OK)
            rc = append_hashes(out, w->prefixes, w->n_prefixes);
        if (rc == KM_OK)
            rc = km_text_append_cstr(out, "],[");
        if (rc == KM_OK)
            rc = append_hashes(out, w->queued, w->n_queued);
        if (rc == KM_OK)
            rc = km_text_append_cstr(out, "]]");
    }
    if (rc == KM_OK)
        rc = km_text_append_cstr(out, "]");
    return rc;
}

/* A load value as sent: at most KM_CLUSTER_LOAD_VALUE_MAX, the most a receiver accepts. */
static uint64_t load_cap(uint64_t v)
{
    return v < KM_CLUSTER_LOAD_VALUE_MAX ? v : KM_CLUSTER_LOAD_VALUE_MAX;
}

int km_cluster_encode(km_text *out, const cluster_message *m, size_t max_bytes)
{
    km_text_clear(out);
    int rc = km_text_printf(out,
                            "{\"v\":%d,\"kind\":\"%s\",\"instance\":\"%s\",\"incarnation\":%" PRIu64,
                            KM_CLUSTER_PROTOCOL_VERSION, KIND_NAMES[m->kind], m->instance,
                            m->incarnation);
    if (rc == KM_OK && m->kind == CLUSTER_PREDICT) {
        /* Hashes are 64-bit unsigned: JSON integers past 2^63 do not survive every parser, so
         * each is 16 lowercase hex digits. */
        rc = km_text_printf(out,
                            ",\"seq\":%" PRIu64 ",\"pool\":\"%s\",\"worker\":%" PRIu32
                            ",\"lesson\":%s,\"hashes\":[",
                            m->seq, m->pool, m->worker, m->lesson ? "true" : "false");
        if (rc == KM_OK)
            rc = append_hashes(out, m->hashes, m->n_hashes);
        if (rc == KM_OK)
            rc = km_text_append_cstr(out, "]");
    } else if (rc == KM_OK && m->kind != CLUSTER_SYNC) {
        rc = km_text_printf(out, ",\"seq\":%" PRIu64 ",\"workers\":[", m->seq);
        for (uint32_t i = 0; rc == KM_OK && i < m->n_workers; i++) {
            const km_active_load *l = &m->workers[i].load;
            rc = km_text_printf(out,
                                "%s[%" PRIu32 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64
                                ",%" PRIu64 ",%" PRIu64 "]",
                                i ? "," : "", m->workers[i].worker, load_cap(l->in_flight),
                                load_cap(l->prefilling), load_cap(l->pending_prefill_tokens),
                                load_cap(l->active_decode_blocks), load_cap(l->allocated_blocks),
                                load_cap(l->pending_prefill_pairs));
        }
        if (rc == KM_OK)
            rc = km_text_append_cstr(out, "]");
        if (rc == KM_OK)
            rc = append_work(out, m);
        if (rc == KM_OK && m->kind == CLUSTER_STATE) {
            rc = km_text_append_cstr(out, ",\"peers\":[");
            for (uint32_t i = 0; rc == KM_OK && i < m->n_peers; i++)
                rc = km_text_printf(out, "%s\"%s\"", i ? "," : "", m->peers[i]);
            if (rc == KM_OK)
                rc = km_text_append_cstr(out, "],\"pools\":[");
            for (uint32_t i = 0; rc == KM_OK && i < m->n_pools; i++)
                rc = km_text_printf(out, "%s[\"%s\",\"%016" PRIx64 "\"]", i ? "," : "",
                                    m->pools[i].name, m->pools[i].fingerprint);
            if (rc == KM_OK)
                rc = km_text_append_cstr(out, "]");
        }
    }
    if (rc == KM_OK)
        rc = km_text_append_cstr(out, "}");
    if (rc == KM_OK && (out->length > KM_CLUSTER_MESSAGE_MAX || out->length > max_bytes))
        rc = KM_ERR_TOO_LARGE;
    return rc;
}

void km_cluster_message_free(cluster_message *m)
{
    if (!m)
        return;
    free(m->workers);
    free(m->peers);
    free(m->hashes);
    free(m->pools);
    for (uint32_t i = 0; m->work && i < m->n_work; i++) {
        free(m->work[i].prefixes);
        free(m->work[i].queued);
    }
    free(m->work);
    m->work = NULL;
    m->n_work = 0;
    m->workers = NULL;
    m->peers = NULL;
    m->hashes = NULL;
    m->pools = NULL;
    m->n_workers = m->n_peers = m->n_hashes = m->n_pools = 0;
}

static bool refuse(km_cluster_refusal *refusal, km_cluster_refusal r, char *why, size_t why_size,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static bool refuse(km_cluster_refusal *refusal, km_cluster_refusal r, char *why, size_t why_size,
                   const char *fmt, ...)
{
    *refusal = r;
    if (why && why_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, why_size, fmt, ap);
        va_end(ap);
    }
    return false;
}

/* A non-negative JSON integer member into *out; false when absent or not one. */
static bool member_u64(json_t *obj, const char *key, uint64_t *out)
{
    json_t *v = json_object_get(obj, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static bool decode_workers(json_t *arr, uint32_t max_workers, cluster_message *m,
                           km_cluster_refusal *refusal, char *why, size_t why_size)
{
    if (!json_is_array(arr))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"workers\" is missing or not an array");
    size_t n = json_array_size(arr);
    if (n > max_workers)
        return refuse(refusal, KM_CLUSTER_REFUSED_WORKER, why, why_size,
                      "%zu workers listed, at most %u exist", n, max_workers);
    m->workers = n ? calloc(n, sizeof *m->workers) : NULL;
    if (n && !m->workers)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *row = json_array_get(arr, i);
        uint64_t v[7];
        if (!json_is_array(row) || json_array_size(row) != 7)
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "workers[%zu] is not an array of 7 integers", i);
        for (size_t k = 0; k < 7; k++) {
            json_t *x = json_array_get(row, k);
            if (!json_is_integer(x) || json_integer_value(x) < 0)
                return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                              "workers[%zu][%zu] is not a non-negative integer", i, k);
            v[k] = (uint64_t)json_integer_value(x);
        }
        for (size_t k = 1; k < 7; k++)
            if (v[k] > KM_CLUSTER_LOAD_VALUE_MAX)
                return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                              "workers[%zu][%zu] is %" PRIu64 ", over 2^48", i, k, v[k]);
        if (v[0] >= max_workers)
            return refuse(refusal, KM_CLUSTER_REFUSED_WORKER, why, why_size,
                          "worker %" PRIu64 " is out of range (max_workers %u)", v[0],
                          max_workers);
        if (v[2] > v[1])
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "worker %" PRIu64 ": prefilling %" PRIu64 " > in_flight %" PRIu64, v[0],
                          v[2], v[1]);
        m->workers[i].worker = (uint32_t)v[0];
        m->workers[i].load = (km_active_load){v[1], v[2], v[3], v[4], v[5], v[6]};
        m->workers[i].work_row = CLUSTER_NO_WORK_ROW;
        m->n_workers = (uint32_t)i + 1;
    }
    return true;
}

static bool decode_peers(json_t *arr, cluster_message *m, km_cluster_refusal *refusal, char *why,
                         size_t why_size)
{
    if (!json_is_array(arr))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"peers\" is missing or not an array");
    size_t n = json_array_size(arr);
    if (n > KM_CLUSTER_MAX_INSTANCES)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_MANY, why, why_size,
                      "%zu peers listed, at most %u", n, KM_CLUSTER_MAX_INSTANCES);
    m->peers = n ? calloc(n, sizeof *m->peers) : NULL;
    if (n && !m->peers)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *p = json_array_get(arr, i);
        if (!json_is_string(p) || !km_cluster_id_valid(json_string_value(p), json_string_length(p)))
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "peers[%zu] is not an instance id", i);
        memcpy(m->peers[i], json_string_value(p), json_string_length(p) + 1);
        m->n_peers = (uint32_t)i + 1;
    }
    return true;
}

/* One 16-hex-digit hash string into *out. */
static bool hex_hash(json_t *v, uint64_t *out)
{
    if (!json_is_string(v) || json_string_length(v) != 16)
        return false;
    const char *p = json_string_value(v);
    uint64_t h = 0;
    for (int i = 0; i < 16; i++) {
        char c = p[i];
        unsigned d;
        if (c >= '0' && c <= '9')
            d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            d = (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            d = (unsigned)(c - 'A' + 10);
        else
            return false;
        h = h << 4 | d;
    }
    *out = h;
    return true;
}

/* An array of at most `max` "16 hex digits" strings into a malloc'd *out (NULL when empty). */
static bool decode_hash_list(json_t *arr, uint32_t max, uint64_t **out, uint32_t *n_out,
                             const char *what, size_t row, km_cluster_refusal *refusal, char *why,
                             size_t why_size)
{
    if (!json_is_array(arr))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "work[%zu]: %s is not an array", row, what);
    size_t n = json_array_size(arr);
    if (n > max)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size,
                      "work[%zu]: %zu %s, at most %u", row, n, what, max);
    if (n == 0)
        return true;
    if (!(*out = malloc(n * sizeof **out)))
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (!hex_hash(json_array_get(arr, i), &(*out)[i]))
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "work[%zu]: %s[%zu] is not 16 hex digits", row, what, i);
        *n_out = (uint32_t)i + 1;
    }
    return true;
}

/* A change's or state's "work": [[worker, [prefix keys], [queued hashes]], ...]; absent = none.
 * Each row's worker must be one the message lists in "workers", at most once; each worker row
 * gets the index of its work row. Linear in the rows: one array indexed by worker id (below
 * max_workers, which decode_workers checked) holds each listed worker's row. */
static bool decode_work(json_t *arr, cluster_message *m, km_cluster_refusal *refusal, char *why,
                        size_t why_size)
{
    if (!arr)
        return true;
    if (!json_is_array(arr))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"work\" is not an array");
    size_t n = json_array_size(arr);
    if (n > m->n_workers)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "%zu work rows for %u workers listed", n, m->n_workers);
    if (n == 0)
        return true;
    m->work = calloc(n, sizeof *m->work);
    /* row_of[worker]: NOT_LISTED, CLUSTER_NO_WORK_ROW (listed, no row yet) or its row */
    enum { NOT_LISTED = CLUSTER_NO_WORK_ROW - 1 };
    uint32_t ids = 0;
    for (uint32_t k = 0; k < m->n_workers; k++)
        ids = m->workers[k].worker >= ids ? m->workers[k].worker + 1 : ids;
    uint32_t *row_of = malloc((size_t)ids * sizeof *row_of);
    if (!m->work || !row_of) {
        free(row_of);
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    }
    for (uint32_t w = 0; w < ids; w++)
        row_of[w] = NOT_LISTED;
    for (uint32_t k = 0; k < m->n_workers; k++, m->work_lookups++)
        row_of[m->workers[k].worker] = CLUSTER_NO_WORK_ROW;
    bool ok = true;
    for (size_t i = 0; ok && i < n; i++) {
        json_t *row = json_array_get(arr, i), *worker = json_array_get(row, 0);
        if (!json_is_array(row) || json_array_size(row) != 3 || !json_is_integer(worker) ||
            json_integer_value(worker) < 0) {
            ok = refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                        "work[%zu] is not [worker, [prefix keys], [queued hashes]]", i);
            break;
        }
        uint64_t w = (uint64_t)json_integer_value(worker);
        m->work_lookups++;
        if (w >= ids || row_of[w] != CLUSTER_NO_WORK_ROW) {
            ok = refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                        "work[%zu]: worker %" PRIu64 " is not listed in \"workers\" or has two "
                        "rows", i, w);
            break;
        }
        row_of[w] = (uint32_t)i;
        cluster_worker_work *out = &m->work[i];
        out->worker = (uint32_t)w;
        m->n_work = (uint32_t)i + 1;
        ok = decode_hash_list(json_array_get(row, 1), KM_CLUSTER_WORK_MAX_PREFIXES,
                              &out->prefixes, &out->n_prefixes, "prefix keys", i, refusal, why,
                              why_size) &&
             decode_hash_list(json_array_get(row, 2), KM_CLUSTER_WORK_MAX_QUEUED, &out->queued,
                              &out->n_queued, "queued hashes", i, refusal, why, why_size);
    }
    for (uint32_t k = 0; ok && k < m->n_workers; k++)
        m->workers[k].work_row = row_of[m->workers[k].worker];
    free(row_of);
    return ok;
}

/* A state's "pools": [[name, 16 hex digits], ...]; absent = none listed. */
static bool decode_pools(json_t *arr, cluster_message *m, km_cluster_refusal *refusal, char *why,
                         size_t why_size)
{
    if (!arr)
        return true;
    if (!json_is_array(arr))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"pools\" is not an array");
    size_t n = json_array_size(arr);
    if (n > KM_CLUSTER_MAX_POOLS)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size,
                      "%zu pools listed, at most %u", n, KM_CLUSTER_MAX_POOLS);
    m->pools = n ? calloc(n, sizeof *m->pools) : NULL;
    if (n && !m->pools)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *row = json_array_get(arr, i), *name = json_array_get(row, 0);
        if (!json_is_array(row) || json_array_size(row) != 2 || !json_is_string(name) ||
            !km_cluster_pool_name_valid(json_string_value(name), json_string_length(name)) ||
            !hex_hash(json_array_get(row, 1), &m->pools[i].fingerprint))
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "pools[%zu] is not [pool name, 16 hex digits]", i);
        memcpy(m->pools[i].name, json_string_value(name), json_string_length(name) + 1);
        m->n_pools = (uint32_t)i + 1;
    }
    return true;
}

static bool decode_prediction(json_t *root, uint32_t max_workers, cluster_message *m,
                              km_cluster_refusal *refusal, char *why, size_t why_size)
{
    json_t *pool = json_object_get(root, "pool");
    if (!json_is_string(pool) ||
        !km_cluster_pool_name_valid(json_string_value(pool), json_string_length(pool)))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"pool\" is missing or not a pool name (1 to %u of A-Z a-z 0-9 . _ -)",
                      KM_CLUSTER_POOL_MAX);
    memcpy(m->pool, json_string_value(pool), json_string_length(pool) + 1);
    uint64_t worker;
    if (!member_u64(root, "worker", &worker))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"worker\" is missing or not a non-negative integer");
    if (worker >= max_workers)
        return refuse(refusal, KM_CLUSTER_REFUSED_WORKER, why, why_size,
                      "worker %" PRIu64 " is out of range (max_workers %u)", worker, max_workers);
    m->worker = (uint32_t)worker;
    json_t *lesson = json_object_get(root, "lesson");
    if (!json_is_boolean(lesson))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"lesson\" is missing or not a boolean");
    m->lesson = json_is_true(lesson);
    json_t *arr = json_object_get(root, "hashes");
    if (!json_is_array(arr) || json_array_size(arr) == 0)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"hashes\" is missing, empty or not an array");
    size_t n = json_array_size(arr);
    if (n > KM_CLUSTER_PREDICTION_MAX_HASHES)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size,
                      "%zu hashes, at most %u", n, KM_CLUSTER_PREDICTION_MAX_HASHES);
    m->hashes = malloc(n * sizeof *m->hashes);
    if (!m->hashes)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (!hex_hash(json_array_get(arr, i), &m->hashes[i]))
            return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                          "hashes[%zu] is not 16 hex digits", i);
        m->n_hashes = (uint32_t)i + 1;
    }
    return true;
}

static bool decode_object(json_t *root, const char *subject, uint32_t max_workers,
                          cluster_message *m, km_cluster_refusal *refusal, char *why,
                          size_t why_size)
{
    if (!json_is_object(root))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size, "not a JSON object");
    uint64_t version;
    if (!member_u64(root, "v", &version))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size, "no version \"v\"");
    if (version != KM_CLUSTER_PROTOCOL_VERSION)
        return refuse(refusal, KM_CLUSTER_REFUSED_VERSION, why, why_size,
                      "version %" PRIu64 ", this instance speaks %d", version,
                      KM_CLUSTER_PROTOCOL_VERSION);
    const char *kind = json_string_value(json_object_get(root, "kind"));
    json_t *inst = json_object_get(root, "instance");
    if (!kind)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size, "no \"kind\"");
    if (!strcmp(kind, "change"))
        m->kind = CLUSTER_CHANGE;
    else if (!strcmp(kind, "state"))
        m->kind = CLUSTER_STATE;
    else if (!strcmp(kind, "sync"))
        m->kind = CLUSTER_SYNC;
    else if (!strcmp(kind, "predict"))
        m->kind = CLUSTER_PREDICT;
    else
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "unknown kind \"%.40s\"", kind);
    if (!json_is_string(inst) || !km_cluster_id_valid(json_string_value(inst), json_string_length(inst)))
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"instance\" is missing or not an instance id");
    memcpy(m->instance, json_string_value(inst), json_string_length(inst) + 1);
    /* The subject names the kind and (but for sync) the sender: a message on another's subject
     * is refused, so one instance cannot speak for another by mistake. */
    char expect[KM_CLUSTER_INSTANCE_MAX + 16];
    if (m->kind == CLUSTER_SYNC)
        snprintf(expect, sizeof expect, "sync");
    else
        snprintf(expect, sizeof expect, "%s.%s", KIND_NAMES[m->kind], m->instance);
    if (strcmp(subject, expect))
        return refuse(refusal, KM_CLUSTER_REFUSED_SUBJECT, why, why_size,
                      "a %s message from %s on subject \"%.80s\"", kind, m->instance, subject);
    if (!member_u64(root, "incarnation", &m->incarnation) || m->incarnation == 0)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"incarnation\" is missing or not a positive integer");
    if (m->kind == CLUSTER_SYNC)
        return true;
    if (!member_u64(root, "seq", &m->seq) || m->seq == 0)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size,
                      "\"seq\" is missing or not a positive integer");
    if (m->kind == CLUSTER_PREDICT)
        return decode_prediction(root, max_workers, m, refusal, why, why_size);
    if (!decode_workers(json_object_get(root, "workers"), max_workers, m, refusal, why, why_size) ||
        !decode_work(json_object_get(root, "work"), m, refusal, why, why_size))
        return false;
    if (m->kind == CLUSTER_STATE &&
        (!decode_peers(json_object_get(root, "peers"), m, refusal, why, why_size) ||
         !decode_pools(json_object_get(root, "pools"), m, refusal, why, why_size)))
        return false;
    return true;
}

bool km_cluster_decode(const char *subject, const char *data, size_t len, uint32_t max_workers,
                       cluster_message *m, km_cluster_refusal *refusal, char *why,
                       size_t why_size)
{
    memset(m, 0, sizeof *m);
    if (len > KM_CLUSTER_MESSAGE_MAX)
        return refuse(refusal, KM_CLUSTER_REFUSED_TOO_LARGE, why, why_size,
                      "%zu bytes, at most %u", len, KM_CLUSTER_MESSAGE_MAX);
    json_error_t err;
    json_t *root = json_loadb(data, len, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return refuse(refusal, KM_CLUSTER_REFUSED_MALFORMED, why, why_size, "not JSON: %.80s",
                      err.text);
    bool ok = decode_object(root, subject, max_workers, m, refusal, why, why_size);
    json_decref(root);
    if (!ok)
        km_cluster_message_free(m);
    return ok;
}
