/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: `kvmatch sim` (docs/SIM.md). A workload replayed in virtual time through a cluster of
 * simulated engines (src/sim/engine.h), every request routed by a real `kvmatch serve` (in this
 * process, or a running one with `connect`) over the real protocol, the engines' KV events fed to
 * it (in process, or over ZMQ with `zmq`), and the router's lifecycle reports sent back, so the
 * records are complete. Each policy runs the identical workload on a fresh cluster and server; the
 * results say, per policy, what reuse the engines really got, how right the index was at each
 * decision instant, and what it cost in time-to-first-token. */
#ifndef KM_SIM_H
#define KM_SIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/index.h"
#include "sim/engine.h"
#include "sim/workload.h"

#define KM_SIM_MAX_POLICIES 16u
#define KM_SIM_MAX_LOADS 16u
/* The capacity run's sample: this many times the requests the engines can hold at once, and at
 * most this many requests. */
#define KM_SIM_CAPACITY_QUEUE 4.0
#define KM_SIM_CAPACITY_MAX_SAMPLE 100000u
#define KM_SIM_MAX_INSTANCES 16u
/* Shared mode: how long (wall time) a decision waits for every change sent so far to reach every
 * other instance, and the instances' cluster expiry, which the kill fault's window counts in
 * virtual time too. */
#define KM_SIM_PROPAGATION_WAIT_MS 2000u
#define KM_SIM_CLUSTER_EXPIRE_MS 1000u

/* How many kvmatch instances route, and what each sees (docs/SIM.md, "Several instances"). Every
 * instance indexes the same engines (each hears every engine's events); the requests kvmatch
 * routes are spread round robin over the instances, and each request's lifecycle reports go to
 * the instance that decided it. */
typedef enum km_sim_mode {
    KM_SIM_MODE_SINGLE = 0, /* one instance */
    KM_SIM_MODE_ISOLATED,   /* `instances` instances, no cluster: each sees only its own load */
    KM_SIM_MODE_SHARED,     /* `instances` instances sharing their active work over a nats-server
                             * the run starts on a free loopback port (docs/CLUSTER.md) */
} km_sim_mode;

/* "single", "isolated", "shared". */
const char *km_sim_mode_name(km_sim_mode mode);

