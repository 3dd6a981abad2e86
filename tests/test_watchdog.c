/* SPDX-License-Identifier: Apache-2.0 */
/* Every test ends by its own timeout, whether or not the runner's timer fires.
 *
 * Criterion hands a test's .timeout to BoxFort, whose queue of deadlines (0.1.2, as Debian ships
 * it) drops every later deadline when a test with an earlier one starts: with two jobs, a test of
 * 90 s running beside one of 10 s starting after it is never timed out, and a test that hangs holds
 * the whole run with nothing reported. So each test process watches its own deadline here.
 * Criterion's per-test setup (criterion_internal_test_setup, called by every test's entry in the
 * worker before its .init) is wrapped: on the worker's main thread, while the test's description
 * is valid, the wrapper copies the test's name and timeout (the test's, else its suite's, else
 * DEFAULT_TIMEOUT_S) and starts a thread that sleeps until that timeout plus GRACE_S has passed.
 * Where the runner's timer works it fires first, and Criterion reports "Timed out"; otherwise the
 * thread names the test and its timeout on standard error and kills the test's process group (the
 * worker and what it started in its group), and Criterion reports the test crashed. */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { DEFAULT_TIMEOUT_S = 600, GRACE_S = 5 };

static char watched_name[512];
static double watched_timeout_s;
static struct timespec watched_deadline;

/* The extra data Criterion's worker reads from its context is not always aligned for its type:
 * the timeout is copied out byte-wise. */
static double timeout_in(const struct criterion_test_extra_data *data)
{
    double timeout = 0;
    if (data)
        memcpy(&timeout, (const char *)data + offsetof(struct criterion_test_extra_data, timeout),
               sizeof timeout);
    return timeout;
}

static double timeout_of(const struct criterion_test *test, const struct criterion_suite *suite)
{
    double timeout = test ? timeout_in(test->data) : 0;
    if (timeout > 0)
        return timeout;
    timeout = suite ? timeout_in(suite->data) : 0;
    return timeout > 0 ? timeout : DEFAULT_TIMEOUT_S;
}

/* Posted by the watch thread once it runs: the test starts only after the thread is set up, so no
 * exit during a short test meets the thread half started (LeakSanitizer would take the runtime's
 * buffers of a thread still starting for a leak). */
static sem_t watch_started;

static void *watch(void *unused)
{
    (void)unused;
    sem_post(&watch_started);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &watched_deadline, NULL) == EINTR)
        ;
    fprintf(stderr, "test watchdog: %s is past its %.0f s timeout and is ended\n", watched_name,
            watched_timeout_s);
    fflush(stderr);
    /* The worker leads its own process group; should it not, only the worker is killed. */
    if (getpgrp() == getpid())
        kill(0, SIGKILL);
    raise(SIGKILL);
    return NULL;
}

static void start_watch(void)
{
    const struct criterion_test *test = criterion_current_test;
    const struct criterion_suite *suite = criterion_current_suite;
    snprintf(watched_name, sizeof watched_name, "%s::%s",
             test && test->category ? test->category : "?", test && test->name ? test->name : "?");
    watched_timeout_s = timeout_of(test, suite);
    clock_gettime(CLOCK_MONOTONIC, &watched_deadline);
    double whole = (double)(time_t)watched_timeout_s;
    watched_deadline.tv_sec += (time_t)whole + GRACE_S;
    watched_deadline.tv_nsec += (long)((watched_timeout_s - whole) * 1e9);
    if (watched_deadline.tv_nsec >= 1000000000L) {
        watched_deadline.tv_sec++;
        watched_deadline.tv_nsec -= 1000000000L;
    }
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Signals go to the test's own threads: this one blocks them all. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    if (sem_init(&watch_started, 0, 0) != 0 || pthread_create(&thread, &attr, watch, NULL) != 0)
        fprintf(stderr, "test watchdog: not started for %s; only the runner's timer bounds it\n",
                watched_name);
    else
        while (sem_wait(&watch_started) != 0 && errno == EINTR)
            ;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

void criterion_internal_test_setup(void)
{
    static void (*criterions_setup)(void);
    if (!criterions_setup)
        *(void **)&criterions_setup = dlsym(RTLD_NEXT, "criterion_internal_test_setup");
    if (!criterions_setup)
        abort(); /* a broken test build: Criterion is not linked dynamically */
    start_watch();
    criterions_setup();
}
