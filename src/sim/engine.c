/* SPDX-License-Identifier: Apache-2.0 */
/* The simulated inference engine (src/sim/engine.h, docs/SIM_ENGINE.md). The prefix cache mirrors
 * vLLM v1's BlockPool: a fixed array of blocks, one free queue in LRU order holding both empty and
 * cached blocks (allocation pops its head, evicting a cached block it pops), a map chain hash ->
 * block for the cached ones, reference counts for blocks in use. Events accumulate as packed
 * msgpack and are closed into one message per step. The step scheduler on top admits FCFS and
 * runs continuous batching with the time model of the header. */
#include "sim/engine.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>
#include <xxhash.h>

#include "kvmatch/hash.h"
#include "base/u64_map.h"
#include "base/array.h"
#include "base/error_detail.h"

#define NO_BLOCK UINT32_MAX
#define NO_SLOT UINT32_MAX

typedef struct sim_block {
    uint64_t chain;       /* valid when cached */
    uint64_t engine_hash; /* valid when cached */
    uint32_t ref;         /* requests using it */
    uint32_t prev, next;  /* free-queue links (NO_BLOCK at the ends) */
    bool cached;
    bool in_free;
    /* Cached by the step scheduler when the chunk computing it was scheduled, its BlockStored not
     * yet published (the step has not ended): hits count it, the ground truth does not. */
    bool unpublished;
} sim_block;

typedef enum req_phase {
    REQ_FREE = 0,     /* slot unused */
    REQ_WAITING = 1,  /* scheduler: submitted, not admitted */
    REQ_PREFILL = 2,  /* admitted, prefill not completed */
    REQ_DECODE = 3,   /* prefill completed */
} req_phase;

typedef struct sim_request {
    uint64_t id;
    req_phase phase;
    uint32_t *tokens; /* the prompt's n_tokens, then the known answer's */
    uint32_t n_tokens;
    uint64_t *chains; /* n_chains chain hashes: the full blocks of the prompt and known answer */
    uint32_t n_full;  /* the prompt's full blocks */
    uint32_t n_chains;
    uint32_t *blocks; /* n_blocks block ids, in sequence order */
    uint32_t n_blocks;
    uint32_t held_blocks; /* leading blocks referenced from the cache at admission */
    km_sim_admission admission;
    /* Prompt tokens whose KV exists (the hit, then each computed chunk) and the full blocks up to
     * which the prompt's blocks were cached or found cached already. */
    uint32_t computed;
    uint32_t cached_to;
    uint32_t unpublished_from; /* the first of its blocks cached and not yet published, or
                                * NO_BLOCK */
    /* scheduler */
    uint32_t step_tokens; /* tokens the running step computes for it (a chunk, or 1 decode) */
    uint32_t output_tokens;
    uint32_t generated;
    uint64_t submit_us;
} sim_request;

typedef struct sim_message {
    uint64_t seq, time_us;
    uint32_t n_events;
    uint8_t *payload;
    size_t size;
} sim_message;

typedef enum drive_mode { MODE_UNSET = 0, MODE_CACHE_OPS = 1, MODE_SCHEDULER = 2 } drive_mode;

/* A FIFO of u32 (slot indices) or of any fixed-size item, as a growable ring. */
typedef struct ring {
    void *items;
    size_t item_size, head, count, capacity;
} ring;

struct km_sim_engine {
    km_sim_engine_config cfg;
    km_hash_config hash_cfg;
    char last_error[256];
    drive_mode mode;

    sim_block *blocks;
    uint32_t free_head, free_tail, n_free;
    uint32_t n_cached, n_in_use;
    km_memory map_memory;
    km_u64map cached;   /* chain hash -> block id */
    km_u64map requests; /* request id + 2 -> slot */

    sim_request *slots;
    uint32_t n_slots, slots_capacity;
    uint32_t *free_slots;
    uint32_t n_free_slots;

    /* events of the open step */
    msgpack_sbuffer events;
    uint32_t n_pending_events;
    msgpack_sbuffer payload;
    ring messages; /* sim_message */
    uint8_t *taken_payload;
    uint64_t seq_next;

    /* scheduler */
    ring waiting;      /* u32 slots, FIFO */
    uint32_t *running; /* admitted slots, prefilling or decoding, admission order */
    uint32_t n_running;
    size_t running_capacity;
    uint32_t *step;    /* slots the running step computes, in running order */
    uint32_t n_step;
    size_t step_capacity;
    bool step_active;
    uint64_t step_start_us, step_end_us;
    uint64_t clock_us;
    uint64_t last_submit_us;
    ring completions; /* km_sim_completion */

    km_sim_engine_stats stats;
};

/* ---- errors ----------------------------------------------------------------------------------- */

