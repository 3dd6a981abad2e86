/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch follow`: follow workers' KV-event streams, print their status, snapshot the index and
 * the stream positions periodically and on SIGTERM / SIGINT, and restore them on start (docs/EVENTS.md,
 * "Restart of kvmatch"). The same subscriber keeps the indexes of `kvmatch serve`; this command runs
 * it alone, to watch the streams without serving routes. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/subscriber.h"

#define FOLLOW_MAX_WORKERS 256

/* getopt codes of the options without a short letter. */
enum {
    OPTION_MAX_PAYLOAD_BYTES = 256,
    OPTION_MAX_PAYLOAD_OBJECTS,
    OPTION_MAX_EVENTS_PER_BATCH,
    OPTION_MAX_HASHES_PER_EVENT,
    OPTION_MAX_TOKENS_PER_EVENT,
    OPTION_MAX_STRING_BYTES,
};

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
            "                      [--max-payload-bytes N] [--max-payload-objects N]\n"
            "                      [--max-events-per-batch N] [--max-hashes-per-event N]\n"
            "                      [--max-tokens-per-event N] [--max-string-bytes N]\n"
            "  Follow workers' KV events (vLLM / SGLang ZMQ publishers). With --snapshot, the\n"
            "  index and stream positions are restored from PATH at start (if it exists),\n"
            "  saved every N s (default 60; 0 = only on exit; needs --snapshot) and on\n"
            "  SIGTERM / SIGINT; its directory must exist and be writable. Status every N s\n"
            "  (default 5).\n"
            "  --max-*: the KV-event decoder's limits (docs/EVENTS.md, \"Limits and memory\");\n"
            "  a message over one is refused as undecodable, naming the limit.\n"
            "  A snapshot that does not restore (another block size or version, damaged) is\n"
            "  kept: moved to PATH.unrestorable-<UTC time> before the first snapshot.\n"
            "  Exit status: 0 ok, 1 failure (start, snapshot), 2 usage.\n");
}

static void print_status(km_subscriber *sub, const km_index *index)
{
    uint32_t ids[FOLLOW_MAX_WORKERS], n = 0;
    km_subscriber_get_workers(sub, ids, FOLLOW_MAX_WORKERS, &n);
    km_index_stats is;
    km_index_get_stats(index, &is);
    printf("pairs %llu, blocks %llu\n", (unsigned long long)is.pairs, (unsigned long long)is.blocks);
    km_subscriber_stats st;
    if (km_subscriber_get_stats(sub, &st) == KM_OK && st.restore_status != KM_OK)
        printf("  the snapshot did not restore at start (%s); %s%s\n",
               km_error_name(st.restore_status),
               st.unrestorable_kept_as[0] ? "it is kept as " : "it is moved aside before the "
                                                               "first snapshot",
               st.unrestorable_kept_as);
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
               "history unavailable %llu%s%s%s%s%s\n",
               info.worker, info.name, km_feed_state_name(info.state),
               info.config_refused ? " (every store refused: block size is not the pool's)" : "",
               (unsigned long long)info.expected_seq, (unsigned long long)info.counters.messages,
               (unsigned long long)info.counters.lost, (unsigned long long)info.counters.restarts,
               (unsigned long long)info.counters.history_unavailable, refused,
               refused[0] && info.latest_refusal[0] ? " (latest: " : "",
               refused[0] ? info.latest_refusal : "",
               refused[0] && info.latest_refusal[0] ? ")" : "", info.restored ? " (restored)" : "");
    }
    fflush(stdout);
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The directory a snapshot file goes to exists and takes new files (the save writes a temporary
 * file beside the target, then renames it); false with the sentence printed. */
static bool snapshot_dir_writable(const char *path)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    if (access(dir, W_OK | X_OK) != 0) {
        fprintf(stderr, "kvmatch follow: --snapshot %s: directory %s: %s\n", path, dir,
                strerror(errno));
        return false;
    }
    return true;
}

int km_cmd_follow(int argc, char **argv)
{
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"endpoint", required_argument, NULL, 'e'},
        {"snapshot", required_argument, NULL, 's'},
        {"snapshot-interval-s", required_argument, NULL, 'i'},
        {"status-s", required_argument, NULL, 't'},
        {"block-size", required_argument, NULL, 'b'},
        {"max-payload-bytes", required_argument, NULL, OPTION_MAX_PAYLOAD_BYTES},
        {"max-payload-objects", required_argument, NULL, OPTION_MAX_PAYLOAD_OBJECTS},
        {"max-events-per-batch", required_argument, NULL, OPTION_MAX_EVENTS_PER_BATCH},
        {"max-hashes-per-event", required_argument, NULL, OPTION_MAX_HASHES_PER_EVENT},
        {"max-tokens-per-event", required_argument, NULL, OPTION_MAX_TOKENS_PER_EVENT},
        {"max-string-bytes", required_argument, NULL, OPTION_MAX_STRING_BYTES},
        {NULL, 0, NULL, 0},
    };
    km_kv_decoder_config decoder;
    km_kv_decoder_config_init(&decoder);
    static char specs[FOLLOW_MAX_WORKERS][2 * KM_SUBSCRIBER_ENDPOINT_MAX + 16];
    km_subscriber_worker workers[FOLLOW_MAX_WORKERS];
    uint32_t n_workers = 0, interval_s = 60, status_s = 5, block_size = 16;
    const char *snapshot = NULL;
    bool interval_given = false;
    km_index_config index_defaults; /* the index below is made with these */
    km_index_config_init(&index_defaults);
    uint32_t max_workers = index_defaults.max_workers;
    km_cli_getopt_begin(argv, "follow");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        const char *v = optarg;
        switch (opt) {
        case 'h':
            follow_usage(stdout);
            return KM_EXIT_OK;
        case 'e': {
            if (n_workers == FOLLOW_MAX_WORKERS || strlen(v) >= sizeof specs[0]) {
                fprintf(stderr, "kvmatch follow: at most %u --endpoint, each under %zu bytes\n",
                        FOLLOW_MAX_WORKERS, sizeof specs[0]);
                return KM_EXIT_USAGE;
            }
            char *sp = specs[n_workers];
            snprintf(sp, sizeof specs[0], "%s", v);
            char *eq = strchr(sp, '=');
            char *pub = eq ? eq + 1 : NULL, *comma = pub ? strchr(pub, ',') : NULL;
            uint64_t id;
            if (!eq || !km_cli_parse_u64(sp, (size_t)(eq - sp), max_workers - 1, &id) ||
                *pub == '\0' || *pub == ',' || (comma && comma[1] == '\0')) {
                fprintf(stderr, "kvmatch follow: --endpoint wants ID=PUB[,REPLAY] with ID in "
                                "0..%u and PUB a ZMQ address, got \"%s\"\n", max_workers - 1, v);
                return KM_EXIT_USAGE;
            }
            for (uint32_t k = 0; k < n_workers; k++)
                if (workers[k].worker == id) {
                    fprintf(stderr, "kvmatch follow: --endpoint %s: worker %" PRIu64 " is given "
                                    "twice\n", v, id);
                    return KM_EXIT_USAGE;
                }
            if (comma)
                *comma = '\0';
            workers[n_workers] =
                (km_subscriber_worker){(uint32_t)id, NULL, pub, comma ? comma + 1 : NULL};
            n_workers++;
            break;
        }
        case 's':
            snapshot = v;
            break;
        case 'i':
            if (!km_cli_u32("follow", "snapshot-interval-s", v, 0, 86400, &interval_s))
                return KM_EXIT_USAGE;
            interval_given = true;
            break;
        case 't':
            if (!km_cli_u32("follow", "status-s", v, 1, 86400, &status_s))
                return KM_EXIT_USAGE;
            break;
        case 'b':
            if (!km_cli_u32("follow", "block-size", v, 1, 1u << 20, &block_size))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_PAYLOAD_BYTES:
            if (!km_cli_u64("follow", "max-payload-bytes", v, 1, UINT32_MAX,
                            &decoder.max_payload_bytes))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_PAYLOAD_OBJECTS:
            if (!km_cli_u32("follow", "max-payload-objects", v, 1, UINT32_MAX,
                            &decoder.max_payload_objects))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_EVENTS_PER_BATCH:
            if (!km_cli_u32("follow", "max-events-per-batch", v, 1, UINT32_MAX,
                            &decoder.max_events_per_batch))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_HASHES_PER_EVENT:
            if (!km_cli_u32("follow", "max-hashes-per-event", v, 1, UINT32_MAX,
                            &decoder.max_hashes_per_event))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_TOKENS_PER_EVENT:
            if (!km_cli_u32("follow", "max-tokens-per-event", v, 1, UINT32_MAX,
                            &decoder.max_tokens_per_event))
                return KM_EXIT_USAGE;
            break;
        case OPTION_MAX_STRING_BYTES:
            if (!km_cli_u32("follow", "max-string-bytes", v, 1, UINT32_MAX,
                            &decoder.max_string_bytes))
                return KM_EXIT_USAGE;
            break;
        default:
            return km_cli_usage_error("follow");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch follow: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("follow");
    }
    if (!n_workers) {
        fprintf(stderr, "kvmatch follow: no --endpoint given\n");
        return km_cli_usage_error("follow");
    }
    if (interval_given && !snapshot) {
        fprintf(stderr, "kvmatch follow: --snapshot-interval-s needs --snapshot PATH\n");
        return km_cli_usage_error("follow");
    }
    if (snapshot && !snapshot_dir_writable(snapshot))
        return KM_EXIT_FAILURE;
    km_index *index = NULL;
    int rc = km_index_create(&index_defaults, &index);
    if (rc) {
        fprintf(stderr, "kvmatch follow: index: %s\n", km_strerror(rc));
        return 1;
    }
    km_subscriber_config cfg;
    km_subscriber_config_init(&cfg);
    cfg.feed.block_size = block_size;
    cfg.decoder = decoder;
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
    if (cfg.restore_path && st.restored)
        printf("restore %s: ok\n", snapshot);
    else if (cfg.restore_path)
        printf("restore %s: %s: %s; starting empty, the file is kept (moved aside before the "
               "first snapshot)\n",
               snapshot, km_error_name(st.restore_status), st.restore_error);
    for (uint32_t i = 0; i < n_workers; i++) {
        rc = km_subscriber_add_worker(sub, &workers[i]);
        if (rc) {
            fprintf(stderr, "kvmatch follow: worker %u: %s\n", workers[i].worker,
                    km_subscriber_last_error(sub));
            km_subscriber_destroy(sub);
            km_index_destroy(index);
            /* an address ZMQ cannot connect to, an id outside the index: the --endpoint's fault */
            return rc == KM_ERR_INVALID_ARGUMENT || rc == KM_ERR_WORKER_RANGE ||
                           rc == KM_ERR_TOO_LARGE
                       ? KM_EXIT_USAGE
                       : KM_EXIT_FAILURE;
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
    km_subscriber_get_stats(sub, &st);
    if (st.unrestorable_kept_as[0])
        fprintf(stderr,
                "kvmatch follow: note: %s did not restore at start (%s); it is kept as %s\n",
                snapshot, km_error_name(st.restore_status), st.unrestorable_kept_as);
    else if (cfg.restore_path && !st.restored)
        fprintf(stderr, "kvmatch follow: note: %s did not restore at start (%s)\n", snapshot,
                km_error_name(st.restore_status));
    km_subscriber_destroy(sub);
    km_index_destroy(index);
    return status;
}
