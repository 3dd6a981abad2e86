/* The Python, Go and Rust clients (clients/) against a real `kvmatch serve`: each test runs
 * scripts/test-clients.sh for one language, which builds the client offline and runs its own tests
 * (they start the daemon, $KM_BIN, on a Unix socket in a temporary directory). A language whose
 * toolchain or Debian packages are absent is reported skipped with the script's reason
 * (`scripts/install-deps.sh --clients` installs them); a failing client test fails here with the
 * end of its output. */
#include <stdio.h>
#include <string.h>

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