typedef struct km_sim_config {
    const char *trace_path;              /* a Mooncake JSONL trace; NULL = the generator */
    km_sim_generator_config generator;
    size_t max_requests;                 /* 0 = all */
    /* The TTFT figures (p50, p99, mean) count the requests from this one on, in trace order; the
     * ones before it are routed and simulated as usual (they warm the engines' caches and queue
     * like any other) but left out of those figures. 0 = all; less than the requests run. */
    size_t ttft_from;
    double time_scale;                   /* arrival times x this; default 1 */
    /* Offered load as a fraction of the cluster's capacity (docs/SIM.md, "Load"): with n_loads
     * > 0, arrivals are rescaled so requests arrive at loads[i] times the capacity, and every
     * policy runs at every load (results in load-major order). The loads are increasing, each
     * once. Excludes time_scale != 1. */
    double loads[KM_SIM_MAX_LOADS];
    uint32_t n_loads;
    uint32_t workers;                    /* default 8 */
    km_sim_engine_config engine;         /* every engine (block size, capacity, time model); the
                                          * process seed is derived per worker */
    const char *policies[KM_SIM_MAX_POLICIES];
    uint32_t n_policies;                 /* default: kv, cache_aware, least_load, round_robin */
    const char *connect;                 /* "unix:/path" of a running kvmatch serve (needs zmq);
                                          * NULL = a server in this process */
    const char *engine_preset;           /* the preset engine.model was taken from, its capacity
                                          * perhaps changed (NULL: none); with connect, the pool
                                          * names it */
    const char *policy_engine;           /* the engine preset the router's policies assume (the
                                          * pool's engine); NULL = the engines' own model (with
                                          * connect: engine_preset, else the preset engine.model
                                          * is, else the server's default) */
    bool zmq;                            /* engines publish over ZMQ on loopback TCP (the real
                                          * subscriber, seq numbers and replay) */
    const char *records_dir;             /* keep records-<policy>.jsonl here (a sweep of
                                          * several loads: records-<policy>-load<X>.jsonl per
                                          * load, X as km_sim_load_label writes it); NULL = not
                                          * kept */
    bool step_delivery;                  /* engines publish once per step, as vLLM does (a cache
                                          * changed at a step's start is told at its end: the
                                          * index lags within a step); default false: events are
                                          * delivered as they happen, so the index is exact */
    /* Faults, one at a time or together (docs/SIM.md, "Faults"). Times are virtual seconds from
     * the first arrival. */
    double drop_events;                  /* drop this share of engine messages on the wire, from
                                          * drop_from_s on; 0 = none */
    double drop_from_s;
    int cut_worker;                      /* cut this worker's stream (-1 = none) ... */
    double cut_at_s, cut_for_s;          /* ... from cut_at_s for cut_for_s seconds */
    uint32_t replay_buffer;              /* --zmq: messages each engine keeps for replay (vLLM's
                                          * buffer_steps); default 10,000 */
    int restart_worker;                  /* restart this engine (-1 = none): cache lost, seq back to
                                          * 0, its running requests fail */
    double restart_at_s;
    double restart_kvmatch_at_s;         /* stop kvmatch and start a new one then (< 0 = never) */
    bool restart_kvmatch_snapshot;       /* ... restoring the snapshot the old one wrote on the way
                                          * out (needs zmq: only subscriber feeds are saved) */
    double second_ingress;               /* this share of requests bypasses kvmatch (another
                                          * router): their load is invisible here, their events
                                          * are not */
    double override;                     /* this share of routed requests the router sends to
                                          * another worker than the decision's (uniformly drawn)
                                          * and says so (lifecycle `worker`); needs workers >= 2 */
    /* Workers in approximate mode: no event stream (the engines' messages reach nobody); the index
     * learns from the decisions (and reported overrides) alone, each worker's assumed blocks
     * bounded by the engine's capacity. In process only (no zmq, no connect). */
    bool approx;
    int64_t approx_dispatch_max_bytes;   /* the server's approx_dispatch_max_bytes; < 0 = its
                                          * default (0: overrides teach nothing) */
    /* Faults of the shared mode (docs/SIM.md, "Faults of several instances"); the single and
     * isolated modes run without them. Times are virtual seconds from the first arrival. */
    double kill_instance_at_s;           /* the last instance stops then, for good (< 0 = never):
                                          * its server and its cluster handle go, the router's
                                          * reports of its requests are lost, the others route */
    double nats_stop_at_s;               /* the nats-server is killed then (< 0 = never) ... */
    double nats_stop_for_s;              /* ... and started again on its port this much later */
    double cluster_loss;                 /* a lossy link: each instance sends no change message
                                          * in every round(1/P) (the sequence number is spent);
                                          * 0 = none, else km_sim_cluster_loss_valid */
    km_sim_mode mode;                    /* default single */
    uint32_t instances;                  /* isolated and shared: 2..KM_SIM_MAX_INSTANCES (1 is
                                          * accepted and means one instance); single: 1. Several
                                          * instances exclude --connect, --zmq and
                                          * --restart-kvmatch */
    km_log_fn log;                       /* progress lines; NULL = stderr */
    void *log_user;
} km_sim_config;

void km_sim_config_init(km_sim_config *cfg);

/* One policy's run. Token counts are prompt tokens; depths are blocks of engine.block_size. */
/* A recovery window as the decisions saw it: from the first decision that showed the worker's
 * index state other than LIVE to the first that showed it LIVE again (virtual seconds from the
 * first arrival; end < 0 while still open at the end of the run). */
#define KM_SIM_MAX_WINDOWS 16u
typedef struct km_sim_window {
    uint32_t worker;
    char state[16];      /* the state that opened it: SYNCING, GAP, DEGRADED, ... */
    double start_s, end_s;
    uint64_t decisions;  /* decisions taken while it was open (any worker chosen) */
    uint64_t exact;      /* of those, exact predictions */
} km_sim_window;