static int fail(km_sim_engine *e, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(e->last_error, sizeof e->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

const char *km_sim_engine_last_error(const km_sim_engine *engine)
{
    return engine ? engine->last_error : "";
}

/* ---- small containers ------------------------------------------------------------------------- */

static void ring_init(ring *r, size_t item_size)
{
    memset(r, 0, sizeof *r);
    r->item_size = item_size;
}

static int ring_push(ring *r, const void *item)
{
    if (r->count == r->capacity) {
        size_t cap = r->capacity ? r->capacity * 2 : 16;
        uint8_t *fresh = malloc(cap * r->item_size);
        if (!fresh)
            return KM_ERR_OUT_OF_MEMORY;
        for (size_t i = 0; i < r->count; i++)
            memcpy(fresh + i * r->item_size,
                   (uint8_t *)r->items + ((r->head + i) % r->capacity) * r->item_size,
                   r->item_size);
        free(r->items);
        r->items = fresh;
        r->head = 0;
        r->capacity = cap;
    }
    memcpy((uint8_t *)r->items + ((r->head + r->count) % r->capacity) * r->item_size, item,
           r->item_size);
    r->count++;
    return KM_OK;
}

static void *ring_front(const ring *r)
{
    return r->count ? (uint8_t *)r->items + r->head * r->item_size : NULL;
}

static int ring_pop(ring *r, void *out)
{
    if (!r->count)
        return 0;
    if (out)
        memcpy(out, ring_front(r), r->item_size);
    r->head = (r->head + 1) % r->capacity;
    r->count--;
    return 1;
}


/* ---- configuration and time model -------------------------------------------------------------- */

void km_sim_engine_config_init(km_sim_engine_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    km_engine_model_init(&cfg->model);
    cfg->process_seed = 1;
}

/* ---- the free queue (vLLM's FreeKVCacheBlockQueue) --------------------------------------------- */

static void free_queue_remove(km_sim_engine *e, uint32_t b)
{
    sim_block *blk = &e->blocks[b];
    if (blk->prev != NO_BLOCK)
        e->blocks[blk->prev].next = blk->next;
    else
        e->free_head = blk->next;
    if (blk->next != NO_BLOCK)
        e->blocks[blk->next].prev = blk->prev;
    else
        e->free_tail = blk->prev;
    blk->prev = blk->next = NO_BLOCK;
    blk->in_free = false;
    e->n_free--;
}

static void free_queue_append(km_sim_engine *e, uint32_t b)
{
    sim_block *blk = &e->blocks[b];
    blk->prev = e->free_tail;
    blk->next = NO_BLOCK;
    if (e->free_tail != NO_BLOCK)
        e->blocks[e->free_tail].next = b;
    else
        e->free_head = b;
    e->free_tail = b;
    blk->in_free = true;
    e->n_free++;
}

/* Every block empty and free, in id order (a fresh process). */
static void reset_blocks(km_sim_engine *e)
{
    e->free_head = e->free_tail = NO_BLOCK;
    e->n_free = 0;
    for (uint32_t b = 0; b < e->cfg.model.capacity_blocks; b++) {
        memset(&e->blocks[b], 0, sizeof e->blocks[b]);
        e->blocks[b].prev = e->blocks[b].next = NO_BLOCK;
        free_queue_append(e, b);
    }
    e->n_cached = 0;
    e->n_in_use = 0;
    km_u64map_free(&e->cached);
}

/* ---- events ------------------------------------------------------------------------------------- */

static void pack_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

uint64_t km_sim_engine_engine_hash(const km_sim_engine *engine, uint64_t chain_hash)
{
    return XXH3_64bits_withSeed(&chain_hash, sizeof chain_hash, engine->cfg.process_seed);
}

/* ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
 *  lora_name]: vLLM's positional layout, trailing defaults (extra_keys and later) omitted. */
static void emit_stored(km_sim_engine *e, const sim_request *r, uint32_t first, uint32_t end)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &e->events, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 8);
    pack_str(&pk, "BlockStored");
    msgpack_pack_array(&pk, end - first);
    for (uint32_t k = first; k < end; k++)
        msgpack_pack_uint64(&pk, km_sim_engine_engine_hash(e, r->chains[k]));
    if (first > 0)
        msgpack_pack_uint64(&pk, km_sim_engine_engine_hash(e, r->chains[first - 1]));
    else
        msgpack_pack_nil(&pk);
    uint32_t bs = e->cfg.model.block_size;
    msgpack_pack_array(&pk, (end - first) * bs);
    for (size_t t = (size_t)first * bs; t < (size_t)end * bs; t++)
        msgpack_pack_uint32(&pk, r->tokens[t]);
    msgpack_pack_uint32(&pk, bs);
    msgpack_pack_nil(&pk); /* lora_id */
    pack_str(&pk, "GPU");
    msgpack_pack_nil(&pk); /* lora_name */
    e->n_pending_events++;
}

/* ["BlockRemoved", [hash], medium]: vLLM emits one event per evicted block. */
static void emit_removed(km_sim_engine *e, uint64_t engine_hash)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &e->events, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    pack_str(&pk, "BlockRemoved");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint64(&pk, engine_hash);
    pack_str(&pk, "GPU");
    e->n_pending_events++;
}

static void emit_cleared(km_sim_engine *e)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &e->events, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 1);
    pack_str(&pk, "AllBlocksCleared");
    e->n_pending_events++;
}

static int close_step(km_sim_engine *e, uint64_t now_us, int *published_out)
{
    if (published_out)
        *published_out = 0;
    if (e->n_pending_events == 0)
        return KM_OK;
    msgpack_sbuffer_clear(&e->payload);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &e->payload, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)now_us / 1e6);
    msgpack_pack_array(&pk, e->n_pending_events);
    msgpack_sbuffer_write(&e->payload, e->events.data, e->events.size);
    msgpack_pack_uint32(&pk, e->cfg.data_parallel_rank);

    sim_message m = {e->seq_next, now_us, e->n_pending_events, malloc(e->payload.size),
                     e->payload.size};
    if (!m.payload)
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory for a %zu-byte message", e->payload.size);
    memcpy(m.payload, e->payload.data, e->payload.size);
    if (ring_push(&e->messages, &m)) {
        free(m.payload);
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory to queue a message");
    }
    msgpack_sbuffer_clear(&e->events);
    e->n_pending_events = 0;
    e->seq_next++;
    e->stats.messages++;
    e->stats.messages_total++;
    if (published_out)
        *published_out = 1;
    return KM_OK;
}

