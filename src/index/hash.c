/* Block hashing as defined in docs/HASHING.md, on libxxhash's XXH3-64. */
#include "kvmatch/hash.h"

#include <string.h>
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

static void store_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t km_hash_chain_step(uint64_t parent_chain, uint64_t local)
{
    uint8_t buf[16];
    store_le64(buf, parent_chain);
    store_le64(buf + 8, local);
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
    if (!cfg || !chain_out || !n_blocks_out || (!tokens && n_tokens > 0))
        return KM_ERR_NULL_POINTER;
    if (cfg->block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    size_t n_blocks = n_tokens / cfg->block_size;
    uint64_t seed_rest = lora_seed(cfg);
    uint64_t chain = parent_chain;
    for (size_t i = 0; i < n_blocks; i++) {
        uint64_t position = first_position + i;
        uint64_t seed = position == 0 ? km_hash_block_seed(cfg, 0) : seed_rest;
        uint64_t local = km_hash_local(tokens + i * cfg->block_size, cfg->block_size, seed);
        chain = position == 0 ? km_hash_chain_root(local) : km_hash_chain_step(chain, local);
        if (local_out)
            local_out[i] = local;
        chain_out[i] = chain;
    }
    *n_blocks_out = n_blocks;
    return KM_OK;
}
