/* SPDX-License-Identifier: Apache-2.0 */
/* `make install` as a packager or an operator uses it: into a temporary prefix (and a DESTDIR), a
 * program built against the installed library with pkg-config alone, the shared library's soname
 * and its exported symbols (the public API, nothing of the implementation), the man pages, the
 * example config (it loads), the example systemd unit (systemd-analyze verify, where it exists;
 * its static user and group, from the installed sysusers.d file) and the loader cache's refresh.
 * The install uses the build directory of the kvmatch binary under test ($KM_BIN). */
#include <libgen.h>
#include <stdarg.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvmatch/kvmatch.h"
#include "test_util.h"

static char g_tmp[64];
static char g_build[PATH_MAX];
static int g_cuda;

static bool have(const char *command)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", command);
    return system(cmd) == 0;
}

/* The build directory of $KM_BIN (build: CUDA=1, build-cpu: CUDA=0); false for another one (a
 * sanitizer build is not installed). */
static bool find_build(void)
{
    const char *bin = getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    char copy[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", bin);
    snprintf(g_build, sizeof g_build, "%s", dirname(copy));
    snprintf(copy, sizeof copy, "%s", g_build);
    const char *base = basename(copy);
    if (!strcmp(base, "build"))
        g_cuda = 1;
    else if (!strcmp(base, "build-cpu"))
        g_cuda = 0;
    else
        return false;
    return true;
}

static void setup_tmp(void)
{
    strcpy(g_tmp, "/tmp/kvmatch-install-XXXXXX");
    cr_assert_not_null(mkdtemp(g_tmp));
}

static void cleanup_tmp(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_tmp);
}

/* Run a shell command; its exit status, output in out. */
static int sh(char *out, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sh(char *out, size_t size, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return km_test_run_capture(cmd, out, size);
}

static bool exists(const char *fmt, const char *a)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, fmt, g_tmp, a);
    struct stat st;
    return lstat(path, &st) == 0;
}

/* The suite's tests run in parallel, and `make install` builds what the build directory lacks
 * (the shared library when only the binaries were built): one install at a time, so that no test
 * installs a library another is still linking. The loader's cache of the machine is left alone
 * (LDCONFIG=:); ldconfig_runs_only_when_installing_for_this_machine checks that step. */
static void make_install(const char *vars)
{
    static char out[1 << 16];
    int rc = sh(out, sizeof out,
                "flock %s/.install-lock make -s --no-print-directory install BUILD=%s CUDA=%d "
                "LDCONFIG=: %s", g_build, g_build, g_cuda, vars);
    cr_assert_eq(rc, 0, "make install %s failed:\n%s", vars, out);
}

static void skip_unless_ready(void)
{
    if (!find_build())
        cr_skip_test("make install is checked against build/ or build-cpu/, not %s", g_build);
    if (!have("make") || !have("pkg-config") || !have("cc") || !have("flock"))
        cr_skip_test("make, pkg-config, cc or flock is missing");
}