int km_sim_engine_end_step(km_sim_engine *engine, uint64_t now_us, int *published_out)
{
    engine->last_error[0] = '\0';
    return close_step(engine, now_us, published_out);
}

uint32_t km_sim_engine_pending_events(const km_sim_engine *engine)
{
    return engine->n_pending_events;
}

int km_sim_engine_take_message(km_sim_engine *engine, km_sim_message *out)
{
    sim_message m;
    if (!ring_pop(&engine->messages, &m))
        return 0;
    free(engine->taken_payload);
    engine->taken_payload = m.payload;
    out->seq = m.seq;
    out->time_us = m.time_us;
    out->n_events = m.n_events;
    out->payload = m.payload;
    out->payload_size = m.size;
    return 1;
}

/* ---- lifecycle -------------------------------------------------------------------------------- */

int km_sim_engine_create(const km_sim_engine_config *cfg, km_sim_engine **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_sim_engine_config c;
    if (cfg)
        c = *cfg;
    else
        km_sim_engine_config_init(&c);
    int vrc = km_engine_model_validate(&c.model, NULL, 0);
    if (vrc)
        return vrc;
    if (c.model.capacity_blocks == UINT32_MAX)
        return KM_ERR_INVALID_ARGUMENT;
    km_sim_engine *e = calloc(1, sizeof *e);
    if (!e)
        return KM_ERR_OUT_OF_MEMORY;
    e->cfg = c;
    e->hash_cfg.block_size = c.model.block_size;
    e->blocks = malloc((size_t)c.model.capacity_blocks * sizeof *e->blocks);
    if (!e->blocks) {
        free(e);
        return KM_ERR_OUT_OF_MEMORY;
    }
    km_u64map_init(&e->cached, &e->map_memory);
    km_u64map_init(&e->requests, &e->map_memory);
    msgpack_sbuffer_init(&e->events);
    msgpack_sbuffer_init(&e->payload);
    ring_init(&e->messages, sizeof(sim_message));
    ring_init(&e->waiting, sizeof(uint32_t));
    ring_init(&e->completions, sizeof(km_sim_completion));
    reset_blocks(e);
    *out = e;
    return KM_OK;
}

static void slot_release(km_sim_engine *e, uint32_t s)
{
    sim_request *r = &e->slots[s];
    free(r->tokens);
    free(r->chains);
    free(r->blocks);
    km_u64map_erase(&e->requests, r->id + 2);
    memset(r, 0, sizeof *r);
    e->free_slots[e->n_free_slots++] = s;
}

void km_sim_engine_destroy(km_sim_engine *engine)
{
    if (!engine)
        return;
    for (uint32_t s = 0; s < engine->n_slots; s++) {
        free(engine->slots[s].tokens);
        free(engine->slots[s].chains);
        free(engine->slots[s].blocks);
    }
    free(engine->slots);
    free(engine->free_slots);
    sim_message m;
    while (ring_pop(&engine->messages, &m))
        free(m.payload);
    free(engine->messages.items);
    free(engine->waiting.items);
    free(engine->completions.items);
    free(engine->taken_payload);
    free(engine->running);
    free(engine->step);
    msgpack_sbuffer_destroy(&engine->events);
    msgpack_sbuffer_destroy(&engine->payload);
    km_u64map_free(&engine->cached);
    km_u64map_free(&engine->requests);
    free(engine->blocks);
    free(engine);
}

const km_sim_engine_config *km_sim_engine_get_config(const km_sim_engine *engine)
{
    return &engine->cfg;
}

/* ---- requests ------------------------------------------------------------------------------------ */

static uint32_t find_slot(const km_sim_engine *e, uint64_t request_id)
{
    if (request_id > KM_SIM_ENGINE_MAX_REQUEST_ID)
        return NO_SLOT;
    const uint64_t *v = km_u64map_find(&e->requests, request_id + 2);
    return v ? (uint32_t)*v : NO_SLOT;
}

/* A new slot for request_id holding a copy of the prompt and the known answer (n_answer tokens
 * after it) and their chain hashes. */
