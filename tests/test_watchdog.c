/* SPDX-License-Identifier: Apache-2.0 */
/* Every test ends by its own timeout, whether or not the runner's timer fires.
 *
 * Criterion hands a test's .timeout to BoxFort, whose queue of deadlines (0.1.2, as Debian ships
 * it) drops every later deadline when a test with an earlier one starts: with two jobs, a test of
 * 90 s running beside one of 10 s starting after it is never timed out, and a test that hangs holds
 * the whole run with nothing reported. So each test process watches its own deadline here: a
 * thread started before main in every Criterion worker (never in the runner) waits until the test
 * is known, then sleeps until its timeout (the test's, else its suite's, else DEFAULT_TIMEOUT_S)
 * plus GRACE_S has passed. Where the runner's timer works it fires first, and Criterion reports
 * "Timed out"; otherwise this thread names the test and its timeout on standard error and kills
 * the test's process group (the worker and what it started in its group), and Criterion reports
 * the test crashed. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { DEFAULT_TIMEOUT_S = 600, GRACE_S = 5 };

/* How long a worker may take to learn which test it runs before the watch gives up. */
enum { FIND_TEST_LIMIT_MS = 60000 };

static const struct criterion_test *current_test(void)
{
    /* Declared const in Criterion's header, written by the worker's main thread once the test's
     * context is read; loaded atomically so each poll reads it afresh. */
    return __atomic_load_n((const struct criterion_test **)&criterion_current_test,
                           __ATOMIC_ACQUIRE);
}

static double timeout_of(const struct criterion_test *test)
{
    if (test->data && test->data->timeout > 0)
        return test->data->timeout;
    const struct criterion_suite *suite =
        __atomic_load_n((const struct criterion_suite **)&criterion_current_suite,
                        __ATOMIC_ACQUIRE);
    if (suite && suite->data && suite->data->timeout > 0)
        return suite->data->timeout;
    return DEFAULT_TIMEOUT_S;
}

static void sleep_until(const struct timespec *when)
{
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, when, NULL) == EINTR)
        ;
}

static void *watch(void *unused)
{
    (void)unused;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    const struct criterion_test *test = NULL;
    for (int waited_ms = 0; !(test = current_test()); waited_ms += 5) {
        if (waited_ms >= FIND_TEST_LIMIT_MS)
            return NULL;
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    double timeout_s = timeout_of(test);
    struct timespec deadline = start;
    deadline.tv_sec += (time_t)timeout_s + GRACE_S;
    deadline.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    sleep_until(&deadline);
    fprintf(stderr, "test watchdog: %s::%s is past its %.0f s timeout and is ended\n",
            test->category, test->name, timeout_s);
    fflush(stderr);
    /* The worker leads its own process group; should it not, only the worker is killed. */
    if (getpgrp() == getpid())
        kill(0, SIGKILL);
    raise(SIGKILL);
    return NULL;
}

__attribute__((constructor)) static void start_watch(void)
{
    if (!getenv("BXFI_MAP")) /* BoxFort's mark of a worker */
        return;
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Signals go to the test's own threads: this one blocks them all. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    if (pthread_create(&thread, &attr, watch, NULL) != 0)
        fprintf(stderr, "test watchdog: not started; a hung test is ended only by the runner\n");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}
