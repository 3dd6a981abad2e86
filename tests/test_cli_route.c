/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch route`: a bad option value or input word exits 2 with a message naming it, before any
 * connection (so the answer does not depend on a server being up), the numbers it sends are the
 * decimal ones it was given, and output it cannot write exits 1. The binary is $KM_BIN, else
 * build/kvmatch; a small fake server in a thread of the test answers its ROUTE with a DECISION
 * computed from the request. Every run is bounded by a timeout. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "kvmatch/client.h"
#include "test_util.h"

#define ROUTE_TIMEOUT_S 20

typedef struct route_run {
    int status; /* exit status; 128 + signal when killed */
    char out[4096], err[4096];
} route_run;

static void read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
}

/* Run `kvmatch route ARGS...` (NULL-terminated) with `input` on stdin. */
static void run_route(const char *const *args, const char *input, route_run *res)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (build it with make; or set KM_BIN)",
              bin);
    char dir[] = "/tmp/kvmatch-test-route-XXXXXX";
    cr_assert(mkdtemp(dir));
    char in_path[64], out_path[64], err_path[64];
    snprintf(in_path, sizeof in_path, "%s/in", dir);
    snprintf(out_path, sizeof out_path, "%s/out", dir);
    snprintf(err_path, sizeof err_path, "%s/err", dir);
    FILE *f = fopen(in_path, "w");
    cr_assert(f);
    fputs(input, f);
    fclose(f);
    const char *argv[32] = {bin, "route"};
    int argc = 2;
    for (int i = 0; args[i]; i++) {
        cr_assert(argc < 31);
        argv[argc++] = args[i];
    }
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        int in = open(in_path, O_RDONLY), out = open(out_path, O_WRONLY | O_CREAT, 0600),
            err = open(err_path, O_WRONLY | O_CREAT, 0600);
        if (in < 0 || out < 0 || err < 0)
            _exit(126);
        dup2(in, 0), dup2(out, 1), dup2(err, 2);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    double deadline = km_test_now() + ROUTE_TIMEOUT_S;
    pid_t done;
    while ((done = waitpid(pid, &st, WNOHANG)) == 0 && km_test_now() < deadline)
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    if (done == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
    res->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    read_file(out_path, res->out, sizeof res->out);
    read_file(err_path, res->err, sizeof res->err);
    unlink(in_path), unlink(out_path), unlink(err_path), rmdir(dir);
    cr_assert(done != 0, "kvmatch route did not finish within %d s", ROUTE_TIMEOUT_S);
    cr_assert(res->status != 127 && res->status != 126, "could not execute %s", bin);
}

/* ---- a fake server: one connection, WELCOME, then a DECISION per ROUTE whose decision_id is the
 * sum of the route's tokens or hashes ------------------------------------------------------------ */

typedef struct fake_server {
    int listen_fd;
    char path[108];
    char address[120];
    pthread_t thread;
} fake_server;

static void send_all(int fd, const km_frame_buffer *out)
{
    for (size_t off = 0; off < out->size;) {
        ssize_t n = send(fd, out->data + off, out->size - off, MSG_NOSIGNAL);
        if (n <= 0)
            return;
        off += (size_t)n;
    }
}

static void fake_answer(int fd, const km_message *m)
{
    km_message reply = {.has_id = true, .id = m->id};
    km_candidate_score row = {.worker = 3, .depth = 2, .device_blocks = 2, .cost = 1.5,
                              .state = "APPROX", .eligible = true};
    km_route_decision d = {.request_id = "", .decision_id = 0, .source = KM_PREDICTION_APPROX,
                           .pool = "default", .chosen_worker = 3, .chosen_depth = 2,
                           .chosen_state = "APPROX", .has_owner = true, .owner_worker = 3,
                           .owner_depth = 2, .owner_state = "APPROX", .n_blocks = 5,
                           .block_size = 16, .policy = "kv", .reason = "min_cost",
                           .load_kind = "active_decode_blocks", .load_scope = "this_instance",
                           .load_value = 4.0, .candidates = &row, .n_candidates = 1};
    if (m->type == KM_MESSAGE_HELLO) {
        reply.type = KM_MESSAGE_WELCOME;
        reply.welcome.protocol_version = KM_PROTOCOL_VERSION;
        reply.welcome.kvmatch_version = "0.1.0-fake";
        km_protocol_limits_init(&reply.welcome.limits);
    } else if (m->type == KM_MESSAGE_ROUTE) {
        const km_route_request *q = &m->route.routes[0];
        for (uint32_t i = 0; i < q->n_tokens; i++)
            d.decision_id += q->tokens[i];
        for (uint32_t i = 0; i < q->n_hashes; i++)
            d.decision_id += q->hashes[i];
        d.request_id = q->request_id;
        if (q->warm_ups) { /* a router that can warm up gets one */
            d.has_warm_up = true;
            d.warm_up_worker = 1;
            d.warm_up_blocks = 2;
            d.warm_up_tokens = 32;
            d.warm_up_decision_id = d.decision_id + 1;
            d.warm_up_attempt_id = ":warm_up";
        }
        reply.type = KM_MESSAGE_DECISION;
        reply.decision.decisions = &d;
        reply.decision.n_decisions = 1;
    } else {
        reply.type = KM_MESSAGE_ERROR;
        reply.error.code = KM_ERR_PROTOCOL;
        reply.error.message = "fake server: unsupported type";
    }
    km_frame_buffer out;
    km_frame_buffer_init(&out);
    km_protocol_encode(&reply, 0, &out, NULL, 0);
    send_all(fd, &out);
    km_frame_buffer_free(&out);
}

static void *fake_main(void *arg)
{
    fake_server *s = arg;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    km_frame_reader *reader;
    km_protocol_decoder *decoder;
    km_frame_reader_create(0, &reader);
    km_protocol_decoder_create(NULL, &decoder);
    uint8_t buf[4096];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof buf, 0)) > 0) {
        for (size_t off = 0; off < (size_t)n;) {
            size_t used, size;
            const uint8_t *payload;
            if (km_frame_reader_next(reader, buf + off, (size_t)n - off, &used, &payload, &size))
                goto done;
            off += used;
            km_message m;
            if (payload && km_protocol_decode(decoder, payload, size, &m) == KM_OK)
                fake_answer(fd, &m);
        }
    }
done:
    close(fd);
    km_frame_reader_destroy(reader);
    km_protocol_decoder_destroy(decoder);
    return NULL;
}

static void fake_start(fake_server *s)
{
    memset(s, 0, sizeof *s);
    snprintf(s->path, sizeof s->path, "/tmp/kvmatch-test-route-%d.sock", (int)getpid());
    snprintf(s->address, sizeof s->address, "unix:%s", s->path);
    unlink(s->path);
    s->listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", s->path);
    cr_assert_eq(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0, "bind %s", s->path);
    cr_assert_eq(listen(s->listen_fd, 4), 0);
    cr_assert_eq(pthread_create(&s->thread, NULL, fake_main, s), 0);
}

static void fake_stop(fake_server *s)
{
    shutdown(s->listen_fd, SHUT_RDWR);
    close(s->listen_fd);
    pthread_join(s->thread, NULL);
    unlink(s->path);
}

/* ---- tests ---------------------------------------------------------------------------------------- */

/* A socket nothing listens on: a run that got as far as connecting exits 1. */
#define NO_SERVER "unix:/tmp/kvmatch-test-route-no-such-socket"

static void expect_usage_error(const char *const *args, const char *input, const char *named)
{
    route_run r;
    run_route(args, input, &r);
    cr_assert_eq(r.status, 2, "%s %s: exit %d, stderr: %s", args[2], args[3] ? args[3] : "",
                 r.status, r.err);
    cr_assert(strstr(r.err, named), "stderr does not name %s: %s", named, r.err);
    cr_assert_str_eq(r.out, "");
}

Test(cli_route, bad_values_exit_2_before_connecting, .timeout = 60)
{
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--candidates", "1,x,3",
                                             NULL},
                       "", "--candidates");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--candidates", "1,-2",
                                             NULL},
                       "", "--candidates");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--candidates", "4294967296",
                                             NULL},
                       "", "--candidates");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--expected-output", "lots",
                                             NULL},
                       "", "--expected-output");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--expected-output", "-5",
                                             NULL},
                       "", "--expected-output");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--add-worker", "main:x",
                                             NULL},
                       "", "--add-worker");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--add-worker", "main:1x",
                                             NULL},
                       "", "--add-worker");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--remove-worker", ":1",
                                             NULL},
                       "", "--remove-worker");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--set-health", "main:1=maybe",
                                             NULL},
                       "", "--set-health");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--set-health", "main:1",
                                             NULL},
                       "", "--set-health");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--remove-pool", "",
                                             NULL},
                       "", "--remove-pool");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--remove-pool", "p",
                                             "--workers", NULL},
                       "", "one of");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--status", "--workers",
                                             NULL},
                       "", "one of");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, NULL}, "1 2 x 4",
                       "not a valid number: x");
    /* Options no action but a route uses are refused beside another action, not dropped; so is
     * --outcome without --finish. */
    static const char *const route_only[][2] = {
        {"--pool", "main"}, {"--model", "m"}, {"--request-id", "r"}, {"--attempt-id", "a"},
        {"--lora", "l"}, {"--salt", "s"}, {"--policy", "kv"}, {"--expected-output", "5"},
        {"--candidates", "1,2"}, {"--hashes", NULL},
    };
    static const char *const actions[][2] = {
        {"--status", NULL}, {"--workers", NULL}, {"--finish", "7"}, {"--remove-pool", "p"},
        {"--add-worker", "main:1"}, {"--remove-worker", "main:1"},
        {"--set-health", "main:1=healthy"},
    };
    for (size_t a = 0; a < sizeof actions / sizeof actions[0]; a++)
        for (size_t o = 0; o < sizeof route_only / sizeof route_only[0]; o++) {
            const char *args[8] = {"--connect", NO_SERVER, actions[a][0]};
            int n = 3;
            if (actions[a][1])
                args[n++] = actions[a][1];
            args[n++] = route_only[o][0];
            if (route_only[o][1])
                args[n++] = route_only[o][1];
            char named[128];
            snprintf(named, sizeof named, "%s is for a route; %s does not use it",
                     route_only[o][0], actions[a][0]);
            expect_usage_error(args, "", named);
        }
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--outcome", "error", NULL},
                       "1 2", "--outcome goes with --finish");
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--status", "--outcome",
                                             "error", NULL},
                       "", "--outcome goes with --finish");
    /* A word over 63 characters is refused whole: its first 63 characters and the rest are
     * not read as two numbers ("000...01" and "2"). */
    char long_word[80];
    snprintf(long_word, sizeof long_word, "1 %062d12 3", 0);
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, NULL}, long_word,
                       "a word of more than 63 characters");
    snprintf(long_word, sizeof long_word, "0x%062d12", 0);
    expect_usage_error((const char *const[]){"--connect", NO_SERVER, "--hashes", NULL}, long_word,
                       "a word of more than 63 characters");
    /* A valid run gets as far as connecting. */
    route_run r;
    run_route((const char *const[]){"--connect", NO_SERVER, "--candidates", "0,1", NULL}, "1 2",
              &r);
    cr_assert_eq(r.status, 1, "exit %d, stderr: %s", r.status, r.err);
    /* The client's sentence already starts with the code's name: it is said once. */
    cr_assert(strstr(r.err, "kvmatch route: KM_ERR_IO: connect to "), "%s", r.err);
}

/* Token ids are decimal, as `kvmatch hash` reads them: "010" is ten, not eight; chain hashes are
 * decimal or 0x hex. */
Test(cli_route, numbers_are_decimal, .timeout = 60)
{
    fake_server s;
    fake_start(&s);
    route_run r;
    run_route((const char *const[]){"--connect", s.address, NULL}, "010 7\n", &r);
    cr_assert_eq(r.status, 0, "exit %d, stderr: %s", r.status, r.err);
    cr_assert(strstr(r.out, "\"decision_id\":17"), "%s", r.out);
    fake_stop(&s);

    fake_start(&s);
    run_route((const char *const[]){"--connect", s.address, "--hashes", NULL}, "0x10 010\n", &r);
    cr_assert_eq(r.status, 0, "exit %d, stderr: %s", r.status, r.err);
    cr_assert(strstr(r.out, "\"decision_id\":26"), "%s", r.out);
    fake_stop(&s);
}

/* The decision is printed under the protocol's field names: every key of the output and of its
 * candidate rows is a field docs/PROTOCOL.md defines, and the worker chosen, the prediction owner
 * and the block count read as chosen_worker, owner_worker and n_blocks there and here. */
static void expect_documented(json_t *o, const char *doc)
{
    const char *key;
    json_t *value;
    json_object_foreach(o, key, value)
    {
        char quoted[64];
        snprintf(quoted, sizeof quoted, "`%s`", key);
        cr_expect(strstr(doc, quoted), "`kvmatch route` prints \"%s\", a name docs/PROTOCOL.md "
                  "does not define", key);
    }
}

Test(cli_route, output_uses_the_protocol_field_names, .timeout = 60)
{
    char *doc = malloc(1 << 20);
    read_file("docs/PROTOCOL.md", doc, 1 << 20);
    cr_assert(strstr(doc, "`chosen_worker`"), "docs/PROTOCOL.md not readable from the test's directory");
    fake_server s;
    fake_start(&s);
    route_run r;
    run_route((const char *const[]){"--connect", s.address, NULL}, "1 2 3\n", &r);
    fake_stop(&s);
    cr_assert_eq(r.status, 0, "exit %d, stderr: %s", r.status, r.err);
    json_error_t err;
    json_t *o = json_loads(r.out, 0, &err);
    cr_assert(o, "not one JSON object: %s (%s)", r.out, err.text);
    expect_documented(o, doc);
    cr_expect_eq(json_integer_value(json_object_get(o, "chosen_worker")), 3, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(o, "owner_worker")), 3, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(o, "n_blocks")), 5, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(o, "status")), 0, "%s", r.out);
    json_t *rows = json_object_get(o, "candidates");
    cr_assert_eq(json_array_size(rows), 1, "%s", r.out);
    expect_documented(json_array_get(rows, 0), doc);
    cr_expect_eq(json_integer_value(json_object_get(json_array_get(rows, 0), "device_blocks")), 2,
                 "%s", r.out);
    json_decref(o);
    free(doc);
}

/* --warm-ups says this caller carries out warm-ups: the decision's warm_up is printed under the
 * protocol's names; without the flag none is asked for and warm_up is null. */
Test(cli_route, warm_ups_are_asked_for_and_printed, .timeout = 60)
{
    char *doc = malloc(1 << 20);
    read_file("docs/PROTOCOL.md", doc, 1 << 20);
    fake_server s;
    fake_start(&s);
    route_run r;
    run_route((const char *const[]){"--connect", s.address, "--warm-ups", NULL}, "1 2 3\n", &r);
    fake_stop(&s);
    cr_assert_eq(r.status, 0, "exit %d, stderr: %s", r.status, r.err);
    json_t *o = json_loads(r.out, 0, NULL);
    cr_assert(o, "not one JSON object: %s", r.out);
    json_t *w = json_object_get(o, "warm_up");
    cr_assert(json_is_object(w), "%s", r.out);
    expect_documented(w, doc);
    cr_expect_eq(json_integer_value(json_object_get(w, "worker")), 1, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(w, "blocks")), 2, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(w, "tokens")), 32, "%s", r.out);
    cr_expect_eq(json_integer_value(json_object_get(w, "decision_id")), 7, "%s", r.out);
    cr_expect_str_eq(json_string_value(json_object_get(w, "attempt_id")), ":warm_up", "%s", r.out);
    json_decref(o);
    fake_start(&s);
    run_route((const char *const[]){"--connect", s.address, NULL}, "1 2 3\n", &r);
    fake_stop(&s);
    cr_assert_eq(r.status, 0, "exit %d, stderr: %s", r.status, r.err);
    o = json_loads(r.out, 0, NULL);
    cr_assert(o && json_is_null(json_object_get(o, "warm_up")), "%s", r.out);
    json_decref(o);
    free(doc);
}

/* A decision that cannot be written is a failure, as in analyze and hash. */
Test(cli_route, a_write_error_exits_1, .timeout = 60)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    fake_server s;
    fake_start(&s);
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "{ echo 1 2 3 | timeout -s KILL %d %s route --connect %s 2>&1 "
             ">/dev/full; }", ROUTE_TIMEOUT_S, bin, s.address);
    int rc = km_test_run_capture(cmd, out, sizeof out);
    fake_stop(&s);
    cr_assert_eq(rc, 1, "exit %d: %s", rc, out);
    cr_assert(strstr(out, "kvmatch route: write error"), "%s", out);
}
