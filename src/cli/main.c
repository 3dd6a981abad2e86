/* SPDX-License-Identifier: Apache-2.0 */
/* kvmatch: one binary, several subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"

#if KM_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>

/* The executable's allocator settings, read by jemalloc at start-up (MALLOC_CONF in the
 * environment is applied after them). Its background thread hands freed pages back to the system
 * over the following seconds, so memory comes back after an overload without any thread walking
 * the heap under a lock the serving threads need. */
const char *malloc_conf = "background_thread:true";

static void print_allocator(void)
{
    const char *version = NULL;
    bool background = false;
    size_t vsize = sizeof version, bsize = sizeof background;
    if (mallctl("version", &version, &vsize, NULL, 0) != 0)
        version = "?";
    if (mallctl("opt.background_thread", &background, &bsize, NULL, 0) != 0)
        background = false;
    printf("allocator: jemalloc %s%s\n", version,
           background ? ", background purging" : ", no background purging");
}
#else
static void print_allocator(void)
{
    printf("allocator: the C library's malloc\n");
}
#endif

static void usage(FILE *f)
{
    fprintf(f,
            "kvmatch %s: placement index and decision engine for cache-aware LLM routing\n"
            "\n"
            "usage:\n"
            "  kvmatch hash --block-size N [--lora NAME] [--salt S] < tokens\n"
            "      chain-hash decimal token ids (docs/HASHING.md); one line per full block\n"
            "  kvmatch bench index [--json] [--quick] [--threads N] [--trace PATH]\n"
            "      index benchmark on the Mooncake trace (docs/BENCHMARKS.md)\n"
            "  kvmatch bench events [--json] [--quick] [--trace PATH]\n"
            "      KV-event ingestion (in process, loopback ZMQ) and restart time (docs/BENCHMARKS.md)\n"
            "  kvmatch bench ipc [--json] [--quick] [--seconds S] [--records]\n"
            "      decisions/s and round trips of a kvmatch serve it starts (docs/BENCHMARKS.md)\n"
            "  kvmatch bench replay [--json] [--quick] [--trace PATH]\n"
            "      sustained query rate under 1 / 10 ms p99 with interleaved updates, per index\n"
            "  kvmatch bench growth [--json] [--quick]\n"
            "      the longest single call while the index and its bookkeeping grow from empty\n"
            "  kvmatch bench cluster [--json] [--quick] [--rate N]\n"
            "      active-work updates/s and visibility lag through NATS, 2 and 4 instances\n"
            "  kvmatch follow --endpoint ID=PUB[,REPLAY] ... [--snapshot PATH] [--snapshot-interval-s N]\n"
            "      follow workers' KV events; snapshot periodically and on SIGTERM, restore at start\n"
            "  kvmatch serve [--config FILE] [options]\n"
            "      the routing service: Unix socket / loopback TCP, decisions and records\n"
            "      (docs/SERVICE.md, docs/PROTOCOL.md); --help lists the options\n"
            "  kvmatch route [--connect ADDR] [options] < token ids\n"
            "      ask a running service: route, --status, --workers, --add-worker, --remove-worker\n"
            "  kvmatch sim [--trace FILE] [--workers N] [--policy P[,P...]] [options]\n"
            "      replay a workload through simulated engines routed by kvmatch (docs/SIM.md)\n"
            "  kvmatch analyze [--json] [--html OUT.html] RECORDS.jsonl...\n"
            "      join decision and outcome records: predicted vs actual reuse, owner != chosen,\n"
            "      stale predictions, outcomes, recovery windows (docs/ANALYZE.md)\n"
            "  kvmatch version\n",
            KVMATCH_VERSION);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        if (argc == 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            fputs("usage: kvmatch version\n"
                  "  the version, and the allocator the executable was linked with\n", stdout);
            return KM_EXIT_OK;
        }
        if (argc > 2) {
            fprintf(stderr, "kvmatch %s: unexpected argument \"%s\"\n", argv[1], argv[2]);
            return KM_EXIT_USAGE;
        }
        printf("kvmatch %s\n", KVMATCH_VERSION);
        print_allocator();
        return 0;
    }
    if (!strcmp(argv[1], "hash"))
        return km_cmd_hash(argc - 1, argv + 1);
    if (!strcmp(argv[1], "follow"))
        return km_cmd_follow(argc - 1, argv + 1);
    if (!strcmp(argv[1], "serve"))
        return km_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(argv[1], "route"))
        return km_cmd_route(argc - 1, argv + 1);
    if (!strcmp(argv[1], "sim"))
        return km_cmd_sim(argc - 1, argv + 1);
    if (!strcmp(argv[1], "analyze"))
        return km_cmd_analyze(argc - 1, argv + 1);
    if (!strcmp(argv[1], "bench")) {
        if (argc >= 3 && !strcmp(argv[2], "index"))
            return km_bench_index_main(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], "events"))
            return km_bench_events_main(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], "ipc"))
            return km_bench_ipc_main(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], "replay"))
            return km_bench_replay_main(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], "growth"))
            return km_bench_growth_main(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], "cluster"))
            return km_bench_cluster_main(argc - 2, argv + 2);
        static const char bench_usage[] =
            "usage: kvmatch bench BENCHMARK [options]   (kvmatch bench BENCHMARK --help for each)\n"
            "  BENCHMARK: index, events, ipc, replay, growth, cluster (docs/BENCHMARKS.md)\n";
        if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            fputs(bench_usage, stdout);
            return KM_EXIT_OK;
        }
        fprintf(stderr, "kvmatch bench: %s benchmark%s%s\n", argc >= 3 ? "unknown" : "missing",
                argc >= 3 ? " " : "", argc >= 3 ? argv[2] : "");
        fputs(bench_usage, stderr);
        return KM_EXIT_USAGE;
    }
    fprintf(stderr, "kvmatch: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
