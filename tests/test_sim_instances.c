/* `kvmatch sim` with several kvmatch instances (src/sim/sim.h, docs/SIM.md "Several instances"):
 * isolated instances never see each other's load and replay the same per seed; instances sharing
 * their active work over a real nats-server (started by the simulator on a free loopback port) see
 * the others' requests in their decisions, every change applied before the next decision (so the
 * run is the same per seed); the faults of several instances (a killed instance, NATS restarted,
 * a lossy link) show in the results; the settings several instances exclude are refused. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "kvmatch/error.h"
#include "sim/broker.h"
#include "sim/sim.h"
#include "test_util.h"

static void quiet(void *user, const char *line)
{
    (void)user;
    (void)line;
}

/* An agent workload on 4 small engines at a rate that keeps several requests on each worker. */
static void moderate_config(km_sim_config *cfg, km_sim_mode mode, uint32_t instances)
{
    km_sim_config_init(cfg);
    km_sim_generator_config_shape(KM_SIM_SHAPE_AGENT, &cfg->generator);
    cfg->generator.seed = 5;
    cfg->generator.requests = 120;
    cfg->generator.rate_per_s = 20;
    cfg->workers = 4;
    cfg->engine.model.capacity_blocks = 4096;
    cfg->policies[0] = "kv";
    cfg->policies[1] = "least_load";
    cfg->n_policies = 2;
    cfg->mode = mode;
    cfg->instances = instances;
    cfg->log = quiet;
}

/* Everything but wall-clock figures. */
static void assert_same(const km_sim_result *a, const km_sim_result *b)
{
    km_sim_result x = *a, y = *b;
    x.decisions_per_s = y.decisions_per_s = 0;
    x.decision_p50_us = y.decision_p50_us = 0;
    x.decision_p99_us = y.decision_p99_us = 0;
    x.wall_s = y.wall_s = 0;
    cr_assert(memcmp(&x, &y, sizeof x) == 0, "policy %s differs between two runs of one seed "
              "(ttft p50 %.3f vs %.3f)", a->policy, a->ttft_p50_ms, b->ttft_p50_ms);
}

Test(sim_instances, isolated_instances_see_only_their_own_load, .timeout = 120)
{
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_ISOLATED, 2);
    km_sim_result a[KM_SIM_MAX_POLICIES], b[KM_SIM_MAX_POLICIES], one[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, a, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(km_sim_run(&cfg, b, NULL, why, sizeof why), KM_OK, "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SINGLE, 1);
    cr_assert_eq(km_sim_run(&cfg, one, NULL, why, sizeof why), KM_OK, "%s", why);
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        assert_same(&a[i], &b[i]);
        cr_assert_eq(a[i].mode, KM_SIM_MODE_ISOLATED);
        cr_assert_eq(a[i].instances, 2);
        cr_assert_eq(a[i].routed, a[i].requests);
        cr_assert_eq(a[i].route_errors, 0);
        /* No instance ever weighs a request another one routed. */
        cr_assert_eq(a[i].cluster_scope_decisions, 0);
        cr_assert_eq(a[i].remote_load_seen, 0, "%s: %llu decisions saw foreign load", a[i].policy,
                     (unsigned long long)a[i].remote_load_seen);
        cr_assert_eq(one[i].remote_load_seen, 0);
        cr_assert_eq(one[i].instances, 1);
        /* The same workload either way. */
        cr_assert_eq(a[i].prompt_tokens, one[i].prompt_tokens);
        cr_assert_eq(a[i].output_tokens, one[i].output_tokens);
    }
    /* Half the view changes least_load's choices: the isolated run is not the single one. */
    cr_assert(memcmp(&a[1].ttft_p50_ms, &one[1].ttft_p50_ms, sizeof(double)) != 0 ||
                  a[1].load_imbalance != one[1].load_imbalance,
              "least_load routed identically with half the load view");
}

static void skip_without_nats(void)
{
    if (!km_sim_broker_binary())
        cr_skip_test("nats-server is not installed (Debian package nats-server): the shared mode "
                     "cannot run");
}

/* Everything a decision sequence decides, whatever the mode: the results less the mode and what
 * only describes the instances' views. */
static void assert_same_decisions(const km_sim_result *a, const km_sim_result *b)
{
    km_sim_result x = *a, y = *b;
    km_sim_result *both[2] = {&x, &y};
    for (int k = 0; k < 2; k++) {
        km_sim_result *r = both[k];
        r->mode = KM_SIM_MODE_SINGLE;
        r->instances = 1;
        r->cluster_scope_decisions = r->remote_load_seen = 0;
        r->decisions_per_s = r->decision_p50_us = r->decision_p99_us = r->wall_s = 0;
    }
    cr_assert(memcmp(&x, &y, sizeof x) == 0, "policy %s: shared decided otherwise than single "
              "(ttft p50 %.3f vs %.3f, p99 %.3f vs %.3f)", a->policy, a->ttft_p50_ms,
              b->ttft_p50_ms, a->ttft_p99_ms, b->ttft_p99_ms);
}

