/* SPDX-License-Identifier: Apache-2.0 */
/* Block hashing, exactly as defined in docs/HASHING.md.
 *
 * Tokens are u32. A token sequence splits into full blocks of block_size tokens; a partial tail
 * block is not hashed. Each block has a local hash (XXH3-64 over its tokens as little-endian u32,
 * seed 1337, or a seed derived from the LoRA name / cache salt) and a chain hash that identifies the
 * block together with its whole prefix. Chain hashes never take the two values the index reserves
 * (KM_HASH_RESERVED_EMPTY, KM_HASH_RESERVED_TOMBSTONE): they are remapped as HASHING.md says. */
#ifndef KVMATCH_HASH_H
#define KVMATCH_HASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KM_HASH_SEED 1337u
#define KM_HASH_RESERVED_EMPTY 0u
#define KM_HASH_RESERVED_TOMBSTONE 1u
/* What a chain hash equal to a reserved value becomes (HASHING.md, "Reserved values"). */
#define KM_HASH_REMAP_EMPTY UINT64_C(0x9e3779b97f4a7c15)
#define KM_HASH_REMAP_TOMBSTONE UINT64_C(0xc2b2ae3d27d4eb4f)

/* Most lookahead tokens a configuration may name. */
#define KM_HASH_MAX_LOOKAHEAD 1024u

typedef struct km_hash_config {
    uint32_t block_size;   /* tokens per block, >= 1 (16 by default in the service) */
    const char *lora_name; /* NULL or "" = base model; otherwise changes every block's seed */
    const char *cache_salt; /* NULL or "" = none; otherwise changes the seed of block 0 only */
} km_hash_config;

/* The seed used for the local hash of the block at `position` (0 = first block of the sequence). */
uint64_t km_hash_block_seed(const km_hash_config *cfg, uint64_t position);

/* XXH3-64 of `block_size` tokens (little-endian u32) with `seed`. */
uint64_t km_hash_local(const uint32_t *tokens, uint32_t block_size, uint64_t seed);

/* XXH3-64 of `block_size` tokens followed by `n_lookahead` more (both little-endian u32) with
 * `seed`: the local hash of a block under lookahead hashing when its tokens and the ones after it
 * are held apart (equal to km_hash_local over the concatenation). */
uint64_t km_hash_local_lookahead(const uint32_t *tokens, uint32_t block_size,
                                 const uint32_t *lookahead, uint32_t n_lookahead, uint64_t seed);

/* One chaining step: remap(XXH3-64(le64(parent_chain) || le64(local), seed 1337)). */
uint64_t km_hash_chain_step(uint64_t parent_chain, uint64_t local);

/* The chain hash of a first block: remap(local). */
uint64_t km_hash_chain_root(uint64_t local);

/* The key under which the index records that one sliding-window KV-cache group of a hybrid model
 * holds the block named by `chain` (docs/HASHING.md, "Window keys"):
 * remap(XXH3-64(le64(chain) || le32(group), seed 1337)). 12 bytes hashed, so it never equals a
 * chain step's input (16 bytes). */
uint64_t km_hash_window_key(uint64_t chain, uint32_t group);

/* Remap a value that collides with a reserved table key; identity for every other value. */
uint64_t km_hash_remap(uint64_t value);

/* Hash every full block of `tokens`. `first_position` is the position of the first block in its
 * sequence (0 for a prompt; parent position + 1 when continuing after `parent_chain`).
 * When first_position == 0 the parent is ignored. local_out may be NULL; chain_out must hold
 * n_tokens / block_size entries. *n_blocks_out receives that count.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_BLOCK_SIZE. */
int km_hash_sequence(const km_hash_config *cfg, const uint32_t *tokens, size_t n_tokens,
                     uint64_t first_position, uint64_t parent_chain, uint64_t *local_out,
                     uint64_t *chain_out, size_t *n_blocks_out);

/* km_hash_sequence under lookahead hashing (vLLM's num_hash_lookahead_tokens, with EAGLE / MTP
 * speculative decoding; docs/HASHING.md): each block's local hash also covers the
 * `lookahead_tokens` (L) tokens after it, and a block is hashed only once those are in `tokens`:
 * *n_blocks_out = (n_tokens - L) / block_size, 0 when n_tokens < L. L = 0 is km_hash_sequence.
 * Errors: those of km_hash_sequence, KM_ERR_INVALID_ARGUMENT (L over KM_HASH_MAX_LOOKAHEAD). */
int km_hash_sequence_lookahead(const km_hash_config *cfg, uint32_t lookahead_tokens,
                               const uint32_t *tokens, size_t n_tokens, uint64_t first_position,
                               uint64_t parent_chain, uint64_t *local_out, uint64_t *chain_out,
                               size_t *n_blocks_out);

#ifdef __cplusplus
}
#endif
#endif
