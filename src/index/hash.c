/* SPDX-License-Identifier: Apache-2.0 */
/* Block hashing as defined in docs/HASHING.md, on libxxhash's XXH3-64. */
#include "kvmatch/hash.h"

#include <string.h>
/* The implementation inline: XXH3 of a chain step's 16 bytes compiles to its short path, with
 * no call through the shared library. The same function, so the same hashes (HASHING.md). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvmatch/error.h"

uint64_t km_hash_remap(uint64_t value)
{
    if (value == KM_HASH_RESERVED_EMPTY)
        return KM_HASH_REMAP_EMPTY;
    if (value == KM_HASH_RESERVED_TOMBSTONE)
        return KM_HASH_REMAP_TOMBSTONE;
    return value;
}

/* NVIDIA Dynamo's rule: 1337 + XXH3-64(name, seed 0), wrapping. */
static uint64_t lora_seed(const km_hash_config *cfg)
{
    if (!cfg->lora_name || !cfg->lora_name[0])
        return KM_HASH_SEED;
    return KM_HASH_SEED + XXH3_64bits_withSeed(cfg->lora_name, strlen(cfg->lora_name), 0);
}

/* The salt adds XXH3-64(salt, seed 1), wrapping, as Dynamo's cache namespace does; on block 0
 * only (HASHING.md, "Seeds", says why). */
uint64_t km_hash_block_seed(const km_hash_config *cfg, uint64_t position)
{
    uint64_t seed = lora_seed(cfg);
    if (position == 0 && cfg->cache_salt && cfg->cache_salt[0])
        seed += XXH3_64bits_withSeed(cfg->cache_salt, strlen(cfg->cache_salt), 1);
    return seed;
}

uint64_t km_hash_local(const uint32_t *tokens, uint32_t block_size, uint64_t seed)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return XXH3_64bits_withSeed(tokens, (size_t)block_size * sizeof(uint32_t), seed);
#else
    uint8_t buf[4096];
    XXH3_state_t st;
    XXH3_INITSTATE(&st); /* the reset reads the seed and secret a reused state would hold */
    XXH3_64bits_reset_withSeed(&st, seed);
    for (uint32_t i = 0; i < block_size;) {
        size_t n = 0;
        for (; i < block_size && n + 4 <= sizeof buf; i++, n += 4) {
            buf[n] = (uint8_t)tokens[i];
            buf[n + 1] = (uint8_t)(tokens[i] >> 8);
            buf[n + 2] = (uint8_t)(tokens[i] >> 16);
            buf[n + 3] = (uint8_t)(tokens[i] >> 24);
        }
        XXH3_64bits_update(&st, buf, n);
    }
    return XXH3_64bits_digest(&st);
#endif
}

/* Feed n tokens to a streaming XXH3 state as little-endian u32. */
static void update_tokens(XXH3_state_t *st, const uint32_t *tokens, uint32_t n)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    XXH3_64bits_update(st, tokens, (size_t)n * sizeof(uint32_t));
#else
    uint8_t buf[4096];
    for (uint32_t i = 0; i < n;) {
        size_t k = 0;
        for (; i < n && k + 4 <= sizeof buf; i++, k += 4) {
            buf[k] = (uint8_t)tokens[i];
            buf[k + 1] = (uint8_t)(tokens[i] >> 8);
            buf[k + 2] = (uint8_t)(tokens[i] >> 16);
            buf[k + 3] = (uint8_t)(tokens[i] >> 24);
        }
        XXH3_64bits_update(st, buf, k);
    }
#endif
}

uint64_t km_hash_local_lookahead(const uint32_t *tokens, uint32_t block_size,
                                 const uint32_t *lookahead, uint32_t n_lookahead, uint64_t seed)
{
    if (n_lookahead == 0)
        return km_hash_local(tokens, block_size, seed);
    /* XXH3's streaming digest equals the one-shot hash of the concatenated input. */
    XXH3_state_t st;
    XXH3_INITSTATE(&st); /* the reset reads the seed and secret a reused state would hold */
    XXH3_64bits_reset_withSeed(&st, seed);
    update_tokens(&st, tokens, block_size);
    update_tokens(&st, lookahead, n_lookahead);
    return XXH3_64bits_digest(&st);
}

static void store_le64(uint8_t *p, uint64_t v)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, sizeof v);
#else
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
#endif
}

uint64_t km_hash_chain_step(uint64_t parent_chain, uint64_t local)
{
    uint8_t buf[16];
    store_le64(buf, parent_chain);
    store_le64(buf + 8, local);
    return km_hash_remap(XXH3_64bits_withSeed(buf, sizeof buf, KM_HASH_SEED));
}

uint64_t km_hash_window_key(uint64_t chain, uint32_t group)
{
    uint8_t buf[12];
    store_le64(buf, chain);
    for (int i = 0; i < 4; i++)
        buf[8 + i] = (uint8_t)(group >> (8 * i));
    return km_hash_remap(XXH3_64bits_withSeed(buf, sizeof buf, KM_HASH_SEED));
}

uint64_t km_hash_chain_root(uint64_t local)
{
    return km_hash_remap(local);
}

int km_hash_sequence(const km_hash_config *cfg, const uint32_t *tokens, size_t n_tokens,
                     uint64_t first_position, uint64_t parent_chain, uint64_t *local_out,
                     uint64_t *chain_out, size_t *n_blocks_out)
{
    return km_hash_sequence_lookahead(cfg, 0, tokens, n_tokens, first_position, parent_chain,
                                      local_out, chain_out, n_blocks_out);
}

int km_hash_sequence_lookahead(const km_hash_config *cfg, uint32_t lookahead_tokens,
                               const uint32_t *tokens, size_t n_tokens, uint64_t first_position,
                               uint64_t parent_chain, uint64_t *local_out, uint64_t *chain_out,
                               size_t *n_blocks_out)
{
    if (!cfg || !chain_out || !n_blocks_out || (!tokens && n_tokens > 0))
        return KM_ERR_NULL_POINTER;
    if (cfg->block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    if (lookahead_tokens > KM_HASH_MAX_LOOKAHEAD ||
        cfg->block_size > UINT32_MAX - KM_HASH_MAX_LOOKAHEAD)
        return KM_ERR_INVALID_ARGUMENT;
    uint32_t lookahead = lookahead_tokens;
    size_t n_blocks = n_tokens < lookahead ? 0 : (n_tokens - lookahead) / cfg->block_size;
    uint64_t seed_rest = lora_seed(cfg);
    uint64_t chain = parent_chain;
    for (size_t i = 0; i < n_blocks; i++) {
        uint64_t position = first_position + i;
        uint64_t seed = position == 0 ? km_hash_block_seed(cfg, 0) : seed_rest;
        /* Under lookahead hashing the block's L following tokens are the ones that come next
         * in `tokens`, so the hash runs over block_size + L contiguous tokens. */
        uint64_t local = km_hash_local(tokens + i * cfg->block_size,
                                       cfg->block_size + lookahead, seed);
        chain = position == 0 ? km_hash_chain_root(local) : km_hash_chain_step(chain, local);
        if (local_out)
            local_out[i] = local;
        chain_out[i] = chain;
    }
    *n_blocks_out = n_blocks;
    return KM_OK;
}