Test(sim_instances, shared_instances_see_each_others_load, .timeout = 120)
{
    skip_without_nats();
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    km_sim_result a[KM_SIM_MAX_POLICIES], b[KM_SIM_MAX_POLICIES], one[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, a, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(km_sim_run(&cfg, b, NULL, why, sizeof why), KM_OK, "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SINGLE, 1);
    cr_assert_eq(km_sim_run(&cfg, one, NULL, why, sizeof why), KM_OK, "%s", why);
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        cr_assert_eq(a[i].mode, KM_SIM_MODE_SHARED);
        cr_assert_eq(a[i].instances, 2);
        cr_assert_eq(a[i].routed, a[i].requests);
        cr_assert_eq(a[i].route_errors, 0);
        /* Every change reached the other instance before the next decision: each decision's
         * view held the other's contribution, none stale, no wait ran out, and many candidates
         * carried more requests than the deciding instance sent them itself. */
        cr_assert_eq(a[i].propagation_timeouts, 0);
        cr_assert_eq(a[i].cluster_scope_decisions, a[i].routed, "%s: %llu of %llu decisions in "
                     "the cluster's view", a[i].policy,
                     (unsigned long long)a[i].cluster_scope_decisions,
                     (unsigned long long)a[i].routed);
        cr_assert_eq(a[i].this_instance_decisions, 0);
        cr_assert_eq(a[i].stale_view_decisions, 0);
        cr_assert_eq(a[i].cluster_lost_messages, 0);
        cr_assert_gt(a[i].remote_load_seen, a[i].routed / 4, "%s: only %llu decisions saw the "
                     "other instance's load", a[i].policy,
                     (unsigned long long)a[i].remote_load_seen);
        /* Propagation is explicit in virtual time: the run is the same per seed. */
        assert_same(&a[i], &b[i]);
        /* kv and least_load read only the load figures the instances share (in flight, pending
         * prefill, decode blocks) and the index every instance has whole: with the whole view
         * they decide exactly as one instance does. */
        assert_same_decisions(&a[i], &one[i]);
    }
}

/* Three instances, the last killed at 10 s: its contribution stays in the survivors' views until
 * their expiry (1 s), then no decision counts it; the router's reports of its requests are lost;
 * every request is still routed and served. */
Test(sim_instances, a_killed_instance_leaves_the_views_after_expiry, .timeout = 180)
{
    skip_without_nats();
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 3);
    cfg.n_policies = 1;
    cfg.policies[0] = "least_load";
    cfg.kill_instance_at_s = 10.0;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(r[0].routed, r[0].requests);
    cr_assert_eq(r[0].route_errors, 0);
    cr_assert_eq(r[0].propagation_timeouts, 0);
    cr_assert_gt(r[0].reports_lost_to_kill, 0, "the killed instance's requests were still running");
    cr_assert_geq(r[0].cluster_expired, 2, "each survivor expired the killed instance");
    cr_assert_gt(r[0].decisions_after_faults, r[0].requests / 4);
    cr_assert_eq(r[0].counting_killed_after_faults, 0, "%llu decisions after the expiry still "
                 "counted the killed instance", (unsigned long long)r[0].counting_killed_after_faults);
    cr_assert_eq(r[0].cluster_scope_after_faults, r[0].decisions_after_faults,
                 "the survivors still share their work");
    cr_assert_eq(r[0].cluster_scope_decisions, r[0].routed);
}

/* NATS killed at 10 s and started again at 20 s: during the outage the decisions say
 * this_instance (the remote contributions expired); once it is back every decision is in the
 * cluster's view again. */
Test(sim_instances, after_a_nats_restart_decisions_return_to_the_cluster_view, .timeout = 180)
{
    skip_without_nats();
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.n_policies = 1;
    cfg.policies[0] = "least_load";
    cfg.nats_stop_at_s = 10.0;
    cfg.nats_stop_for_s = 10.0;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(r[0].routed, r[0].requests);
    cr_assert_eq(r[0].route_errors, 0);
    cr_assert_eq(r[0].propagation_timeouts, 0);
    /* About 20 arrivals in the 10 s of outage (2 per second). */
    cr_assert_gt(r[0].this_instance_decisions, 5, "%llu decisions on the instance's own view",
                 (unsigned long long)r[0].this_instance_decisions);
    cr_assert_eq(r[0].this_instance_decisions + r[0].cluster_scope_decisions, r[0].routed);
    cr_assert_geq(r[0].cluster_reconnects, 2, "both instances reconnected");
    cr_assert_geq(r[0].cluster_expired, 2);
    cr_assert_gt(r[0].decisions_after_faults, r[0].requests / 4);
    cr_assert_eq(r[0].cluster_scope_after_faults, r[0].decisions_after_faults);
}

/* An outage lasting past the end of a policy's run: the next policy's instances still find NATS
 * (the run started it again on its way out) and share their work until their own outage. */