static int slot_create(km_sim_engine *e, uint64_t request_id, const uint32_t *tokens,
                       uint32_t n_tokens, uint32_t n_answer, uint32_t *slot_out)
{
    if (!tokens)
        return fail(e, KM_ERR_NULL_POINTER, "tokens is NULL");
    if (n_tokens == 0)
        return fail(e, KM_ERR_INVALID_ARGUMENT, "request %llu has no prompt tokens",
                    (unsigned long long)request_id);
    if (request_id > KM_SIM_ENGINE_MAX_REQUEST_ID)
        return fail(e, KM_ERR_INVALID_ARGUMENT, "request id %llu is above the largest accepted",
                    (unsigned long long)request_id);
    if (find_slot(e, request_id) != NO_SLOT)
        return fail(e, KM_ERR_INVALID_ARGUMENT, "request %llu is already in the engine",
                    (unsigned long long)request_id);
    if (e->n_free_slots == 0) {
        uint32_t cap = e->slots_capacity ? e->slots_capacity * 2 : 64;
        sim_request *fresh = realloc(e->slots, (size_t)cap * sizeof *fresh);
        if (!fresh)
            return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory for request slots");
        e->slots = fresh;
        uint32_t *fresh_free = realloc(e->free_slots, (size_t)cap * sizeof *fresh_free);
        if (!fresh_free)
            return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory for request slots");
        e->free_slots = fresh_free;
        for (uint32_t s = cap; s-- > e->slots_capacity;) {
            memset(&e->slots[s], 0, sizeof e->slots[s]);
            e->free_slots[e->n_free_slots++] = s;
        }
        e->slots_capacity = cap;
        e->n_slots = cap;
    }
    size_t n_known = (size_t)n_tokens + n_answer;
    if (n_known / e->cfg.model.block_size > UINT32_MAX)
        return fail(e, KM_ERR_TOO_LARGE,
                    "request %llu: %zu prompt and answer tokens fill more than 2^32 - 1 blocks",
                    (unsigned long long)request_id, n_known);
    uint32_t n_chains = (uint32_t)(n_known / e->cfg.model.block_size);
    uint32_t *copy = malloc(n_known * sizeof *copy);
    uint64_t *chains = malloc(((size_t)n_chains + 1) * sizeof *chains);
    if (!copy || !chains || km_u64map_reserve(&e->requests, 1)) {
        free(copy);
        free(chains);
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory for request %llu",
                    (unsigned long long)request_id);
    }
    memcpy(copy, tokens, n_known * sizeof *copy);
    size_t n_blocks = 0;
    km_hash_sequence(&e->hash_cfg, copy, n_known, 0, 0, NULL, chains, &n_blocks);
    uint32_t s = e->free_slots[--e->n_free_slots];
    sim_request *r = &e->slots[s];
    memset(r, 0, sizeof *r);
    r->id = request_id;
    r->tokens = copy;
    r->n_tokens = n_tokens;
    r->chains = chains;
    r->n_full = n_tokens / e->cfg.model.block_size;
    r->n_chains = n_chains;
    km_u64map_put(&e->requests, request_id + 2, s, 0); /* reserved above: cannot fail */
    *slot_out = s;
    return KM_OK;
}

static uint32_t leading_held(const km_sim_engine *e, const uint64_t *chains, uint32_t n)
{
    uint32_t k = 0;
    while (k < n && km_u64map_find(&e->cached, chains[k]))
        k++;
    return k;
}

static uint32_t blocks_for(const km_sim_engine *e, uint64_t tokens)
{
    return (uint32_t)((tokens + e->cfg.model.block_size - 1) / e->cfg.model.block_size);
}

/* What admitting slot s would find (no side effects). */
static void admission_plan(const km_sim_engine *e, const sim_request *r, uint32_t reserve_tokens,
                           km_sim_admission *a, uint64_t *total_blocks)
{
    memset(a, 0, sizeof *a);
    uint32_t bs = e->cfg.model.block_size;
    a->prompt_tokens = r->n_tokens;
    a->full_blocks = r->n_full;
    a->held_blocks = leading_held(e, r->chains, r->n_full);
    /* vLLM recomputes the last prompt token to get its logits: a hit never covers it. */
    uint32_t hit_cap = (r->n_tokens - 1) / bs;
    a->hit_blocks = a->held_blocks < hit_cap ? a->held_blocks : hit_cap;
    a->cached_tokens = a->hit_blocks * bs;
    a->uncached_tokens = r->n_tokens - a->cached_tokens;
    *total_blocks = blocks_for(e, (uint64_t)r->n_tokens + reserve_tokens);
}

/* Admit slot s (already created): the cache side of km_sim_engine_admit. */
static int admit_slot(km_sim_engine *e, uint32_t s, uint32_t reserve_tokens, km_sim_admission *out)
{
    sim_request *r = &e->slots[s];
    km_sim_admission a;
    uint64_t total;
    admission_plan(e, r, reserve_tokens, &a, &total);
    if (total > e->cfg.model.capacity_blocks)
        return fail(e, KM_ERR_TOO_LARGE,
                    "request %llu needs %llu blocks (%u prompt + %u reserved tokens), the engine "
                    "has %u",
                    (unsigned long long)r->id, (unsigned long long)total, r->n_tokens,
                    reserve_tokens, e->cfg.model.capacity_blocks);
    uint32_t held = a.held_blocks;
    uint32_t held_free = 0;
    for (uint32_t k = 0; k < held; k++) {
        uint32_t b = (uint32_t)*km_u64map_find(&e->cached, r->chains[k]);
        held_free += e->blocks[b].ref == 0;
    }
    uint32_t n_new = (uint32_t)(total - held);
    if (n_new > e->n_free - held_free) {
        e->stats.admission_waits++;
        return fail(e, KM_ERR_OVERLOADED,
                    "request %llu needs %u new blocks, %u are free (%u of them its own hits)",
                    (unsigned long long)r->id, n_new, e->n_free, held_free);
    }
    uint32_t *ids = malloc((size_t)total * sizeof *ids);
    if (!ids)
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory for %llu block ids",
                    (unsigned long long)total);
    /* Touch the hits first, so that allocation cannot evict them. */
    for (uint32_t k = 0; k < held; k++) {
        uint32_t b = (uint32_t)*km_u64map_find(&e->cached, r->chains[k]);
        if (e->blocks[b].ref == 0) {
            free_queue_remove(e, b);
            e->n_in_use++;
        }
        e->blocks[b].ref++;
        ids[k] = b;
    }
    for (uint32_t k = held; k < total; k++) {
        uint32_t b = e->free_head;
        free_queue_remove(e, b);
        sim_block *blk = &e->blocks[b];
        if (blk->cached) {
            km_u64map_erase(&e->cached, blk->chain);
            emit_removed(e, blk->engine_hash);
            blk->cached = false;
            e->n_cached--;
            a.evicted_blocks++;
            e->stats.blocks_evicted++;
        }
        blk->ref = 1;
        e->n_in_use++;
        ids[k] = b;
    }
    a.new_blocks = n_new;
    r->blocks = ids;
    r->n_blocks = (uint32_t)total;
    r->held_blocks = held;
    r->admission = a;
    r->computed = a.cached_tokens;
    r->cached_to = held;
    r->unpublished_from = NO_BLOCK;
    r->phase = REQ_PREFILL;
    e->stats.admissions++;
    e->stats.prompt_tokens += r->n_tokens;
    e->stats.hit_blocks += a.hit_blocks;
    e->stats.cached_tokens += a.cached_tokens;
    if (out)
        *out = a;
    return KM_OK;
}