typedef struct km_sim_result {
    char policy[32];
    km_sim_mode mode;
    uint32_t instances;
    /* Decisions whose load view held other instances' work (load_scope "cluster" with at least
     * one remote contribution applied): 0 unless the mode is shared. */
    uint64_t cluster_scope_decisions;
    /* Decisions where some candidate's in-flight count exceeded what the deciding instance itself
     * had sent to that worker and not yet seen finish: the other instances' load, seen. */
    uint64_t remote_load_seen;
    /* Shared mode: how the cluster view behaved (each 0 in the other modes). */
    uint64_t this_instance_decisions; /* decisions labelled load_scope this_instance */
    uint64_t stale_view_decisions;    /* decisions whose view listed a stale contribution */
    uint64_t propagation_timeouts;    /* waits for every change to reach every instance that hit
                                       * their bound (KM_SIM_PROPAGATION_WAIT_MS), and the faults'
                                       * waits that did (an expiry, NATS gone or back) */
    uint64_t cluster_lost_messages;   /* gaps the instances detected (their lost_messages) */
    uint64_t cluster_expired;         /* contributions the instances dropped for silence */
    uint64_t cluster_reconnects;      /* reconnections to NATS, over the instances */
    uint64_t cluster_publish_failures; /* changes not sent: the lossy link's drops and publishes
                                        * the NATS client refused */
    uint64_t reports_lost_to_kill;    /* lifecycle reports for a killed instance: nobody got them */
    /* Decisions counting the killed instance's contribution after the kill (its work, still
     * running on the engines, until the survivors expire it). */
    uint64_t counting_killed_decisions;
    /* Decisions after every fault of the run had recovered (the killed instance expired, NATS
     * back and every survivor holding every other's contribution again), and of those the ones
     * in the cluster's view and the ones still counting the killed instance. */
    uint64_t decisions_after_faults, cluster_scope_after_faults, counting_killed_after_faults;
    double load;                      /* the offered load of this run; 0 = the trace's own times */
    double offered_rps;               /* km_sim_arrival_rate of the replayed arrivals */
    /* Requests finished per second between the 10th and the 90th percentile of finish times
     * (the steady part of the run, without its ramp and its drain). */
    double throughput_rps;
    /* First tokens per second between the 10th and the 90th percentile of their times: the rate
     * the cluster takes requests on. */
    double first_token_rps;
    /* The same until the first moment some engine had nothing left waiting (0 when fewer than a
     * tenth of the requests finished before it): the cluster's throughput while saturated. */
    double saturated_throughput_rps;
    double reused_share;              /* actual_reused_tokens / prompt_tokens */
    double ttft_mean_ms;              /* NAN when no request got a first token */
    uint64_t requests;                /* requests in the workload */
    uint64_t routed;                  /* decided by kvmatch */
    uint64_t route_errors;            /* answered with an error (then sent round-robin) */
    uint64_t rejected;                /* requests an engine rejected (it can never hold them),
                                       * routed by kvmatch or not */
    uint64_t prompt_tokens;
    uint64_t output_tokens;
    uint64_t actual_reused_tokens;    /* what the engines reused when they ran each request */
    uint64_t predicted_reused_tokens; /* the chosen worker's predicted depth x block size */
    /* The prediction against the chosen engine's real cache at the decision instant. */
    uint64_t exact_predictions;
    uint64_t over_predictions;        /* the index claimed blocks the engine no longer had */
    uint64_t under_predictions;       /* the engine had blocks the index did not know of */
    uint64_t pending_at_decision;     /* of the inexact ones: the engine had events produced but
                                       * not yet published (a step in progress) */
    /* Predicted depth against the blocks held when the request ran, and why they differ. */
    uint64_t realized_as_predicted;
    uint64_t diff_index_wrong;        /* the index already differed at the decision instant: */
    uint64_t diff_not_delivered;      /*   ... events not yet delivered (a step unpublished, a gap
                                       *   being replayed, a cut in progress) */
    uint64_t diff_lost;               /*   ... events lost (the chosen worker was DEGRADED) */
    uint64_t diff_assumed;            /*   ... no events at all: the placement was assumed
                                       *   (approximate mode) */
    uint64_t diff_cache_changed;      /* the index was right; the cache changed before the request
                                       * ran (evictions, new blocks) */
    uint64_t unadmitted;              /* routed but never run (rejected, or lost to a restart
                                       * before its admission): the attribution's remainder */
    uint64_t bypassed;                /* requests sent by the second ingress path */
    uint64_t overridden;              /* routed requests the router sent to another worker (fault);
                                       * their prediction is that worker's depth in the decision */
    uint64_t dropped_messages;        /* engine messages dropped on the wire (faults) */
    uint64_t lost_to_restart;         /* requests running on an engine when it restarted */
    uint64_t follow_up_turns;         /* a generated session's turns after its first */
    uint64_t turns_before_answer;     /* of those, the ones that arrived while the previous turn
                                       * had not finished (arrivals are open loop: SIM.md) */
    uint64_t kvmatch_restarts;        /* restarts of kvmatch itself (fault) */
    uint64_t owner_not_chosen;        /* the deepest match was on another worker */
    /* Warm-ups the decisions asked for, each sent to its engine as a prefill of the request's
     * leading blocks with one output token (no TTFT counted), and the prompt tokens those
     * prefills computed (not found cached when admitted). */
    uint64_t warm_ups, warm_up_prefill_tokens;
    uint64_t warm_ups_rejected;       /* of them, too large for their engine: reported as errors */
    uint64_t owner_forgone_tokens;    /* their (owner depth - chosen depth) x block size */
    double ttft_p50_ms, ttft_p99_ms;  /* virtual time, arrival to first token; NAN when no
                                       * request got a first token (no sample) */
    /* The same three TTFT figures over every request, the cold start included: equal to
     * ttft_mean_ms, ttft_p50_ms and ttft_p99_ms when ttft_from is 0. */
    double every_ttft_mean_ms, every_ttft_p50_ms, every_ttft_p99_ms;
    double makespan_s;                /* first arrival to last finish, virtual; 0 when nothing
                                       * finished */
    double output_tokens_per_s;       /* over the makespan */
    double load_imbalance;            /* max / mean requests per worker */
    double decisions_per_s;           /* routing calls per second of wall time spent in them */
    double decision_p50_us, decision_p99_us; /* one route's round trip, wall time */
    double wall_s;                    /* the whole run, wall time */
    /* Routing quality inside recovery windows (see km_sim_window) against outside them. */
    uint64_t decisions_in_windows, exact_in_windows;
    uint64_t windows_total;           /* windows seen; the first KM_SIM_MAX_WINDOWS are listed */
    uint32_t n_windows;
    km_sim_window windows[KM_SIM_MAX_WINDOWS];
} km_sim_result;

