/* SPDX-License-Identifier: Apache-2.0 */
/* The Python, Go and Rust clients (clients/) against a real `kvmatch serve`: each test runs
 * scripts/test-clients.sh for one language, which builds the client offline and runs its own tests
 * (they start the daemon, $KM_BIN, on a Unix socket in a temporary directory). A language whose
 * toolchain or Debian packages are absent is reported skipped with the script's reason
 * (`scripts/install-deps.sh --clients` installs them); a failing client test fails here with the
 * end of its output. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "test_util.h"

#define CLIENT_OUTPUT_BYTES 6000

static void run_client_tests(const char *language)
{
    static char out[CLIENT_OUTPUT_BYTES + 1];
    char cmd[256];
    /* The tail, where a failure is reported; pipefail keeps the script's status. */
    snprintf(cmd, sizeof cmd,
             "bash -c 'set -o pipefail; scripts/test-clients.sh %s 2>&1 | tail -c %d'", language,
             CLIENT_OUTPUT_BYTES);
    int status = km_test_run_capture(cmd, out, sizeof out);
    if (status == 77) {
        const char *reason = strstr(out, "skipped: ");
        cr_skip_test("%s client: %s", language, reason ? reason + 9 : out);
    }
    cr_assert_eq(status, 0, "the %s client's tests failed (exit %d):\n%s", language, status, out);
}

Test(clients, python_package_against_the_daemon, .timeout = 300)
{
    run_client_tests("python");
}

Test(clients, go_client_against_the_daemon, .timeout = 600)
{
    run_client_tests("go");
}

Test(clients, rust_client_against_the_daemon, .timeout = 600)
{
    run_client_tests("rust");
}

/* `kvmatch bench ipc --clients DIR` runs each driver in DIR on the C client's one-connection
 * schedule and adds its rows: the Python client's driver gives a row per frame shape, with every
 * route decided; a driver that fails gives none and the run goes on. (What the rows measure is
 * the benchmark's business; this checks that they are there and come from real decisions.) */
Test(clients, bench_ipc_adds_a_row_per_client_language, .timeout = 180)
{
    if (system("/usr/bin/python3 -c 'import msgpack' >/dev/null 2>&1") != 0)
        cr_skip_test("python3-msgpack is missing: the Python driver cannot run");
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    char dir[] = "/tmp/kvmatch-test-bench-clients-XXXXXX";
    cr_assert(mkdtemp(dir), "mkdtemp");
    char path[256], cmd[1024];
    snprintf(path, sizeof path, "%s/python", dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fprintf(f, "#!/bin/sh\nPYTHONPATH=clients/python exec /usr/bin/python3 clients/python/bench.py \"$@\"\n");
    fclose(f);
    snprintf(path, sizeof path, "%s/broken", dir);
    f = fopen(path, "w");
    cr_assert(f);
    fprintf(f, "#!/bin/sh\necho 'no result' && exit 3\n");
    fclose(f);
    snprintf(cmd, sizeof cmd, "chmod +x %s/python %s/broken && %s bench ipc --quick --only 1 --clients %s "
             "--json > %s/out.json 2> %s/err.txt", dir, dir, bin, dir, dir, dir);
    int rc = system(cmd);
    snprintf(path, sizeof path, "%s/out.json", dir);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    snprintf(path, sizeof path, "%s/err.txt", dir);
    static char errors[8192];
    FILE *ef = fopen(path, "r");
    size_t n = ef ? fread(errors, 1, sizeof errors - 1, ef) : 0;
    errors[n] = '\0';
    if (ef)
        fclose(ef);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(rc, 0, "bench ipc failed: %s", errors);
    cr_assert(root, "no JSON: %s", err.text);
    cr_expect(strstr(errors, "client broken"), "the failing driver is reported: %s", errors);
    int python_rows = 0, c_rows = 0;
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(root, "results"), i, r)
    {
        const char *client = json_string_value(json_object_get(r, "client"));
        cr_assert(client, "every row names its client");
        cr_expect(strcmp(client, "broken"), "a failed driver has no row");
        if (!strcmp(client, "c"))
            c_rows++;
        if (strcmp(client, "python"))
            continue;
        python_rows++;
        cr_expect_eq(json_integer_value(json_object_get(r, "errors")), 0);
        cr_expect_gt(json_number_value(json_object_get(r, "decisions_per_s")), 0);
        cr_expect_eq(json_integer_value(json_object_get(r, "connections")), 1);
    }
    cr_expect_eq(python_rows, 2, "one row per frame shape (single, batched)");
    cr_expect_eq(c_rows, 1, "--only 1: the C client's single-route phase");
    json_decref(root);
}

/* `kvmatch bench ipc --rounds N` takes the selected phases in turns and reports each once, over
 * all its rounds: one row per phase (not one per round), every route of each decided. */
Test(clients, bench_ipc_rounds_give_one_row_per_phase, .timeout = 120)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    char dir[] = "/tmp/kvmatch-test-bench-rounds-XXXXXX";
    cr_assert(mkdtemp(dir), "mkdtemp");
    char path[256], cmd[1024];
    snprintf(cmd, sizeof cmd, "%s bench ipc --quick --only 1,14 --rounds 3 --json "
             "> %s/out.json 2> %s/err.txt", bin, dir, dir);
    int rc = system(cmd);
    snprintf(path, sizeof path, "%s/out.json", dir);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(rc, 0, "bench ipc --rounds 3 failed");
    cr_assert(root, "no JSON: %s", err.text);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(root, "workload"), "rounds")), 3);
    json_t *results = json_object_get(root, "results");
    cr_assert_eq(json_array_size(results), 2, "one row per phase, got %zu", json_array_size(results));
    size_t i;
    json_t *r;
    json_array_foreach(results, i, r)
    {
        cr_expect_eq(json_integer_value(json_object_get(r, "errors")), 0);
        cr_expect(json_number_value(json_object_get(r, "decisions_per_s")) > 0);
        cr_expect(json_number_value(json_object_get(r, "rtt_p99_us")) >=
                  json_number_value(json_object_get(r, "rtt_p50_us")));
    }
    const char *reply = json_string_value(json_object_get(json_array_get(results, 1), "reply"));
    cr_assert(reply && !strcmp(reply, "echo"), "the echo row is the second");
    json_decref(root);
}