/* Cache the request's block k under its chain hash (not cached by any block); `unpublished`: its
 * BlockStored waits for publish_scheduled. */
static void cache_block(km_sim_engine *e, sim_request *r, uint32_t k, bool unpublished)
{
    sim_block *blk = &e->blocks[r->blocks[k]];
    blk->chain = r->chains[k];
    blk->engine_hash = km_sim_engine_engine_hash(e, blk->chain);
    blk->cached = true;
    blk->unpublished = unpublished;
    if (unpublished && (r->unpublished_from == NO_BLOCK || k < r->unpublished_from))
        r->unpublished_from = k;
    km_u64map_put(&e->cached, blk->chain, r->blocks[k], 0);
    e->n_cached++;
}

/* The request's full blocks [r->cached_to, to) of its prompt, then of its known answer, are
 * computed (or, `scheduled`, the step computing them is scheduled): cache each whose chain hash no
 * other block caches yet and queue one BlockStored per run of newly cached blocks (`scheduled`:
 * publish_scheduled queues them when the step ends); a block whose content is cached already
 * stays private to the request (a duplicate), and the run after it names that cached copy as its
 * parent, held then: the cache operations cache a prompt's blocks at one instant, and the step
 * scheduler makes no duplicate of a prompt's (a request gets budget only once every earlier prompt
 * is scheduled, and hits its blocks). *stored_out (may be NULL): the number of blocks cached. */
static int cache_full_blocks(km_sim_engine *e, uint32_t s, uint32_t to, bool scheduled,
                             uint32_t *stored_out)
{
    sim_request *r = &e->slots[s];
    if (to > r->n_chains)
        to = r->n_chains;
    uint32_t from = r->cached_to > r->held_blocks ? r->cached_to : r->held_blocks;
    uint32_t stored = 0;
    if (from < to && km_u64map_reserve(&e->cached, to - r->held_blocks))
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory to cache %u blocks", to - r->held_blocks);
    uint32_t run_start = NO_BLOCK;
    for (uint32_t k = from; k <= to; k++) {
        bool cache_it = k < to && !km_u64map_find(&e->cached, r->chains[k]);
        if (cache_it && run_start == NO_BLOCK)
            run_start = k;
        if (cache_it) {
            cache_block(e, r, k, scheduled);
            stored++;
        } else {
            if (k < to)
                e->stats.duplicate_blocks++;
            if (run_start != NO_BLOCK) {
                if (!scheduled)
                    emit_stored(e, r, run_start, k);
                run_start = NO_BLOCK;
            }
        }
    }
    if (to > r->cached_to)
        r->cached_to = to;
    if (!scheduled) /* the scheduled ones count when their BlockStored goes out */
        e->stats.blocks_stored += stored;
    if (stored_out)
        *stored_out = stored;
    return KM_OK;
}

/* The step that computes slot s's chunk ends: one BlockStored per run of the blocks it cached when
 * the chunk was scheduled. */
static void publish_scheduled(km_sim_engine *e, uint32_t s)
{
    sim_request *r = &e->slots[s];
    if (r->unpublished_from == NO_BLOCK)
        return;
    uint32_t run_start = NO_BLOCK;
    for (uint32_t k = r->unpublished_from; k <= r->cached_to; k++) {
        sim_block *blk = k < r->cached_to ? &e->blocks[r->blocks[k]] : NULL;
        bool publish_it = blk && blk->unpublished;
        if (publish_it) {
            blk->unpublished = false;
            e->stats.blocks_stored++;
            if (run_start == NO_BLOCK)
                run_start = k;
        } else if (run_start != NO_BLOCK) {
            emit_stored(e, r, run_start, k);
            run_start = NO_BLOCK;
        }
    }
    r->unpublished_from = NO_BLOCK;
}

/* The whole prompt is computed: its remaining full blocks are cached. */
static int complete_slot(km_sim_engine *e, uint32_t s, uint32_t *stored_out)
{
    sim_request *r = &e->slots[s];
    int rc = cache_full_blocks(e, s, r->n_full, false, stored_out);
    if (rc)
        return rc;
    r->computed = r->n_tokens;
    r->phase = REQ_DECODE;
    return KM_OK;
}

/* Drop the request's references, tail first (vLLM's free order), and release its slot. */
static void finish_slot(km_sim_engine *e, uint32_t s)
{
    sim_request *r = &e->slots[s];
    for (uint32_t k = r->n_blocks; k-- > 0;) {
        sim_block *blk = &e->blocks[r->blocks[k]];
        if (--blk->ref == 0) {
            free_queue_append(e, r->blocks[k]);
            e->n_in_use--;
        }
    }
    slot_release(e, s);
}

