/* SPDX-License-Identifier: Apache-2.0 */
/* The `kvmatch` command line as a whole: usage errors exit 2 with the value given on stderr
 * (`version` with an argument, `follow`'s endpoints), and every long option of a command is in
 * its man page. The binary is $KM_BIN, else build/kvmatch; every run is bounded by a timeout and
 * nothing leaves loopback. */
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

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s not readable from the test's directory", path);
    static const size_t cap = 1 << 20;
    char *text = malloc(cap);
    cr_assert_not_null(text);
    size_t n = fread(text, 1, cap - 1, f);
    text[n] = '\0';
    fclose(f);
    return text;
}

/* Every long option a command's source accepts ({"name", ..._argument, ...} in its getopt table)
 * is in its man page, written as troff writes it (\-\-name, each '-' as \-). */
Test(cli, every_long_option_is_in_its_man_page, .timeout = 30)
{
    const char *commands[] = {"serve", "route", "follow", "hash", "sim", "analyze"};
    for (size_t c = 0; c < sizeof commands / sizeof commands[0]; c++) {
        char src_path[128], man_path[128];
        snprintf(src_path, sizeof src_path, "src/cli/%s_cmd.c", commands[c]);
        snprintf(man_path, sizeof man_path, "man/kvmatch-%s.1", commands[c]);
        char *src = read_text(src_path), *man = read_text(man_path);
        int options = 0;
        for (const char *p = strstr(src, "{\""); p; p = strstr(p + 2, "{\"")) {
            const char *name = p + 2, *end = strchr(name, '"');
            if (!end || end - name >= 64 || end - name == 0)
                continue;
            const char *kind = end + 1 + strspn(end + 1, ", ");
            if (strncmp(kind, "no_argument", 11) && strncmp(kind, "required_argument", 17) &&
                strncmp(kind, "optional_argument", 17))
                continue;
            if ((size_t)(end - name) == 4 && !strncmp(name, "help", 4))
                continue;
            char troff[200] = "\\-\\-";
            size_t at = strlen(troff);
            for (const char *q = name; q < end && at + 3 < sizeof troff; q++) {
                if (*q == '-')
                    troff[at++] = '\\';
                troff[at++] = *q;
            }
            troff[at] = '\0';
            cr_expect(strstr(man, troff), "%s accepts --%.*s; %s does not name it (%s)",
                      src_path, (int)(end - name), name, man_path, troff);
            options++;
        }
        cr_expect_gt(options, 0, "no option table found in %s", src_path);
        free(src);
        free(man);
    }
}
