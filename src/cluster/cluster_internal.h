/* Internal to src/cluster/: the wire messages of the cluster protocol (docs/CLUSTER.md,
 * "Messages") as structures, their encoder and their decoder. The decoder takes untrusted bytes
 * and either fills a message whose every field is in range or refuses it with a reason; the
 * encoder writes exactly what the decoder accepts. */
#ifndef KM_CLUSTER_INTERNAL_H
#define KM_CLUSTER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/active.h"
#include "kvmatch/cluster.h"
#include "kvmatch/text.h"

#define KM_CLUSTER_PROTOCOL_VERSION 1

typedef enum cluster_kind {
    CLUSTER_CHANGE, /* some workers' new absolute load, next sequence number */
    CLUSTER_STATE,  /* every worker's load (absent = 0), next sequence number; replaces all */
    CLUSTER_SYNC,   /* a new instance asks every peer for its state now; no sequence number */
    CLUSTER_PREDICT, /* one approximate-mode prediction (pool, worker, hashes), next sequence
                      * number; changes no load */
} cluster_kind;

/* A decoded worker row without a work row. */
#define CLUSTER_NO_WORK_ROW UINT32_MAX

typedef struct cluster_worker_load {
    uint32_t worker;
    km_active_load load;
    /* Decoded messages: the index of this worker's row in `work`, or CLUSTER_NO_WORK_ROW (the
     * encoder does not read it). */
    uint32_t work_row;
} cluster_worker_load;

/* What a worker's in-flight requests promise a later request there (the parts of km_active a
 * ttft decision reads beyond the load): the shared-prefix key each declared
 * (km_active_share_prefix; one per request, so a key listed k times has k sharers) and the block
 * hashes their queued prefills will store (km_active_queue_blocks). */
typedef struct cluster_worker_work {
    uint32_t worker;
    uint64_t *prefixes; /* n_prefixes <= KM_CLUSTER_WORK_MAX_PREFIXES */
    uint32_t n_prefixes;
    uint64_t *queued;   /* n_queued <= KM_CLUSTER_WORK_MAX_QUEUED */
    uint32_t n_queued;
} cluster_worker_work;

typedef struct cluster_pool_fingerprint {
    char name[KM_CLUSTER_POOL_MAX + 1];
    uint64_t fingerprint;
} cluster_pool_fingerprint;

typedef struct cluster_message {
    cluster_kind kind;
    char instance[KM_CLUSTER_INSTANCE_MAX + 1];
    uint64_t incarnation;
    uint64_t seq;
    cluster_worker_load *workers; /* malloc'd by the decoder, n_workers of them */
    uint32_t n_workers;
    /* CHANGE and STATE: the in-flight work of workers listed in `workers` (each at most once; a
     * listed worker without a row has none); malloc'd by the decoder with its arrays */
    cluster_worker_work *work;
    uint32_t n_work;
    /* Decoded messages: how many worker lookups matching the work rows to the workers took
     * (linear in the rows: the tests check it) */
    uint64_t work_lookups;
    char (*peers)[KM_CLUSTER_INSTANCE_MAX + 1]; /* malloc'd by the decoder; STATE only */
    uint32_t n_peers;
    /* STATE only: the sender's pools (at most KM_CLUSTER_MAX_POOLS; malloc'd by the decoder) */
    cluster_pool_fingerprint *pools;
    uint32_t n_pools;
    /* PREDICT only: */
    char pool[KM_CLUSTER_POOL_MAX + 1];
    uint32_t worker;
    bool lesson;
    uint64_t *hashes; /* malloc'd by the decoder, n_hashes of them (1..PREDICTION_MAX_HASHES) */
    uint32_t n_hashes;
} cluster_message;

/* Is `name` a pool name a prediction may carry (1..KM_CLUSTER_POOL_MAX bytes of
 * [A-Za-z0-9._-], the service's pool names)? */
bool km_cluster_pool_name_valid(const char *name, size_t len);

/* Is `id` a valid instance id (1..KM_CLUSTER_INSTANCE_MAX bytes of [A-Za-z0-9_-])? */
bool km_cluster_id_valid(const char *id, size_t len);

/* The subject a message of `kind` from `instance` goes to: PREFIX.change.ID, PREFIX.state.ID,
 * PREFIX.predict.ID, PREFIX.sync. */
int km_cluster_subject(km_text *out, const char *prefix, cluster_kind kind, const char *instance);

/* Encode m as one JSON object into out (cleared first). KM_ERR_TOO_LARGE past max_bytes (at most
 * KM_CLUSTER_MESSAGE_MAX: the server's max_payload when lower), KM_ERR_OUT_OF_MEMORY. */
int km_cluster_encode(km_text *out, const cluster_message *m, size_t max_bytes);

/* Decode `data` received on `subject` (PREFIX already stripped by the caller: "change.ID",
 * "state.ID", "predict.ID" or "sync") into *m; worker ids must be < max_workers. On success the
 * caller frees with km_cluster_message_free. On refusal returns false with *refusal and a sentence
 * in why, and *m holds nothing to free. */
bool km_cluster_decode(const char *subject, const char *data, size_t len, uint32_t max_workers,
                       cluster_message *m, km_cluster_refusal *refusal, char *why,
                       size_t why_size);
void km_cluster_message_free(cluster_message *m);

#endif