Test(install, a_program_builds_against_the_installed_library_with_pkg_config, .timeout = 600)
{
    skip_unless_ready();
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "PREFIX=%s/prefix", g_tmp);
    make_install(vars);
    const char *files[] = {"bin/kvmatch", "lib/libkvmatch.a", "lib/libkvmatch.so",
                           "lib/libkvmatch.so.0", "lib/libkvmatch.so." KVMATCH_VERSION,
                           "lib/pkgconfig/kvmatch.pc", "include/kvmatch/kvmatch.h",
                           "include/kvmatch/server.h", "share/man/man1/kvmatch.1",
                           "share/man/man1/kvmatch-serve.1", "share/man/man1/kvmatch-route.1",
                           "share/doc/kvmatch/LICENSE", "share/doc/kvmatch/examples/serve.json",
                           "share/doc/kvmatch/examples/kvmatch.service",
                           "lib/sysusers.d/kvmatch.conf"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        cr_assert(exists("%s/prefix/%s", files[i]), "%s is installed", files[i]);

    static char out[1 << 16];
    cr_assert_eq(sh(out, sizeof out, "readelf -d %s/prefix/lib/libkvmatch.so", g_tmp), 0, "%s", out);
    cr_assert(strstr(out, "[libkvmatch.so.0]"), "the soname is libkvmatch.so.0:\n%s", out);
    cr_assert_eq(sh(out, sizeof out, "nm -D --defined-only %s/prefix/lib/libkvmatch.so | "
                    "awk '$2 ~ /^[TDBRW]$/ {sub(/@.*/, \"\", $3); print $3}'", g_tmp), 0, "%s", out);
    cr_assert(strstr(out, "km_index_create\n"), "the public API is exported:\n%.2000s", out);
    cr_assert(strstr(out, "km_server_create\n"));
    cr_assert_null(strstr(out, "km_srv_"), "internal functions stay hidden:\n%.2000s", out);
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"))
        cr_assert(!strncmp(line, "km_", 3), "only km_ symbols are exported, not %s", line);

    char prog[PATH_MAX];
    snprintf(prog, sizeof prog, "%s/prog.c", g_tmp);
    FILE *f = fopen(prog, "w");
    cr_assert_not_null(f);
    fputs("#include <stdio.h>\n#include <kvmatch/kvmatch.h>\n"
          "int main(void) {\n"
          "    km_index *index = NULL;\n"
          "    if (km_index_create(NULL, &index) != KM_OK) return 1;\n"
          "    km_index_destroy(index);\n"
          "    printf(\"kvmatch %s: %s\\n\", KVMATCH_VERSION, km_strerror(KM_ERR_IO));\n"
          "    return 0;\n}\n", f);
    fclose(f);
    int rc = sh(out, sizeof out,
                "export PKG_CONFIG_PATH=%s/prefix/lib/pkgconfig && cd %s && "
                "cc -std=c11 -Wall -Werror prog.c $(pkg-config --cflags --libs kvmatch) "
                "-Wl,-rpath,%s/prefix/lib -o prog && ./prog",
                g_tmp, g_tmp, g_tmp);
    cr_assert_eq(rc, 0, "building and running against the installed library:\n%s", out);
    cr_assert(strstr(out, "kvmatch " KVMATCH_VERSION ": "), "%s", out);
    cr_assert_eq(sh(out, sizeof out, "%s/prefix/bin/kvmatch version", g_tmp), 0, "%s", out);
    if (have("groff")) {
        rc = sh(out, sizeof out, "for m in %s/prefix/share/man/man1/*.1; do groff -man -ww -z "
                "\"$m\" || exit 1; done", g_tmp);
        cr_assert(rc == 0 && out[0] == '\0', "the man pages render without warnings:\n%s", out);
    }
    cleanup_tmp();
}

/* DESTDIR stages the files under another root with the prefix the package will have; uninstall
 * removes what install put there. */
Test(install, destdir_stages_under_the_final_prefix_and_uninstall_removes_it, .timeout = 600)
{
    skip_unless_ready();
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "DESTDIR=%s/stage PREFIX=/usr", g_tmp);
    make_install(vars);
    cr_assert(exists("%s/stage/usr/%s", "bin/kvmatch"));
    cr_assert(exists("%s/stage/usr/%s", "lib/libkvmatch.so.0"));
    static char out[8192];
    cr_assert_eq(sh(out, sizeof out, "grep -x 'prefix=/usr' %s/stage/usr/lib/pkgconfig/kvmatch.pc",
                    g_tmp), 0, "the .pc names the final prefix");
    cr_assert_eq(sh(out, sizeof out, "grep -q 'ExecStart=/usr/bin/kvmatch serve --config "
                    "/etc/kvmatch/serve.json' %s/stage/usr/share/doc/kvmatch/examples/kvmatch.service",
                    g_tmp), 0, "the unit names the installed binary and /etc");
    cr_assert(exists("%s/stage/usr/%s", "lib/sysusers.d/kvmatch.conf"),
              "the service user's sysusers.d file is where Debian's packages put theirs");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "make -s --no-print-directory uninstall DESTDIR=%s/stage PREFIX=/usr",
             g_tmp);
    cr_assert_eq(km_test_run_capture(cmd, out, sizeof out), 0, "%s", out);
    cr_assert_eq(sh(out, sizeof out, "find %s/stage -type f -o -type l", g_tmp), 0);
    cr_assert_eq(out[0], '\0', "uninstall leaves no file behind:\n%s", out);
    cleanup_tmp();
}

