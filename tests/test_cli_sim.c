/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch sim`'s command line: a fault option's value with anything after its numbers, an unknown
 * policy name and settings that exclude each other exit 2 (usage) with the value given on stderr,
 * before any run; output that cannot be written exits 1. The binary is $KM_BIN, else
 * build/kvmatch; every run is bounded by a timeout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "test_util.h"

static const char *kvmatch_bin(void)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (build it with make; or set KM_BIN)",
              bin);
    return bin;
}

/* `kvmatch sim --requests 3 --workers 2 ARGS`, stdout and stderr in out; the exit status. */
static int run_sim(const char *args, char *out, size_t out_size)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout -s KILL 60 %s sim --requests 3 --workers 2 %s </dev/null",
             kvmatch_bin(), args);
    return km_test_run_capture(cmd, out, out_size);
}

Test(cli_sim, bad_values_exit_2_naming_the_value, .timeout = 120)
{
    static const struct {
        const char *args, *named;
    } bad[] = {
        {"--cut 0:1:2xyz", "\"0:1:2xyz\""},
        {"--cut 0:1", "\"0:1\""},
        {"--cut -1:1:2", "\"-1:1:2\""},
        {"--restart-engine 0@1junk", "\"0@1junk\""},
        {"--restart-engine 0", "\"0\""},
        {"--drop-events 0.5junk", "\"0.5junk\""},
        {"--drop-events 0.5@junk", "\"0.5@junk\""},
        {"--drop-events 0", "\"0\""},
        {"--override 0.5junk", "\"0.5junk\""},
        {"--second-ingress 0.3%", "\"0.3%\""},
        {"--restart-kvmatch 5junk", "\"5junk\""},
        {"--restart-kvmatch 5:later", "\"5:later\""},
        {"--policy bogus", "\"bogus\""},
        {"--policy kv,bogus", "\"bogus\""},
        {"--policy ,", "\",\""},
        {"--connect unix:/tmp/kvmatch-test-no-such.sock", "--zmq"},
        /* a fault that would inject nothing: no other worker to override to */
        {"--override 0.5 --workers 1", "--override needs at least 2 workers"},
    };
    static char out[16384];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run_sim(bad[i].args, out, sizeof out);
        cr_expect_eq(rc, 2, "sim %s: exit %d: %s", bad[i].args, rc, out);
        cr_expect(strstr(out, bad[i].named), "sim %s: the message does not name %s: %s",
                  bad[i].args, bad[i].named, out);
    }
    /* the same options with good values run */
    int rc = run_sim("--policy round_robin --cut 0:1:2 --restart-engine 1@0.5 --drop-events "
                     "0.5@1 --override 0.5 --second-ingress 0.25 --restart-kvmatch 1:nosnapshot",
                     out, sizeof out);
    cr_assert_eq(rc, 0, "%s", out);
}

/* Output that cannot be written is a failure, as in analyze and hash. */
Test(cli_sim, a_write_error_exits_1, .timeout = 120)
{
    static char out[16384];
    char cmd[512];
    const char *forms[] = {"", "--json"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "{ timeout -s KILL 60 %s sim --requests 3 --workers 2 --policy "
                 "round_robin %s </dev/null 2>&1 >/dev/full; }", kvmatch_bin(), forms[i]);
        int rc = km_test_run_capture(cmd, out, sizeof out);
        cr_assert_eq(rc, 1, "sim %s > /dev/full: exit %d: %s", forms[i], rc, out);
        cr_assert(strstr(out, "write error"), "%s", out);
    }
}

/* A run where no request finishes (engines too small for any prompt: all rejected) has no
 * makespan and no TTFT sample: makespan 0, not the first arrival's time negated, and the TTFT
 * figures "-" in the table and null in the JSON (every_request's too), not 0.0 ms. */
Test(cli_sim, a_run_where_nothing_finishes_has_no_ttft, .timeout = 120)
{
    static char out[65536];
    char cmd[512];
    snprintf(cmd, sizeof cmd, "timeout -s KILL 60 %s sim --requests 3 --workers 2 --policy kv "
             "--capacity 10 --json </dev/null 2>/dev/null", kvmatch_bin());
    cr_assert_eq(km_test_run_capture(cmd, out, sizeof out), 0, "%s", out);
    json_error_t err;
    json_t *root = json_loads(out, 0, &err);
    cr_assert_not_null(root, "%s: %s", err.text, out);
    json_t *p = json_array_get(json_object_get(root, "policies"), 0);
    cr_assert_not_null(p, "%s", out);
    cr_assert_eq(json_integer_value(json_object_get(p, "rejected")), 3, "%s", out);
    cr_assert_float_eq(json_number_value(json_object_get(p, "makespan_s")), 0.0, 1e-12, "%s", out);
    static const char *const none[] = {"ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms"};
    json_t *every = json_object_get(p, "every_request");
    cr_assert(json_is_object(every), "%s", out);
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++) {
        cr_assert(json_is_null(json_object_get(p, none[i])), "%s: %s", none[i], out);
        cr_assert(json_is_null(json_object_get(every, none[i])), "every_request %s: %s", none[i],
                  out);
    }
    json_decref(root);

    snprintf(cmd, sizeof cmd, "timeout -s KILL 60 %s sim --requests 3 --workers 2 --policy kv "
             "--capacity 10 </dev/null 2>/dev/null", kvmatch_bin());
    cr_assert_eq(km_test_run_capture(cmd, out, sizeof out), 0, "%s", out);
    static const char *const rows[] = {"ttft_p50_ms ", "ttft_p99_ms ", "makespan_s (virtual) "};
    static const char *const want[] = {"-", "-", "0.0"};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const char *line = strstr(out, rows[i]);
        cr_assert_not_null(line, "no row %s: %s", rows[i], out);
        char value[32] = "";
        cr_assert_eq(sscanf(line + strlen(rows[i]), "%31s", value), 1, "%s", line);
        cr_assert_str_eq(value, want[i], "row %s: %s", rows[i], out);
    }
}

/* Every element of a --sweep (and the one of a --load) is a number: an empty element (",,", a
 * leading or trailing comma) or one with a space is refused as a usage error naming the value,
 * not skipped. */
Test(cli_sim, a_sweep_with_an_empty_or_spaced_element_exits_2, .timeout = 120)
{
    static const char *const bad[] = {
        "--sweep 0.5,,0.8", "--sweep ,0.5", "--sweep 0.5,", "--sweep ,", "--sweep \"0.5, 0.8\"",
        "--load \" 0.5\"",
    };
    static char out[16384];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run_sim(bad[i], out, sizeof out);
        cr_expect_eq(rc, 2, "sim %s: exit %d: %s", bad[i], rc, out);
        cr_expect(strstr(out, "--sweep wants") || strstr(out, "--load wants"),
                  "sim %s: the message does not say what --sweep or --load wants: %s", bad[i],
                  out);
    }
}

/* A --fault time is a finite number, the whole of its part, as every other fault's: an infinite
 * time (a fault that would never come, or an outage without end) or one after a space is refused
 * with exit 2 before any run, as the other malformed faults are; an exponent's sign is no D. */
Test(cli_sim, a_fault_at_an_infinite_or_spaced_time_exits_2, .timeout = 120)
{
    static const char *const bad[] = {
        "kill-instance@inf", "kill-instance@1e999", "\"kill-instance@ 1\"", "nats-restart@inf",
        "nats-restart@1+inf", "nats-restart@1+1e999", "nats-restart@1e308+1e308",
        "\"nats-restart@1+ 2\"", "lossy=inf", "\"lossy= 0.5\"",
    };
    static char out[16384];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[256];
        snprintf(args, sizeof args, "--instances 2 --fault %s", bad[i]);
        int rc = run_sim(args, out, sizeof out);
        cr_expect_eq(rc, 2, "sim %s: exit %d: %s", args, rc, out);
        cr_expect(strstr(out, "kill-instance@T, nats-restart@T[+D]"),
                  "sim %s: the message does not give the accepted forms: %s", args, out);
    }
    /* an exponent with a sign is part of T; what follows the next '+' is D */
    int rc = run_sim("--instances 2 --fault nats-restart@1e+3+2junk", out, sizeof out);
    cr_expect_eq(rc, 2, "exit %d: %s", rc, out);
    rc = run_sim("--fault nats-restart@1e+3+2", out, sizeof out);
    cr_expect_eq(rc, 2, "exit %d: %s", rc, out);
    cr_expect(strstr(out, "need --instances N > 1"), "%s", out);
}

/* The lines of a file, or -1 when it cannot be read. */
static long count_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long n = 0;
    for (int c; (c = getc(f)) != EOF;)
        n += c == '\n';
    fclose(f);
    return n;
}

/* `--records DIR` keeps each policy's records of this run: a second run into the same directory
 * replaces the first run's file (the server appends to an existing one), so `kvmatch analyze` of
 * it counts one run's decisions, not both runs' joined as one. */
Test(cli_sim, records_of_a_second_run_replace_the_first_runs, .timeout = 120)
{
    char dir[] = "/tmp/km-test-sim-records-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char args[256], path[512];
    snprintf(args, sizeof args, "--policy round_robin --records %s", dir);
    snprintf(path, sizeof path, "%s/records-round_robin.jsonl", dir);
    static char out[16384];
    cr_assert_eq(run_sim(args, out, sizeof out), 0, "%s", out);
    long first = count_lines(path);
    /* 3 requests: a decision and an outcome each */
    cr_expect_eq(first, 6, "%s: %ld lines after one run", path, first);
    cr_assert_eq(run_sim(args, out, sizeof out), 0, "%s", out);
    long second = count_lines(path);
    cr_expect_eq(second, first, "%s: %ld lines after a second run, %ld after the first", path,
                 second, first);
    unlink(path);
    rmdir(dir);
}

/* --records DIR keeps the records of the server the simulator starts; with --connect there is
 * none (the running server writes its own records), so the pair is refused as a usage error
 * naming both options, before any run, not accepted with DIR left empty. */
Test(cli_sim, records_with_connect_exits_2, .timeout = 120)
{
    static char out[16384];
    int rc = run_sim("--zmq --connect unix:/tmp/kvmatch-test-no-such.sock --records "
                     "/tmp/kvmatch-test-no-such-records", out, sizeof out);
    cr_expect_eq(rc, 2, "exit %d: %s", rc, out);
    cr_expect(strstr(out, "--records") && strstr(out, "--connect"), "%s", out);
    cr_expect_neq(access("/tmp/kvmatch-test-no-such-records", F_OK), 0,
                  "the records directory was created for a run that cannot write there");
    rmdir("/tmp/kvmatch-test-no-such-records");
}

/* --workload and --rate set the built-in generator, which a --trace replaces: with --trace they
 * are refused as a usage error naming the option, before the trace is read, not ignored. */
Test(cli_sim, generator_options_with_a_trace_exit_2, .timeout = 120)
{
    static const struct {
        const char *args, *named;
    } bad[] = {
        {"--workload agent --trace /tmp/kvmatch-test-no-such-trace.jsonl", "--workload"},
        {"--trace /tmp/kvmatch-test-no-such-trace.jsonl --rate 5", "--rate"},
    };
    static char out[16384];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run_sim(bad[i].args, out, sizeof out);
        cr_expect_eq(rc, 2, "sim %s: exit %d: %s", bad[i].args, rc, out);
        cr_expect(strstr(out, bad[i].named) && strstr(out, "--trace"),
                  "sim %s: the message does not name %s and --trace: %s", bad[i].args,
                  bad[i].named, out);
    }
}

/* A policy named twice in --policy would run twice under one name (two columns, two JSON
 * entries, one records file for both runs): a usage error naming it, before any run. */
Test(cli_sim, a_policy_named_twice_exits_2, .timeout = 120)
{
    static char out[16384];
    int rc = run_sim("--policy kv,round_robin,kv", out, sizeof out);
    cr_expect_eq(rc, 2, "exit %d: %s", rc, out);
    cr_expect(strstr(out, "\"kv\" is named twice"), "%s", out);
}
