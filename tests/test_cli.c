/* SPDX-License-Identifier: Apache-2.0 */
/* The `kvmatch` command line as a whole: usage errors exit 2 with the value given on stderr
 * (`version` with an argument, `follow`'s endpoints). The binary is $KM_BIN, else
 * build/kvmatch; every run is bounded by a timeout and nothing leaves loopback. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

static const char *kvmatch_bin(void)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (build it with make; or set KM_BIN)",
              bin);
    return bin;
}

/* `kvmatch ARGS`, stdout and stderr in out; the exit status. */
static int run_kvmatch(const char *args, char *out, size_t out_size)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout -s KILL 20 %s %s </dev/null", kvmatch_bin(), args);
    return km_test_run_capture(cmd, out, out_size);
}

Test(cli, version_takes_no_argument, .timeout = 30)
{
    char out[4096];
    int rc = run_kvmatch("version extra", out, sizeof out);
    cr_assert_eq(rc, 2, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "\"extra\""), "%s", out);
    rc = run_kvmatch("version", out, sizeof out);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "kvmatch "), "%s", out);
}

/* An endpoint id out of range, not a number or given twice, and a PUB address that is empty or
 * one ZMQ cannot connect to, are the command line's fault: exit 2 naming it, before following. */
Test(cli, follow_refuses_bad_endpoints_as_usage_errors, .timeout = 60)
{
    static const struct {
        const char *args, *named;
    } bad[] = {
        {"--endpoint 99999999=tcp://127.0.0.1:1", "\"99999999=tcp://127.0.0.1:1\""},
        {"--endpoint 1024=tcp://127.0.0.1:1", "\"1024=tcp://127.0.0.1:1\""},
        {"--endpoint x=tcp://127.0.0.1:1", "\"x=tcp://127.0.0.1:1\""},
        {"--endpoint -1=tcp://127.0.0.1:1", "\"-1=tcp://127.0.0.1:1\""},
        {"--endpoint 0=", "\"0=\""},
        {"--endpoint 0=tcp://127.0.0.1:1,", "\"0=tcp://127.0.0.1:1,\""},
        {"--endpoint 0=tcp://127.0.0.1:1 --endpoint 0=tcp://127.0.0.1:2", "worker 0"},
        {"--endpoint 0=garbage", "garbage"},
    };
    char out[4096];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[512];
        snprintf(args, sizeof args, "follow --status-s 1 %s", bad[i].args);
        int rc = run_kvmatch(args, out, sizeof out);
        cr_expect_eq(rc, 2, "follow %s: exit %d: %s", bad[i].args, rc, out);
        cr_expect(strstr(out, bad[i].named), "follow %s: the message does not name %s: %s",
                  bad[i].args, bad[i].named, out);
    }
}
