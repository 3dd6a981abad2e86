/* `kvmatch sim` with several kvmatch instances (src/sim/sim.h, docs/SIM.md "Several instances"):
 * isolated instances never see each other's load and replay the same per seed; instances sharing
 * their active work over a real nats-server (started by the simulator on a free loopback port) see
 * the others' requests in their decisions, every change applied before the next decision (so the
 * run is the same per seed); the settings several instances exclude are refused. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kvmatch/error.h"
#include "sim/broker.h"
#include "sim/sim.h"

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
}