static int claim_mode(km_sim_engine *e, drive_mode mode)
{
    if (e->mode == MODE_UNSET)
        e->mode = mode;
    if (e->mode != mode)
        return fail(e, KM_ERR_INVALID_ARGUMENT,
                    "this engine is driven by %s; cache operations and the step scheduler do not "
                    "mix",
                    e->mode == MODE_SCHEDULER ? "the step scheduler" : "cache operations");
    return KM_OK;
}

int km_sim_engine_admit(km_sim_engine *engine, uint64_t request_id, const uint32_t *tokens,
                        uint32_t n_tokens, uint32_t reserve_tokens, km_sim_admission *out)
{
    km_sim_engine *e = engine;
    e->last_error[0] = '\0';
    int rc = claim_mode(e, MODE_CACHE_OPS);
    if (rc)
        return rc;
    uint32_t s;
    rc = slot_create(e, request_id, tokens, n_tokens, 0, &s);
    if (rc)
        return rc;
    rc = admit_slot(e, s, reserve_tokens, out);
    if (rc)
        slot_release(e, s);
    return rc;
}

static int cache_op_slot(km_sim_engine *e, uint64_t request_id, uint32_t *slot_out)
{
    e->last_error[0] = '\0';
    int rc = claim_mode(e, MODE_CACHE_OPS);
    if (rc)
        return rc;
    uint32_t s = find_slot(e, request_id);
    if (s == NO_SLOT)
        return fail(e, KM_ERR_NOT_FOUND, "request %llu is not in the engine",
                    (unsigned long long)request_id);
    *slot_out = s;
    return KM_OK;
}

int km_sim_engine_complete_prefill(km_sim_engine *engine, uint64_t request_id,
                                   uint32_t *stored_out)
{
    uint32_t s = NO_SLOT;
    int rc = cache_op_slot(engine, request_id, &s);
    if (rc)
        return rc;
    if (engine->slots[s].phase != REQ_PREFILL)
        return fail(engine, KM_ERR_INVALID_ARGUMENT, "request %llu already completed its prefill",
                    (unsigned long long)request_id);
    return complete_slot(engine, s, stored_out);
}

int km_sim_engine_finish(km_sim_engine *engine, uint64_t request_id)
{
    uint32_t s = NO_SLOT;
    int rc = cache_op_slot(engine, request_id, &s);
    if (rc)
        return rc;
    finish_slot(engine, s);
    return KM_OK;
}

/* ---- the step scheduler ------------------------------------------------------------------------ */

static int push_completion(km_sim_engine *e, const sim_request *r, km_sim_completion_kind kind,
                           uint64_t time_us, int status)
{
    km_sim_completion c;
    memset(&c, 0, sizeof c); /* padding too: completions are compared bytewise in tests */
    c.request_id = r->id;
    c.kind = kind;
    c.time_us = time_us;
    c.submit_us = r->submit_us;
    c.prompt_tokens = r->n_tokens;
    c.cached_tokens = r->admission.cached_tokens;
    c.held_blocks = r->admission.held_blocks;
    c.output_tokens = r->generated;
    c.status = status;
    if (ring_push(&e->completions, &c))
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory to queue a completion");
    return KM_OK;
}

int km_sim_engine_submit(km_sim_engine *engine, uint64_t request_id, const uint32_t *tokens,
                         uint32_t n_tokens, uint32_t output_tokens, uint64_t now_us)
{
    return km_sim_engine_submit_answered(engine, request_id, tokens, n_tokens, 0, output_tokens,
                                         now_us);
}

int km_sim_engine_submit_answered(km_sim_engine *engine, uint64_t request_id,
                                  const uint32_t *tokens, uint32_t n_tokens, uint32_t n_answer,
                                  uint32_t output_tokens, uint64_t now_us)
{
    km_sim_engine *e = engine;
    e->last_error[0] = '\0';
    int rc = claim_mode(e, MODE_SCHEDULER);
    if (rc)
        return rc;
    if (now_us < e->last_submit_us)
        return fail(e, KM_ERR_INVALID_ARGUMENT,
                    "submission at %llu us is before the previous one (%llu us)",
                    (unsigned long long)now_us, (unsigned long long)e->last_submit_us);
    if (n_answer > (output_tokens ? output_tokens : 1))
        return fail(e, KM_ERR_INVALID_ARGUMENT,
                    "request %llu: %u answer tokens known, it generates %u",
                    (unsigned long long)request_id, n_answer, output_tokens ? output_tokens : 1);
    uint32_t s;
    rc = slot_create(e, request_id, tokens, n_tokens, n_answer, &s);
    if (rc)
        return rc;
    if (ring_push(&e->waiting, &s)) {
        slot_release(e, s);
        return fail(e, KM_ERR_OUT_OF_MEMORY, "no memory to queue request %llu",
                    (unsigned long long)request_id);
    }
    sim_request *r = &e->slots[s];
    r->phase = REQ_WAITING;
    r->output_tokens = output_tokens ? output_tokens : 1;
    r->submit_us = now_us;
    e->last_submit_us = now_us;
    return KM_OK;
}