/* docs/SERVICE.md's steps for systemd (the default prefix) put the example config where the
 * unit that `make install` writes reads it: the path after "examples/serve.json" in the docs is
 * the unit's --config. */
Test(install, the_documented_config_path_is_the_one_the_unit_reads, .timeout = 600)
{
    skip_unless_ready();
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "DESTDIR=%s/stage", g_tmp);
    make_install(vars);
    static char unit[8192], docs[8192];
    cr_assert_eq(sh(unit, sizeof unit, "sed -n 's/^ExecStart=.* --config \\([^ ]*\\).*/\\1/p' "
                    "%s/stage/usr/local/share/doc/kvmatch/examples/kvmatch.service", g_tmp), 0,
                 "%s", unit);
    cr_assert_eq(sh(docs, sizeof docs, "sed -n 's|^sudo install .*examples/serve.json "
                    "\\([^ ]*\\).*|\\1|p' docs/SERVICE.md"), 0, "%s", docs);
    cr_assert(unit[0] == '/', "no --config in the unit's ExecStart: %s", unit);
    cr_assert_str_eq(docs, unit, "docs/SERVICE.md installs the config as %s; the unit (PREFIX "
                     "/usr/local) reads %s", docs, unit);
    cleanup_tmp();
}

/* Every docs/NAME a man page refers its reader to is installed under the doc directory, where
 * docs/NAME is then that file. */
Test(install, the_docs_the_man_pages_name_are_installed, .timeout = 600)
{
    skip_unless_ready();
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "DESTDIR=%s/stage", g_tmp);
    make_install(vars);
    static char named[8192], missing[8192];
    cr_assert_eq(sh(named, sizeof named, "grep -oh 'docs/[A-Za-z_.]*[a-z]' man/*.1 | sort -u"), 0);
    cr_assert(strstr(named, "docs/SERVICE.md"), "the man pages name no doc: %s", named);
    cr_assert_eq(sh(missing, sizeof missing, "for d in $(grep -oh 'docs/[A-Za-z_.]*[a-z]' man/*.1 "
                    "| sort -u); do [ -f %s/stage/usr/local/share/doc/kvmatch/$d ] || echo $d; "
                    "done", g_tmp), 0);
    cr_assert_eq(missing[0], '\0', "named by a man page, not installed:\n%s", missing);
    cleanup_tmp();
}

/* The example systemd unit passes systemd-analyze verify (its binary and man page installed). */
Test(install, the_example_unit_passes_systemd_analyze_verify, .timeout = 600)
{
    skip_unless_ready();
    if (!have("systemd-analyze"))
        cr_skip_test("systemd-analyze is not installed: the unit is not verified");
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "PREFIX=%s/prefix", g_tmp);
    make_install(vars);
    static char out[8192];
    int rc = sh(out, sizeof out, "MANPATH=%s/prefix/share/man: systemd-analyze verify "
                "%s/prefix/share/doc/kvmatch/examples/kvmatch.service", g_tmp, g_tmp);
    cr_assert_eq(rc, 0, "systemd-analyze verify:\n%s", out);
    cleanup_tmp();
}

/* Installed for this machine (no DESTDIR), the loader's cache is refreshed, so a program linked
 * against the installed library starts; a failing ldconfig (not root) says what to run. A DESTDIR
 * staging leaves it to the package. */
