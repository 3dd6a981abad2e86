/* SPDX-License-Identifier: Apache-2.0 */
/* Subcommands of the kvmatch binary. Each takes argv after the subcommand word(s) (argv[0] is the
 * last word, e.g. "index" for `kvmatch bench index`) and returns the process exit status. */
#ifndef KM_CLI_COMMANDS_H
#define KM_CLI_COMMANDS_H

int km_cmd_hash(int argc, char **argv);        /* src/cli/hash_cmd.c */
int km_cmd_follow(int argc, char **argv);      /* src/cli/follow_cmd.c: `kvmatch follow` */
int km_cmd_serve(int argc, char **argv);       /* src/cli/serve_cmd.c: `kvmatch serve` */
int km_cmd_route(int argc, char **argv);       /* src/cli/route_cmd.c: `kvmatch route` */
int km_cmd_sim(int argc, char **argv);         /* src/cli/sim_cmd.c: `kvmatch sim` */
int km_cmd_analyze(int argc, char **argv);     /* src/cli/analyze_cmd.c: `kvmatch analyze` */
int km_bench_index_main(int argc, char **argv); /* bench/bench_index.c: `kvmatch bench index` */
int km_bench_events_main(int argc, char **argv); /* bench/bench_events.c: `kvmatch bench events` */
int km_bench_ipc_main(int argc, char **argv);    /* bench/bench_ipc.c: `kvmatch bench ipc` */
int km_bench_replay_main(int argc, char **argv); /* bench/bench_replay.c: `kvmatch bench replay` */
int km_bench_growth_main(int argc, char **argv); /* bench/bench_growth.c: `kvmatch bench growth` */
int km_bench_cluster_main(int argc, char **argv); /* bench/bench_cluster.c: `kvmatch bench cluster` */

#endif
