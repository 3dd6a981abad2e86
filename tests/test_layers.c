/* SPDX-License-Identifier: Apache-2.0 */
/* The dependency rules (stated in tests/check_layers.py and docs/ARCHITECTURE.md, "Dependency
 * rules"): the tree obeys them, and the checker finds a violation of every kind it knows, each
 * planted in a copy of the tree, exactly where it was planted and nothing else. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

static void need_python(void)
{
    if (system("command -v python3 >/dev/null 2>&1") != 0)
        cr_skip_test("python3 not available: dependency rules not checked");
}

Test(layers, the_tree_obeys_the_dependency_rules, .timeout = 60)
{
    need_python();
    char out[8192];
    int status = km_test_run_capture("python3 tests/check_layers.py .", out, sizeof out);
    cr_assert_eq(status, 0, "%s", out);
}

/* One violation per rule kind, each alone in its file, none implying another. */
static const struct plant {
    const char *file; /* relative to the copy; created when absent */
    const char *line; /* appended as the file's last line */
    const char *rule;
} plants[] = {
    {"src/base/error.c", "#include \"index/host_table.h\"", "layer"},
    {"src/service/metrics.c", "#include \"kvmatch/kvmatch.h\"", "layer"},
    {"include/kvmatch/error.h", "#include \"kvmatch/index.h\"", "layer"},
    {"src/decide/approx.c", "#include \"kvmatch/hash.h\"", "decide"},
    {"src/service/http.c", "#include \"kernels/cuda_seam.h\"", "kernels-boundary"},
    {"kernels/cuda_backend.c", "#include \"events/engine_hash_map.h\"", "kernels-scope"},
    {"src/cli/hash_cmd.c", "#include \"index/index_internal.h\"", "internal"},
    {"include/kvmatch/hash.h", "#include \"base/u64_map.h\"", "public-src"},
    {"src/index/cpu_backend.c", "static cudaStream_t planted_stream;", "cuda"},
    {"include/kvmatch/index.h", "#include <cuda_runtime.h>", "cuda"},
    {"src/events/publisher.c", "#include \"engine_hash_map.h\"", "qualified"},
    {"src/extra/planted.c", "int km_planted;", "unplaced"},
    {"include/kvmatch/planted.h", "/* a public header without a layer */", "unplaced"},
};

/* Append `line` to root/file (creating it and its folder if needed); returns its line number. */
static int append_line(const char *root, const char *file, const char *line)
{
    char path[1024], cmd[1200];
    snprintf(path, sizeof path, "%s/%s", root, file);
    snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", path);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    FILE *f = fopen(path, "a+");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    rewind(f);
    int lines = 0, c, last = '\n';
    while ((c = fgetc(f)) != EOF) {
        lines += c == '\n';
        last = c;
    }
    fseek(f, 0, SEEK_END); /* from reading to writing */
    if (last != '\n') {
        fputc('\n', f);
        lines++;
    }
    fprintf(f, "%s\n", line);
    cr_assert_eq(fclose(f), 0, "%s", path);
    return lines + 1;
}

/* Drop every line of root/file that includes `include`. */
static void remove_include(const char *root, const char *file, const char *include)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "sed -i '\\|#[[:space:]]*include[[:space:]]*[\"<]%s[\">]|d' '%s/%s'",
             include, root, file);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

Test(layers, planted_violations_are_each_reported, .timeout = 60)
{
    need_python();
    char root[] = "/tmp/km-layers-XXXXXX";
    cr_assert_not_null(mkdtemp(root), "mkdtemp: %s", strerror(errno));
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cp -R src kernels include '%s'/", root);
    cr_assert_eq(system(cmd), 0, "%s", cmd);

    size_t n = sizeof plants / sizeof plants[0];
    char expect[sizeof plants / sizeof plants[0] + 1][300];
    for (size_t i = 0; i < n; i++) {
        int line = append_line(root, plants[i].file, plants[i].line);
        snprintf(expect[i], sizeof expect[i], "%s:%d: %s: ", plants[i].file, line, plants[i].rule);
    }
    /* A tolerated violation that is gone: its EXCEPTIONS entry is reported as stale. */
    char exceptions[1024];
    cr_assert_eq(km_test_run_capture("python3 tests/check_layers.py --exceptions", exceptions,
                                     sizeof exceptions), 0, "%s", exceptions);
    char *tab = strchr(exceptions, '\t'), *eol = tab ? strchr(tab, '\n') : NULL;
    if (tab && eol) {
        *tab = *eol = '\0';
        remove_include(root, exceptions, tab + 1);
        snprintf(expect[n], sizeof expect[n], "%.200s:0: stale-exception: ", exceptions);
        n++;
    }

    char out[8192];
    snprintf(cmd, sizeof cmd, "python3 tests/check_layers.py '%s'", root);
    int status = km_test_run_capture(cmd, out, sizeof out);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    system(cmd);
    cr_assert_eq(status, 1, "exit status %d:\n%s", status, out);
    for (size_t i = 0; i < n; i++)
        cr_expect_not_null(strstr(out, expect[i]), "not reported: %s\n%s", expect[i], out);
    char count[64];
    snprintf(count, sizeof count, "check_layers: %zu violation(s)", n);
    cr_assert_not_null(strstr(out, count), "expected exactly the %zu planted:\n%s", n, out);
}