/* What a run found out about its workload and cluster. */
typedef struct km_sim_summary {
    km_sim_workload_stats workload;   /* of the requests replayed, at the run's arrival times
                                       * (time_scale applied; a sweep's loads: the floors below) */
    /* The cluster's capacity on this workload, requests per second: round robin's
     * saturated_throughput_rps with every request of a large enough sample of the workload
     * arriving at once (docs/SIM.md, "Load"; measured only when cfg->n_loads > 0, else 0). */
    double capacity_rps;
    size_t capacity_requests;         /* the sample it was measured on */
    uint32_t capacity_probes;         /* round-robin runs it took (the sample doubles when it was
                                       * too small) */
    double capacity_wall_s;           /* their wall time */
    /* Per load: the factor the arrival times were scaled by, and the floor of the requests at
     * those times (km_sim_floor_ttft_us), p50 and p99 in ms, over the requests the TTFT figures
     * count (ttft_from on) and over every request, leaving out those no engine admits (no first
     * token, no floor); NAN when none is left. */
    double time_scale[KM_SIM_MAX_LOADS];
    double floor_ttft_p50_ms[KM_SIM_MAX_LOADS], floor_ttft_p99_ms[KM_SIM_MAX_LOADS];
    double every_floor_ttft_p50_ms[KM_SIM_MAX_LOADS], every_floor_ttft_p99_ms[KM_SIM_MAX_LOADS];
} km_sim_summary;

/* Is cfg a run km_sim_run would start: every setting in range, no two that exclude each other,
 * every policy known? KM_OK, or KM_ERR_INVALID_ARGUMENT with why naming the setting. Reads no
 * file and starts nothing, so a command line can tell a usage error from a failed run. */
int km_sim_config_check(const km_sim_config *cfg, char *why, size_t why_size);

/* Is P a lossy link's loss the run can inject: one change in every round(1/P) unsent, with
 * round(1/P) in 2..2^32 - 1? P above 2/3 is not: round(1/P) = 1 would send no change at all, so
 * no loss would ever show as a gap. */
bool km_sim_cluster_loss_valid(double p);

/* Can the shared mode run here (nats-server installed)? False with the reason in why. */
bool km_sim_shared_available(char *why, size_t why_size);

/* Run every policy of cfg (at every load of cfg->loads, when given); results holds
 * max(cfg->n_loads, 1) * cfg->n_policies entries, load-major: results[load * n_policies + policy].
 * summary may be NULL. Errors: KM_ERR_INVALID_ARGUMENT (why says which setting), KM_ERR_IO
 * (trace, sockets), errors of the parts (server, engines, client), each with why. */
int km_sim_run(const km_sim_config *cfg, km_sim_result *results, km_sim_summary *summary,
               char *why, size_t why_size);

#endif
