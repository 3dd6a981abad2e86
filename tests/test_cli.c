/* SPDX-License-Identifier: Apache-2.0 */
/* The `kvmatch` command line as a whole: usage errors exit 2 with the value given on stderr
 * (`version` with an argument, `follow`'s endpoints), and every long option of a command is in
 * its man page. The binary is $KM_BIN, else build/kvmatch; every run is bounded by a timeout and
 * nothing leaves loopback. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv_test_publisher.h"
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

/* Every command kvmatch(1) lists takes --help and -h: the usage on stdout, exit 0. */
Test(cli, every_command_takes_help, .timeout = 60)
{
    const char *commands[] = {"serve",        "route",        "follow",       "hash",
                              "sim",          "analyze",      "version",      "bench",
                              "bench index",  "bench events", "bench ipc",    "bench replay",
                              "bench growth", "bench cluster"};
    const char *flags[] = {"--help", "-h"};
    char out[16384], cmd[1024];
    for (size_t c = 0; c < sizeof commands / sizeof commands[0]; c++)
        for (size_t f = 0; f < 2; f++) {
            /* standard output alone */
            snprintf(cmd, sizeof cmd, "{ timeout -s KILL 20 %s %s %s </dev/null 2>/dev/null; }",
                     kvmatch_bin(), commands[c], flags[f]);
            int rc = km_test_run_capture(cmd, out, sizeof out);
            cr_expect_eq(rc, 0, "kvmatch %s %s: exit %d: %s", commands[c], flags[f], rc, out);
            cr_expect(strstr(out, "usage: kvmatch "), "kvmatch %s %s prints no usage: %s",
                      commands[c], flags[f], out);
        }
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
        {"--endpoint 0=tcp://127.0.0.1:1 --max-events-per-batch 0", "--max-events-per-batch"},
        {"--endpoint 0=tcp://127.0.0.1:1 --snapshot-interval-s 5",
         "--snapshot-interval-s needs --snapshot"},
        {"--endpoint 0=tcp://127.0.0.1:1 --max-payload-bytes 4294967296", "--max-payload-bytes"},
        {"--endpoint 0=tcp://127.0.0.1:1 --max-string-bytes x", "--max-string-bytes"},
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

/* `kvmatch follow` on the publisher (worker 0, its replay endpoint too), block size 1, status
 * every second, with `extra` options (NULL-terminated), stdout and stderr on a pipe. */
static pid_t follow_spawn(km_test_publisher *pub, const char *const *extra, FILE **out)
{
    static char endpoint[600];
    snprintf(endpoint, sizeof endpoint, "0=%s,%s", km_test_publisher_endpoint(pub),
             km_test_publisher_replay_endpoint(pub));
    const char *argv[32] = {kvmatch_bin(), "follow", "--endpoint", endpoint, "--status-s", "1",
                            "--block-size", "1"};
    size_t n = 8;
    for (; extra && *extra && n + 1 < sizeof argv / sizeof argv[0]; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    int parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        km_test_die_with_parent(parent);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    *out = fdopen(fds[0], "r");
    cr_assert(*out);
    return pid;
}

/* Read lines until one holds every string of `what` (NULL-terminated); that line in `line`. */
static bool follow_line(FILE *f, const char *const *what, char *line, size_t size)
{
    while (fgets(line, (int)size, f)) {
        bool all = true;
        for (const char *const *w = what; *w && all; w++)
            all = strstr(line, *w) != NULL;
        if (all)
            return true;
    }
    return false;
}

static int follow_end(pid_t pid, FILE *f)
{
    kill(pid, SIGTERM);
    char line[4096];
    while (fgets(line, sizeof line, f))
        ;
    fclose(f);
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* One engine step of 70,000 one-token blocks between two small messages: `follow` names the
 * decoder's reason (the limit, max_events_per_batch) in its status line and its log, and with
 * --max-events-per-batch raised it applies the step. */
Test(cli, follow_names_why_a_message_did_not_decode_and_takes_raised_limits, .timeout = 90)
{
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.replay = true;
    for (int run = 0; run < 2; run++) {
        km_test_publisher *pub = NULL;
        cr_assert_eq(km_test_publisher_start(&pc, &pub), KM_OK);
        const char *const raised[] = {"--max-events-per-batch", "70000", NULL};
        FILE *out;
        pid_t pid = follow_spawn(pub, run ? raised : NULL, &out);
        cr_assert(km_test_publisher_wait_subscribers(pub, 1, 10000), "follow never subscribed");
        km_test_batch b;
        km_test_batch_init(&b, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
        uint32_t token = 7;
        uint64_t hash = 1;
        km_test_batch_stored(&b, &hash, 1, false, 0, &token, 1, NULL, NULL);
        km_test_publisher_publish_batch(pub, &b);
        km_test_batch_reset(&b);
        for (uint32_t i = 0; i < 70000; i++) {
            uint64_t h = 100 + i;
            uint32_t t = i % 50000;
            km_test_batch_stored(&b, &h, 1, true, i ? h - 1 : 1, &t, 1, NULL, NULL);
        }
        km_test_publisher_publish_batch(pub, &b);
        km_test_batch_reset(&b);
        hash = 200000;
        km_test_batch_stored(&b, &hash, 1, true, 1, &token, 1, NULL, NULL);
        km_test_publisher_publish_batch(pub, &b);
        km_test_batch_free(&b);
        char line[4096];
        if (!run) {
            const char *const refused[] = {"next seq 3", "refused: undecodable ",
                                           "(latest: a message that did not decode: "
                                           "KM_ERR_TOO_LARGE: batch has 70000 events, limit "
                                           "max_events_per_batch = 65536)",
                                           NULL};
            cr_assert(follow_line(out, refused, line, sizeof line),
                      "no status line names the limit");
            /* Counted as each copy arrives: once live, and once more when follow's first replay
             * was answered after the message was published. */
            unsigned copies = 0;
            cr_assert_eq(sscanf(strstr(line, "refused: undecodable ") +
                                    strlen("refused: undecodable "), "%u", &copies), 1, "%s", line);
            cr_assert(copies == 1 || copies == 2, "%s", line);
        } else {
            const char *const applied[] = {"blocks 70002", NULL};
            cr_assert(follow_line(out, applied, line, sizeof line), "the step was not applied");
        }
        cr_assert_eq(follow_end(pid, out), 0);
        km_test_publisher_stop(pub);
    }
}
