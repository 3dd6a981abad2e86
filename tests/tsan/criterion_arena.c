/* SPDX-License-Identifier: Apache-2.0 */
/* An LD_PRELOAD shim that lets the Criterion test runner start under ThreadSanitizer (`make tsan`).
 *
 * Criterion's arena allocator (BoxFort) maps its shared arena at an address it draws with rand_r
 * from 0x2000'0000'0000 to 0x6000'0000'0000 in 16 MiB steps, ten tries, and refuses an address
 * already mapped. ThreadSanitizer reserves almost all of that range for its shadow memory, so the
 * draws nearly always fail ("Could not initialize inheritable arena"). This rand_r answers calls
 * from libcriterion with draws inside 0x5500'0000'0000 .. 0x5680'0000'0000, the application range
 * ThreadSanitizer leaves free there; every other caller gets the C library's rand_r unchanged.
 * Built without sanitizers; the test binary itself is not changed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

/* BoxFort's arena base is 0x2000'0000'0000 + (draw & 0x3fffff) * 16 MiB. */
#define ARENA_DRAW_FIRST 0x350000u /* 0x5500'0000'0000 */
#define ARENA_DRAW_COUNT 0x18000u  /* up to 0x5680'0000'0000 */

static int called_from_criterion(const void *caller)
{
    Dl_info info;
    return dladdr(caller, &info) && info.dli_fname && strstr(info.dli_fname, "libcriterion");
}

int rand_r(unsigned int *seed)
{
    static int (*real_rand_r)(unsigned int *);
    if (!real_rand_r)
        real_rand_r = (int (*)(unsigned int *))dlsym(RTLD_NEXT, "rand_r");
    int draw = real_rand_r(seed);
    if (called_from_criterion(__builtin_return_address(0)))
        return (int)(ARENA_DRAW_FIRST + (unsigned)draw % ARENA_DRAW_COUNT);
    return draw;
}
