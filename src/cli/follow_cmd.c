/* `kvmatch follow`: follow workers' KV-event streams, print their status, snapshot the index and
 * the stream positions periodically and on SIGTERM / SIGINT, and restore them on start (docs/EVENTS.md,
 * "Restart of kvmatch"). The same subscriber keeps the indexes of `kvmatch serve`; this command runs
 * it alone, to watch the streams without serving routes. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/commands.h"
#include "kvmatch/subscriber.h"

#define FOLLOW_MAX_WORKERS 256

static volatile sig_atomic_t follow_stop = 0;

static void on_signal(int sig)
{
    (void)sig;
    follow_stop = 1;
}

static void follow_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch follow --endpoint ID=PUB[,REPLAY] ... [--snapshot PATH]\n"
            "                      [--snapshot-interval-s N] [--status-s N] [--block-size N]\n"
            "  Follow workers' KV events (vLLM / SGLang ZMQ publishers). With --snapshot, the\n"
            "  index and stream positions are restored from PATH at start (if it exists),\n"
            "  saved every N s (default 60) and on SIGTERM / SIGINT. Status every N s (default 5).\n");
}

static int parse_u32(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || end == s || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static void print_status(km_subscriber *sub, const km_index *index)
{
    uint32_t ids[FOLLOW_MAX_WORKERS], n = 0;
    km_subscriber_get_workers(sub, ids, FOLLOW_MAX_WORKERS, &n);
    km_index_stats is;
    km_index_get_stats(index, &is);
    printf("pairs %llu, blocks %llu\n", (unsigned long long)is.pairs, (unsigned long long)is.blocks);
    for (uint32_t i = 0; i < n && i < FOLLOW_MAX_WORKERS; i++) {
        km_feed_worker_info info;
        if (km_subscriber_get_worker_info(sub, ids[i], &info) != KM_OK)
            continue;
        char refused[320] = "";
        size_t used = 0;
        for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT && used < sizeof refused; r++) {
            if (!info.counters.refused[r])
                continue;
            int k = snprintf(refused + used, sizeof refused - used, "%s %s %llu",
                             used ? "," : ", refused:", km_feed_refusal_name((km_feed_refusal)r),
                             (unsigned long long)info.counters.refused[r]);
            used += k > 0 ? (size_t)k : 0;
        }
        printf("  worker %u %s: %s%s, next seq %llu, messages %llu, lost %llu, restarts %llu, "
               "history unavailable %llu%s%s\n",
               info.worker, info.name, km_feed_state_name(info.state),
               info.config_refused ? " (every store refused: block size is not the pool's)" : "",
               (unsigned long long)info.expected_seq, (unsigned long long)info.counters.messages,
               (unsigned long long)info.counters.lost, (unsigned long long)info.counters.restarts,
               (unsigned long long)info.counters.history_unavailable, refused,
               info.restored ? " (restored)" : "");
    }
    fflush(stdout);
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int km_cmd_follow(int argc, char **argv)
{
    static char specs[FOLLOW_MAX_WORKERS][2 * KM_SUBSCRIBER_ENDPOINT_MAX + 16];
    km_subscriber_worker workers[FOLLOW_MAX_WORKERS];
    uint32_t n_workers = 0, interval_s = 60, status_s = 5, block_size = 16;
    const char *snapshot = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            follow_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvmatch follow: unknown or incomplete option '%s'\n", a);
            follow_usage(stderr);
            return 2;
        }
        i++;
        if (!strcmp(a, "--endpoint")) {
            if (n_workers == FOLLOW_MAX_WORKERS || strlen(v) >= sizeof specs[0]) {
                fprintf(stderr, "kvmatch follow: too many workers or endpoint too long\n");
                return 2;
            }
            char *s = specs[n_workers];
            snprintf(s, sizeof specs[0], "%s", v);
            char *eq = strchr(s, '=');
            uint32_t id;
            if (!eq || (*eq = '\0', parse_u32(s, &id))) {
                fprintf(stderr, "kvmatch follow: --endpoint wants ID=PUB[,REPLAY], got '%s'\n", v);
                return 2;
            }
            char *pub = eq + 1, *comma = strchr(pub, ',');
            if (comma)
                *comma = '\0';
            workers[n_workers] = (km_subscriber_worker){id, NULL, pub, comma ? comma + 1 : NULL};
            n_workers++;
        } else if (!strcmp(a, "--snapshot")) {
            snapshot = v;
        } else if (!strcmp(a, "--snapshot-interval-s") && !parse_u32(v, &interval_s)) {
        } else if (!strcmp(a, "--status-s") && !parse_u32(v, &status_s) && status_s) {
        } else if (!strcmp(a, "--block-size") && !parse_u32(v, &block_size) && block_size) {
        } else {
            fprintf(stderr, "kvmatch follow: bad option '%s %s'\n", a, v);
            follow_usage(stderr);
            return 2;
        }
    }
    if (!n_workers) {
        fprintf(stderr, "kvmatch follow: no --endpoint given\n");
        follow_usage(stderr);
        return 2;
    }
    km_index *index = NULL;
    int rc = km_index_create(NULL, &index);
    if (rc) {
        fprintf(stderr, "kvmatch follow: index: %s\n", km_strerror(rc));
        return 1;
    }
    km_subscriber_config cfg;
    km_subscriber_config_init(&cfg);
    cfg.feed.block_size = block_size;
    if (snapshot) {
        cfg.snapshot_path = snapshot;
        cfg.snapshot_interval_ms = interval_s * 1000u;
        if (access(snapshot, F_OK) == 0)
            cfg.restore_path = snapshot;
    }
    km_subscriber *sub = NULL;
    rc = km_subscriber_create(index, &cfg, &sub);
    if (rc) {
        fprintf(stderr, "kvmatch follow: subscriber: %s\n", km_strerror(rc));
        km_index_destroy(index);
        return 1;
    }
    km_subscriber_stats st;
    km_subscriber_get_stats(sub, &st);
    if (cfg.restore_path)
        printf("restore %s: %s\n", snapshot, st.restored ? "ok" : km_error_name(st.restore_status));
    for (uint32_t i = 0; i < n_workers; i++) {
        rc = km_subscriber_add_worker(sub, &workers[i]);
        if (rc) {
            fprintf(stderr, "kvmatch follow: worker %u: %s\n", workers[i].worker,
                    km_subscriber_last_error(sub));
            km_subscriber_destroy(sub);
            km_index_destroy(index);
            return 1;
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("following %u worker(s)\n", n_workers);
    fflush(stdout);
    double next_status = mono_s() + status_s;
    while (!follow_stop) {
        km_subscriber_flush(sub, NULL); /* also takes the periodic snapshot when due */
        if (mono_s() >= next_status) {
            print_status(sub, index);
            next_status += status_s;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    int status = 0;
    if (snapshot) {
        rc = km_subscriber_save(sub, snapshot);
        if (rc) {
            fprintf(stderr, "kvmatch follow: snapshot on shutdown: %s\n", km_subscriber_last_error(sub));
            status = 1;
        } else {
            printf("snapshot written to %s\n", snapshot);
        }
    }
    print_status(sub, index);
    km_subscriber_destroy(sub);
    km_index_destroy(index);
    return status;
}