static int step_push(km_sim_engine *e, uint32_t s)
{
    int rc = KM_ARRAY_GROW(e->step, e->step_capacity, e->n_step + 1, 16);
    if (rc)
        return fail(e, rc, "no memory for the step");
    e->step[e->n_step++] = s;
    return KM_OK;
}

/* The next chunk of slot s's prompt within `budget` tokens, added to the step's shape. The full
 * blocks the chunk completes are cached now, as vLLM v1 registers them when it allocates the
 * chunk's slots: a request scheduled after it, in this step or a later one, hits them (its own
 * chunk attends to them in the same forward pass, after their KV is written). */
static int schedule_chunk(km_sim_engine *e, uint32_t s, uint64_t budget, km_engine_step *shape)
{
    sim_request *r = &e->slots[s];
    uint64_t need = r->n_tokens - r->computed;
    r->step_tokens = (uint32_t)(need < budget ? need : budget);
    shape->prefill_tokens += r->step_tokens;
    shape->prefill_pairs += km_engine_model_chunk_pairs(r->computed, r->step_tokens);
    return cache_full_blocks(e, s, (r->computed + r->step_tokens) / e->cfg.model.block_size, true,
                             NULL);
}

/* Start a step at time t, scheduling as vLLM v1 does within max_num_batched_tokens: first the
 * running requests in admission order (a decode takes one token, a prefill in progress its next
 * chunk), then waiting requests first come, first served while the budget lasts and fewer than
 * max_num_seqs run, each admitted with its cached prefix and a first chunk of the rest. A waiting
 * request that does not fit in the free blocks waits, and so does everyone behind it. Returns
 * KM_OK with step_active false when there was nothing to run. */
static int start_step(km_sim_engine *e, uint64_t t)
{
    const km_engine_model *m = &e->cfg.model;
    uint64_t budget = m->max_num_batched_tokens;
    km_engine_step shape = {0, 0, 0, 0};
    int rc;
    e->n_step = 0;
    for (uint32_t i = 0; i < e->n_running && budget > 0; i++) {
        uint32_t s = e->running[i];
        sim_request *r = &e->slots[s];
        if (r->phase == REQ_DECODE) {
            r->step_tokens = 1;
            shape.decode_requests++;
            shape.decode_context_tokens += (uint64_t)r->n_tokens + r->generated;
            /* Its tokens so far, the last one computed by this step: the blocks they fill are
             * cached now, as vLLM v1 caches up to the request's tokens when it allocates a step's
             * slots (only the known answer's: cache_full_blocks stops at n_chains). */
            uint64_t filled = ((uint64_t)r->n_tokens + r->generated) / e->cfg.model.block_size;
            if (r->cached_to < r->n_chains && filled > r->cached_to &&
                (rc = cache_full_blocks(e, s, (uint32_t)filled, true, NULL)))
                return rc;
        } else if ((rc = schedule_chunk(e, s, budget, &shape))) {
            return rc;
        }
        budget -= r->step_tokens;
        if ((rc = step_push(e, s)))
            return rc;
    }
    while (e->waiting.count && budget > 0 && e->n_running < m->max_num_seqs) {
        uint32_t s = *(uint32_t *)ring_front(&e->waiting);
        sim_request *r = &e->slots[s];
        km_sim_admission plan;
        uint64_t total;
        uint32_t reserve = r->output_tokens;
        admission_plan(e, r, reserve, &plan, &total);
        rc = admit_slot(e, s, reserve, &plan);
        if (rc == KM_ERR_TOO_LARGE) {
            e->last_error[0] = '\0';
            ring_pop(&e->waiting, NULL);
            e->stats.rejected++;
            int prc = push_completion(e, r, KM_SIM_REJECTED, t, rc);
            slot_release(e, s);
            if (prc)
                return prc;
            continue;
        }
        if (rc == KM_ERR_OVERLOADED) {
            e->last_error[0] = '\0';
            break; /* FCFS: the head waits for blocks, and so does everyone behind it */
        }
        if (rc)
            return rc;
        if ((rc = KM_ARRAY_GROW(e->running, e->running_capacity, e->n_running + 1, 16)))
            return fail(e, rc, "no memory for the running set");
        ring_pop(&e->waiting, NULL);
        e->running[e->n_running++] = s;
        /* >= 1 token: a hit never covers the last one */
        if ((rc = schedule_chunk(e, s, budget, &shape)))
            return rc;
        budget -= r->step_tokens;
        if ((rc = step_push(e, s)))
            return rc;
        if ((rc = push_completion(e, r, KM_SIM_ADMITTED, t, KM_OK)))
            return rc;
    }
    if (e->n_step == 0) {
        e->step_active = false;
        return KM_OK;
    }
    double us = km_engine_model_step_us(m, &shape);
    uint64_t duration = (uint64_t)ceil(us);
    if (duration < 1)
        duration = 1;
    e->step_active = true;
    e->step_start_us = t;
    e->step_end_us = t + duration;
    return KM_OK;
}

static int remove_running(km_sim_engine *e, uint32_t s)
{
    for (uint32_t i = 0; i < e->n_running; i++)
        if (e->running[i] == s) {
            memmove(&e->running[i], &e->running[i + 1],
                    (size_t)(e->n_running - i - 1) * sizeof *e->running);
            e->n_running--;
            return KM_OK;
        }
    return KM_ERR_INTERNAL;
}

/* End the running step, in the step's order: a decode produces a token; a prefill chunk is
 * computed and the prompt's blocks it completed are cached, and the chunk that ends the prompt
 * produces the first token. Finished requests release their blocks in that order; the step's
 * events become one message. */