Test(sim_instances, an_outage_past_the_end_leaves_nats_running_for_the_next_policy, .timeout = 180)
{
    skip_without_nats();
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.nats_stop_at_s = 40.0;
    cfg.nats_stop_for_s = 1000.0;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        cr_assert_eq(r[i].routed, r[i].requests);
        cr_assert_gt(r[i].this_instance_decisions, 0, "%s: the outage began", r[i].policy);
        cr_assert_gt(r[i].cluster_scope_decisions, r[i].routed / 2, "%s: %llu decisions in the "
                     "cluster's view before it", r[i].policy,
                     (unsigned long long)r[i].cluster_scope_decisions);
        cr_assert_eq(r[i].decisions_after_faults, 0, "NATS never came back within the run");
    }
}

/* A lossy link (one change in 10 not sent): every loss shows as a gap at the receiver, and the
 * decisions taken while a contribution was stale say so; the requests are all served. */
Test(sim_instances, a_lossy_link_is_detected_and_stale_views_are_labelled, .timeout = 180)
{
    skip_without_nats();
    km_sim_config cfg;
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.n_policies = 1;
    cfg.policies[0] = "least_load";
    cfg.cluster_loss = 0.1;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(r[0].routed, r[0].requests);
    cr_assert_eq(r[0].propagation_timeouts, 0);
    cr_assert_gt(r[0].cluster_publish_failures, 10, "one change in 10 dropped");
    /* Each instance's last drop may not be followed by a message before the end. */
    cr_assert_geq(r[0].cluster_lost_messages + 2, r[0].cluster_publish_failures,
                  "%llu gaps for %llu drops", (unsigned long long)r[0].cluster_lost_messages,
                  (unsigned long long)r[0].cluster_publish_failures);
    cr_assert_leq(r[0].cluster_lost_messages, r[0].cluster_publish_failures);
    cr_assert_gt(r[0].stale_view_decisions, 0);
}

Test(sim_instances, bad_settings, .timeout = 20)
{
    km_sim_config cfg;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    moderate_config(&cfg, KM_SIM_MODE_SINGLE, 2);
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "instances"), "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_ISOLATED, KM_SIM_MAX_INSTANCES + 1);
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    moderate_config(&cfg, KM_SIM_MODE_ISOLATED, 0);
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    moderate_config(&cfg, KM_SIM_MODE_ISOLATED, 2);
    cfg.zmq = true;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "--zmq"), "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.restart_kvmatch_at_s = 1;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "--restart-kvmatch"), "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.cluster_loss = 1.5;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "lossy"), "%s", why);
    /* Above 2/3, round(1/P) is 1: every change would go unsent and no loss would show. */
    const double past[] = {0.7, 1.0, 1e-10};
    for (size_t i = 0; i < sizeof past / sizeof past[0]; i++) {
        moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
        cfg.cluster_loss = past[i];
        cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT,
                     "loss %g", past[i]);
        cr_assert(strstr(why, "lossy") && strstr(why, "2/3"), "%s", why);
    }
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.cluster_loss = 2.0 / 3.0;
    cr_assert_eq(km_sim_config_check(&cfg, why, sizeof why), KM_OK, "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 2);
    cfg.nats_stop_at_s = 1;
    cfg.nats_stop_for_s = 0;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "outage"), "%s", why);
    moderate_config(&cfg, KM_SIM_MODE_SHARED, 1);
    cfg.kill_instance_at_s = 1;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "at least 2 instances"), "%s", why);
}

/* The --fault option: each malformed or out-of-range fault, and a fault without several
 * instances, refused with exit 2 and a sentence naming the accepted forms. */
Test(sim_instances, bad_fault_options_are_refused_by_the_cli, .timeout = 60)
{
    const char *bin = getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    if (access(bin, X_OK) != 0)
        cr_assert_fail("%s is not executable (set KM_BIN)", bin);
    static const struct {
        const char *args, *words;
    } bad[] = {
        {"--instances 2 --fault lossy=2", "lossy=P (P in (0, 2/3]"},
        {"--instances 2 --fault lossy=0.7", "lossy=P (P in (0, 2/3]"},
        {"--instances 2 --fault lossy=1", "lossy=P (P in (0, 2/3]"},
        {"--instances 2 --fault lossy=0", "lossy=P"},
        {"--instances 2 --fault nats-restart@3+0", "nats-restart@T[+D]"},
        {"--instances 2 --fault kill-instance@-1", "kill-instance@T"},
        {"--instances 2 --fault crash@3", "kill-instance@T"},
        {"--instances 2 --fault kill-instance@3x", "kill-instance@T"},
        {"--fault kill-instance@3", "need --instances N > 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[512], out[4096];
        snprintf(cmd, sizeof cmd, "timeout -s KILL 20 %s sim --requests 10 %s </dev/null", bin,
                 bad[i].args);
        int rc = km_test_run_capture(cmd, out, sizeof out);
        cr_assert_eq(rc, 2, "%s: exit %d: %s", bad[i].args, rc, out);
        cr_assert(strstr(out, bad[i].words), "%s: %s", bad[i].args, out);
    }
}
