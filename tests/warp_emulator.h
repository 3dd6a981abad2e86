/* SPDX-License-Identifier: Apache-2.0 */
/* A host emulation of one 32-lane warp, for code written against src/index/warp_walk.h: the lane
 * function runs 32 times, once per lane, each on its own stack, and the lanes are stepped together:
 * every lane runs until it reaches a collective (km_lane_ballot, km_lane_shfl) or returns; when all
 * 32 wait at a collective, each gets every lane's posted value and they go on. A lane that returns
 * while others wait at a collective is a divergence (on the device, undefined behaviour): the run
 * fails and says which lanes were where. Single-threaded and deterministic (ucontext). */
#ifndef KM_TEST_WARP_EMULATOR_H
#define KM_TEST_WARP_EMULATOR_H

#include <stddef.h>
#include <stdint.h>

#include "index/warp_walk.h"

typedef struct km_warp_emulator km_warp_emulator;
typedef void (*km_warp_lane_fn)(const km_lane *lane, void *arg);

/* NULL when out of memory. */
km_warp_emulator *km_warp_emulator_create(void);
void km_warp_emulator_destroy(km_warp_emulator *e);
/* Run fn(lane, arg) on the 32 lanes stepped together. 0, or -1 with the reason in why. */
int km_warp_run(km_warp_emulator *e, km_warp_lane_fn fn, void *arg, char *why, size_t why_size);
/* Collectives completed by all 32 lanes, over every run so far. */
uint64_t km_warp_collectives(const km_warp_emulator *e);

#endif