Test(install, ldconfig_runs_only_when_installing_for_this_machine, .timeout = 120)
{
    skip_unless_ready();
    static char out[1 << 16];
    const char *make = "make -n --no-print-directory install BUILD=%s CUDA=%d PREFIX=/usr/local "
                       "LDCONFIG=/sbin/ldconfig %s";
    char cmd[PATH_MAX + 512];
    snprintf(cmd, sizeof cmd, make, g_build, g_cuda, "");
    cr_assert_eq(km_test_run_capture(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "/sbin/ldconfig ||"), "make install runs ldconfig:\n%s", out);
    snprintf(cmd, sizeof cmd, make, g_build, g_cuda, "DESTDIR=/tmp/kvmatch-stage");
    cr_assert_eq(km_test_run_capture(cmd, out, sizeof out), 0, "%s", out);
    cr_assert_null(strstr(out, "ldconfig"), "a DESTDIR install runs no ldconfig:\n%s", out);

    /* an ldconfig that fails, as it does for a user who is not root */
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "PREFIX=%s/prefix LDCONFIG=false", g_tmp);
    int rc = sh(out, sizeof out, "flock %s/.install-lock make -s --no-print-directory install "
                "BUILD=%s CUDA=%d %s", g_build, g_build, g_cuda, vars);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "run it as root (sudo false)"), "the failure says what to do:\n%s", out);
    cleanup_tmp();
}

/* The example unit runs as the static user and group kvmatch, which the installed sysusers.d
 * file declares, not as a DynamicUser, whose group no router could join: its socket directory
 * (0750) and socket (0660) shut out everyone but group kvmatch. */
Test(install, the_example_unit_lets_group_kvmatch_reach_the_socket, .timeout = 600)
{
    skip_unless_ready();
    setup_tmp();
    char vars[256];
    snprintf(vars, sizeof vars, "PREFIX=%s/prefix", g_tmp);
    make_install(vars);
    static char out[1 << 16];
    cr_assert_eq(sh(out, sizeof out, "grep -v '^#' %s/prefix/share/doc/kvmatch/examples/"
                    "kvmatch.service", g_tmp), 0, "%s", out);
    cr_assert_null(strstr(out, "DynamicUser"), "no DynamicUser:\n%s", out);
    cr_assert(strstr(out, "\nUser=kvmatch\n") && strstr(out, "\nGroup=kvmatch\n"), "%s", out);
    cr_assert(strstr(out, "\nRuntimeDirectory=kvmatch\n"), "%s", out);
    cr_assert(strstr(out, "\nRuntimeDirectoryMode=0750\n"), "others are shut out:\n%s", out);
    cr_assert(strstr(out, "\nUMask=0027\n"), "%s", out);
    cr_assert(strstr(out, "\nNoNewPrivileges=yes\n") && strstr(out, "\nProtectSystem=strict\n"),
              "the hardening stays:\n%s", out);
    cr_assert_eq(sh(out, sizeof out, "grep -v '^#' %s/prefix/lib/sysusers.d/kvmatch.conf", g_tmp),
                 0, "%s", out);
    cr_assert(strstr(out, "u     kvmatch "), "the sysusers.d file makes user kvmatch:\n%s", out);
    cr_assert_eq(sh(out, sizeof out, "grep -o '\"socket\": *\"[^\"]*\"' "
                    "dist/serve.json"), 0, "%s", out);
    cr_assert(strstr(out, "/run/kvmatch/"), "the example config's socket is in the unit's "
              "RuntimeDirectory:\n%s", out);
    cleanup_tmp();
}

/* The example configuration loads: every key is one the reader knows. */
Test(install, the_example_config_loads, .timeout = 30)
{
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = NULL;
    char why[512];
    int rc = km_server_config_load_json("dist/serve.json", &cfg, &owner, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "dist/serve.json: %s", why);
    cr_assert_eq(cfg.n_pools, 1);
    km_server_config_json_free(owner);
}
