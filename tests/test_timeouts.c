/* SPDX-License-Identifier: Apache-2.0 */
/* Every test bounds its own time: each Test(...) in a C file of tests/ names a .timeout
 * (tests/check_timeouts.py). The checker is first shown to find the tests without one, and only
 * those, in a planted file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

Test(timeouts, every_test_names_a_timeout, .timeout = 30)
{
    if (system("command -v python3 >/dev/null 2>&1") != 0)
        cr_skip_test("python3 not available: test timeouts not checked");
    char dir[] = "/tmp/km-timeouts-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/tests", dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/tests/test_planted.c", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("Test(planted, bounded, .timeout = 10)\n{\n}\n"
          "Test(planted, unbounded)\n{\n}\n"
          "Test(planted, bounded_on_a_second_line, .init = setup,\n     .timeout = 10)\n{\n}\n"
          "Test(planted, unbounded_with_options, .init = setup, .description = \"a (b)\")\n"
          "{\n}\n",
          f);
    fclose(f);
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "python3 tests/check_timeouts.py %s", dir);
    int status = km_test_run_capture(cmd, out, sizeof out);
    cr_assert_eq(status, 1, "%s", out);
    cr_assert(strstr(out, "tests/test_planted.c:4: planted/unbounded has no .timeout"), "%s", out);
    cr_assert(strstr(out, "tests/test_planted.c:11: planted/unbounded_with_options has no "
                          ".timeout"), "%s", out);
    cr_assert(!strstr(out, "planted/bounded"), "%s", out);
    unlink(path);
    snprintf(path, sizeof path, "%s/tests", dir);
    rmdir(path);
    rmdir(dir);
    status = km_test_run_capture("python3 tests/check_timeouts.py .", out, sizeof out);
    cr_assert_eq(status, 0, "tests without a .timeout:\n%s", out);
}