static int end_step(km_sim_engine *e)
{
    uint64_t t = e->step_end_us;
    int rc;
    for (uint32_t i = 0; i < e->n_step; i++) {
        uint32_t s = e->step[i];
        sim_request *r = &e->slots[s];
        if (r->phase == REQ_DECODE) {
            publish_scheduled(e, s);
            r->generated++;
        } else {
            r->computed += r->step_tokens;
            publish_scheduled(e, s);
            if (r->computed < r->n_tokens)
                continue;
            if ((rc = complete_slot(e, s, NULL)))
                return rc;
            r->generated = 1;
            if ((rc = push_completion(e, r, KM_SIM_FIRST_TOKEN, t, KM_OK)))
                return rc;
        }
        if (r->generated >= r->output_tokens) {
            if ((rc = push_completion(e, r, KM_SIM_FINISHED, t, KM_OK)))
                return rc;
            remove_running(e, s);
            finish_slot(e, s);
            e->stats.finished++;
        }
    }
    e->n_step = 0;
    e->stats.steps++;
    e->stats.busy_us += t - e->step_start_us;
    e->step_active = false;
    e->clock_us = t;
    return close_step(e, t, NULL);
}

uint64_t km_sim_engine_next_event_us(const km_sim_engine *engine)
{
    const km_sim_engine *e = engine;
    if (e->step_active)
        return e->step_end_us;
    if (e->n_running)
        return e->clock_us;
    if (e->waiting.count) {
        uint32_t s = *(uint32_t *)ring_front(&e->waiting);
        uint64_t t = e->slots[s].submit_us;
        return t > e->clock_us ? t : e->clock_us;
    }
    return UINT64_MAX;
}

int km_sim_engine_advance(km_sim_engine *engine, uint64_t now_us)
{
    km_sim_engine *e = engine;
    e->last_error[0] = '\0';
    int rc = claim_mode(e, MODE_SCHEDULER);
    if (rc)
        return rc;
    for (;;) {
        if (e->step_active) {
            if (e->step_end_us > now_us)
                return KM_OK;
            if ((rc = end_step(e)))
                return rc;
            continue;
        }
        uint64_t t = km_sim_engine_next_event_us(e);
        if (t == UINT64_MAX || t > now_us)
            return KM_OK;
        if ((rc = start_step(e, t)))
            return rc;
        if (!e->step_active) {
            if (e->waiting.count == 0 && e->n_running == 0)
                return KM_OK; /* everything waiting was rejected */
            /* Nothing runs, so every block is free and the head must have fit. */
            return fail(e, KM_ERR_INTERNAL, "an idle engine could not admit its next request");
        }
    }
}

int km_sim_engine_next_completion(km_sim_engine *engine, km_sim_completion *out)
{
    return ring_pop(&engine->completions, out);
}

/* ---- faults ------------------------------------------------------------------------------------- */

int km_sim_engine_restart(km_sim_engine *engine, uint64_t new_seed, uint64_t now_us)
{
    km_sim_engine *e = engine;
    e->last_error[0] = '\0';
    for (uint32_t s = 0; s < e->n_slots; s++)
        if (e->slots[s].phase != REQ_FREE)
            slot_release(e, s);
    e->waiting.head = e->waiting.count = 0;
    e->n_running = 0;
    e->n_step = 0;
    e->step_active = false;
    if (now_us > e->clock_us)
        e->clock_us = now_us;
    reset_blocks(e);
    msgpack_sbuffer_clear(&e->events);
    e->n_pending_events = 0;
    e->seq_next = 0;
    e->stats.messages = 0;
    e->stats.restarts++;
    e->cfg.process_seed = new_seed;
    if (e->cfg.clear_on_restart) {
        emit_cleared(e);
        return close_step(e, now_us, NULL);
    }
    return KM_OK;
}

/* ---- ground truth and counters ------------------------------------------------------------------ */

bool km_sim_engine_holds(const km_sim_engine *engine, uint64_t chain_hash)
{
    const uint64_t *b = km_u64map_find(&engine->cached, chain_hash);
    return b && !engine->blocks[*b].unpublished;
}

uint32_t km_sim_engine_cached_depth(const km_sim_engine *engine, const uint64_t *chains,
                                    uint32_t n)
{
    uint32_t k = 0;
    while (chains && k < n && km_sim_engine_holds(engine, chains[k]))
        k++;
    return k;
}

void km_sim_engine_cached_chains(const km_sim_engine *engine, uint64_t *out, size_t capacity,
                                 size_t *n_out)
{
    size_t n = 0;
    for (uint32_t b = 0; b < engine->cfg.model.capacity_blocks; b++)
        if (engine->blocks[b].cached && !engine->blocks[b].unpublished) {
            if (out && n < capacity)
                out[n] = engine->blocks[b].chain;
            n++;
        }
    if (n_out)
        *n_out = n;
}

void km_sim_engine_get_stats(const km_sim_engine *engine, km_sim_engine_stats *out)
{
    *out = engine->stats;
    out->blocks_cached = engine->n_cached;
    out->blocks_in_use = engine->n_in_use;
    out->blocks_free = engine->n_free;
    out->waiting = (uint32_t)engine->waiting.count;
    uint32_t running = 0;
    for (uint32_t s = 0; s < engine->n_slots; s++)
        running += engine->slots[s].phase == REQ_PREFILL || engine->slots[s].phase == REQ_DECODE;
    out->running = running;
    out->seq_next = engine->seq_next;
}
