/* SPDX-License-Identifier: Apache-2.0 */
/* The warp emulator (tests/warp_emulator.h): 32 ucontext stacks and a scheduler that resumes each
 * waiting lane in turn, round after round. A round's values are copied aside once all 32 lanes have
 * posted, so a lane that runs on to its next collective cannot overwrite a value another lane has
 * not read yet. */
#include "warp_emulator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#define LANE_STACK_BYTES ((size_t)256 << 10)

enum { LANE_RUNNING, LANE_WAITING, LANE_DONE };

struct km_warp_emulator {
    ucontext_t scheduler;
    ucontext_t context[KM_WARP_LANES];
    void *stack[KM_WARP_LANES];
    km_lane lane[KM_WARP_LANES];
    int state[KM_WARP_LANES];
    uint64_t posted[KM_WARP_LANES]; /* this round's values, as the lanes post them */
    uint64_t round[KM_WARP_LANES];  /* the last completed round's values */
    uint32_t current;
    km_warp_lane_fn fn;
    void *arg;
    uint64_t collectives;
};

static void exchange(void *warp, uint32_t lane, uint64_t value, uint64_t all[KM_WARP_LANES])
{
    km_warp_emulator *e = warp;
    e->posted[lane] = value;
    e->state[lane] = LANE_WAITING;
    swapcontext(&e->context[lane], &e->scheduler);
    memcpy(all, e->round, sizeof e->round);
}

/* makecontext passes ints: the emulator's address arrives in two halves. */
static void lane_entry(unsigned int hi, unsigned int lo)
{
    km_warp_emulator *e = (km_warp_emulator *)(((uintptr_t)hi << 32) | (uintptr_t)lo);
    uint32_t lane = e->current;
    e->fn(&e->lane[lane], e->arg);
    e->state[lane] = LANE_DONE;
    /* returning resumes uc_link, the scheduler */
}

km_warp_emulator *km_warp_emulator_create(void)
{
    km_warp_emulator *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    for (uint32_t i = 0; i < KM_WARP_LANES; i++) {
        e->stack[i] = malloc(LANE_STACK_BYTES);
        if (!e->stack[i]) {
            km_warp_emulator_destroy(e);
            return NULL;
        }
        e->lane[i] = (km_lane){i, exchange, e};
    }
    return e;
}

void km_warp_emulator_destroy(km_warp_emulator *e)
{
    if (!e)
        return;
    for (uint32_t i = 0; i < KM_WARP_LANES; i++)
        free(e->stack[i]);
    free(e);
}

uint64_t km_warp_collectives(const km_warp_emulator *e)
{
    return e->collectives;
}

/* Lane i's context, to start at lane_entry on its own stack. A function of its own: getcontext
 * returns twice as far as the compiler knows (here it never does: makecontext redirects the
 * context), and no caller's variable then has to survive it. */
static __attribute__((noinline)) int prepare_lane(km_warp_emulator *e, uint32_t i)
{
    uintptr_t self = (uintptr_t)e;
    if (getcontext(&e->context[i]) != 0)
        return -1;
    e->context[i].uc_stack.ss_sp = e->stack[i];
    e->context[i].uc_stack.ss_size = LANE_STACK_BYTES;
    e->context[i].uc_link = &e->scheduler;
    makecontext(&e->context[i], (void (*)(void))lane_entry, 2, (unsigned int)(self >> 32),
                (unsigned int)(self & 0xFFFFFFFFu));
    e->state[i] = LANE_RUNNING;
    return 0;
}

int km_warp_run(km_warp_emulator *e, km_warp_lane_fn fn, void *arg, char *why, size_t why_size)
{
    e->fn = fn;
    e->arg = arg;
    for (uint32_t i = 0; i < KM_WARP_LANES; i++) {
        if (prepare_lane(e, i) != 0) {
            snprintf(why, why_size, "getcontext failed");
            return -1;
        }
    }
    for (;;) {
        uint32_t waiting = 0, done = 0;
        for (uint32_t i = 0; i < KM_WARP_LANES; i++) {
            if (e->state[i] == LANE_DONE)
                continue;
            e->current = i;
            e->state[i] = LANE_RUNNING;
            swapcontext(&e->scheduler, &e->context[i]);
        }
        for (uint32_t i = 0; i < KM_WARP_LANES; i++) {
            waiting += e->state[i] == LANE_WAITING;
            done += e->state[i] == LANE_DONE;
        }
        if (done == KM_WARP_LANES)
            return 0;
        if (waiting != KM_WARP_LANES) {
            int n = snprintf(why, why_size, "lanes diverged after %llu collectives: returned:",
                             (unsigned long long)e->collectives);
            for (uint32_t i = 0; i < KM_WARP_LANES && n > 0 && (size_t)n < why_size; i++)
                if (e->state[i] == LANE_DONE)
                    n += snprintf(why + n, why_size - (size_t)n, " %u", (unsigned)i);
            return -1;
        }
        memcpy(e->round, e->posted, sizeof e->posted);
        e->collectives++;
    }
}
