/* SPDX-License-Identifier: Apache-2.0 */
/* The logger (include/kvmatch/log.h): every line has a UTC timestamp, a level and a component, as
 * text or as one JSON object; lines of one shape beyond the burst are left out and counted; a
 * reopen after a rotation writes to the new file. */
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "kv_test_publisher.h"
#include "kvmatch/kvmatch.h"
#include "test_util.h"

static char g_dir[64], g_path[128];

static km_logger *open_logger(km_log_format format, uint32_t burst)
{
    strcpy(g_dir, "/tmp/kvmatch-log-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    snprintf(g_path, sizeof g_path, "%s/kvmatch.log", g_dir);
    km_logger_config lc;
    km_logger_config_init(&lc);
    lc.path = g_path;
    lc.format = format;
    lc.component = "serve";
    lc.burst = burst;
    km_logger *l = NULL;
    char why[256];
    cr_assert_eq(km_logger_create(&lc, &l, why, sizeof why), KM_OK, "%s", why);
    return l;
}

static char *slurp(const char *path)
{
    static char buf[1 << 16];
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void cleanup(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_dir);
}

Test(log, text_lines_carry_time_level_and_component, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_TEXT, 5);
    km_logger_write(l, "serving on /tmp/s.sock (1 pools)");
    km_logger_write(l, "records: KM_ERR_IO: open /x/r.jsonl: No such file or directory");
    km_logger_write(l, "connection refused: max_connections (2) connections are open");
    km_logger_destroy(l);
    const char *text = slurp(g_path);
    regex_t re;
    cr_assert_eq(regcomp(&re,
                         "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}Z "
                         "info serve: serving on /tmp/s.sock \\(1 pools\\)\n"
                         "[0-9T:.Z-]+ error records: KM_ERR_IO: open /x/r.jsonl: No such file or "
                         "directory\n"
                         "[0-9T:.Z-]+ warning serve: connection refused: max_connections \\(2\\) "
                         "connections are open\n$",
                         REG_EXTENDED),
                 0);
    cr_assert_eq(regexec(&re, text, 0, NULL, 0), 0, "got:\n%s", text);
    regfree(&re);
    cleanup();
}

Test(log, json_lines_are_one_object_each, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_JSON, 5);
    km_logger_write(l, "http: a \"quoted\" word\tand a tab");
    km_logger_destroy(l);
    const char *text = slurp(g_path);
    cr_assert_eq(strchr(text, '\n') - text + 1, (long)strlen(text), "one line: %s", text);
    json_error_t e;
    json_t *o = json_loads(text, 0, &e);
    cr_assert_not_null(o, "not JSON (%s): %s", e.text, text);
    cr_assert_str_eq(json_string_value(json_object_get(o, "level")), "info");
    cr_assert_str_eq(json_string_value(json_object_get(o, "component")), "http");
    cr_assert_str_eq(json_string_value(json_object_get(o, "msg")), "a \"quoted\" word\tand a tab");
    const char *ts = json_string_value(json_object_get(o, "ts"));
    cr_assert(ts && strlen(ts) == 27 && ts[26] == 'Z', "ts %s", ts ? ts : "(none)");
    json_decref(o);
    cleanup();
}

/* Text that is not UTF-8 (an engine's unknown event type, echoed in a refusal) still makes a
 * line of JSON: each byte that begins no well-formed sequence is written U+FFFD, and well-formed
 * characters pass as they are. */
Test(log, json_lines_stay_utf8_whatever_the_text, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_JSON, 5);
    km_logger_write(l, "feed: unknown event type \"Blk\xff\xfe\" caf\xc3\xa9 \xe2\x82 end");
    km_logger_destroy(l);
    const char *text = slurp(g_path);
    json_error_t e;
    json_t *o = json_loads(text, 0, &e);
    cr_assert_not_null(o, "not JSON (%s): %s", e.text, text);
    cr_assert_str_eq(json_string_value(json_object_get(o, "msg")),
                     "unknown event type \"Blk\xef\xbf\xbd\xef\xbf\xbd\" caf\xc3\xa9 "
                     "\xef\xbf\xbd\xef\xbf\xbd end");
    json_decref(o);
    cleanup();
}

/* 100 lines of one shape (they differ in digits only) in well under a second: the burst is
 * written, the rest counted, and the first line of that shape in the next second says how many
 * were left out. Lines of another shape are not held back. */
Test(log, repeated_lines_are_rate_limited_and_counted, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_TEXT, 5);
    char line[80];
    for (int i = 0; i < 100; i++) {
        snprintf(line, sizeof line, "connection refused: %d open", i);
        km_logger_write(l, line);
    }
    km_logger_write(l, "something else");
    cr_assert_eq(km_logger_suppressed(l), 95);
    km_test_sleep_ms(1100);
    km_logger_write(l, "connection refused: 100 open");
    km_logger_destroy(l);
    const char *text = slurp(g_path);
    int lines = 0;
    for (const char *p = text; (p = strchr(p, '\n')); p++)
        lines++;
    cr_assert_eq(lines, 7, "5 + 1 other + 1 after the second:\n%s", text);
    cr_assert(strstr(text, "connection refused: 100 open (95 similar lines left out)"), "%s", text);
    cr_assert(strstr(text, "something else"));
    cleanup();
}

/* After the file is moved away (logrotate), a reopen writes to a new file at the path; the moved
 * file keeps what came before. */
Test(log, reopen_follows_a_rotation, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_TEXT, 5);
    km_logger_write(l, "before");
    char moved[160];
    snprintf(moved, sizeof moved, "%s.1", g_path);
    cr_assert_eq(rename(g_path, moved), 0);
    char why[256];
    cr_assert_eq(km_logger_reopen(l, why, sizeof why), KM_OK, "%s", why);
    km_logger_write(l, "after");
    km_logger_destroy(l);
    cr_assert(strstr(slurp(moved), "before"));
    const char *now = slurp(g_path);
    cr_assert(strstr(now, "after") && !strstr(now, "before"), "%s", now);
    cleanup();
}

Test(log, an_unwritable_log_file_is_refused_naming_it, .timeout = 10)
{
    km_logger_config lc;
    km_logger_config_init(&lc);
    lc.path = "/nonexistent-dir/kvmatch.log";
    km_logger *l = NULL;
    char why[256];
    cr_assert_eq(km_logger_create(&lc, &l, why, sizeof why), KM_ERR_IO);
    cr_assert_null(l);
    cr_assert(strstr(why, "/nonexistent-dir/kvmatch.log"), "%s", why);
    km_log_format f;
    cr_assert_eq(km_log_format_parse("yaml", &f), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_log_format_parse("json", &f), KM_OK);
    cr_assert_eq(f, KM_LOG_FORMAT_JSON);
}

/* A line that states its level (a syslog priority prefix, as libmicrohttpd's lines do) gets that
 * level whatever its words, and the prefix is not written; a line without one has its level read
 * from its words; something that only looks like a prefix is text. */
Test(log, a_stated_level_wins_over_the_words, .timeout = 10)
{
    km_logger *l = open_logger(KM_LOG_FORMAT_JSON, 0);
    km_logger_write(l, KM_LOG_WARNING "http: serving a probe");         /* words: info */
    km_logger_write(l, KM_LOG_INFO "http: connection refused by peer");  /* words: warning */
    km_logger_write(l, KM_LOG_ERROR "records: rotated");                /* words: info */
    km_logger_write(l, "<5>notice level");
    km_logger_write(l, "<0>emergency level");
    km_logger_write(l, "connection refused: too many");                 /* no prefix: words */
    km_logger_write(l, "<8>not a priority");
    km_logger_write(l, "<4 no closing bracket");
    km_logger_destroy(l);
    const char *want[][3] = {
        {"warning", "http", "serving a probe"},
        {"info", "http", "connection refused by peer"},
        {"error", "records", "rotated"},
        {"info", "serve", "notice level"},
        {"error", "serve", "emergency level"},
        {"warning", "serve", "connection refused: too many"},
        {"info", "serve", "<8>not a priority"},
        {"info", "serve", "<4 no closing bracket"},
    };
    const char *text = slurp(g_path);
    size_t n = 0;
    for (const char *line = text; *line; n++) {
        const char *end = strchr(line, '\n');
        cr_assert_not_null(end);
        cr_assert_lt(n, sizeof want / sizeof want[0], "more lines than written: %s", text);
        json_error_t e;
        json_t *o = json_loadb(line, (size_t)(end - line), 0, &e);
        cr_assert_not_null(o, "%s", e.text);
        cr_assert_str_eq(json_string_value(json_object_get(o, "level")), want[n][0], "line %zu", n);
        cr_assert_str_eq(json_string_value(json_object_get(o, "component")), want[n][1], "line %zu", n);
        cr_assert_str_eq(json_string_value(json_object_get(o, "msg")), want[n][2], "line %zu", n);
        json_decref(o);
        line = end + 1;
    }
    cr_assert_eq(n, sizeof want / sizeof want[0]);
    cleanup();
}

/* kvmatch's own lines state their level: every call of the library's log helpers in src/ passes a
 * format starting with KM_LOG_ERROR, KM_LOG_WARNING or KM_LOG_INFO (tests/check_log_levels.py).
 * The checker is first shown to find a call that states none, in a planted file. */
Test(log, every_own_line_states_its_level, .timeout = 30)
{
    if (system("command -v python3 >/dev/null 2>&1") != 0)
        cr_skip_test("python3 not available: log call sites not checked");
    char dir[] = "/tmp/km-log-levels-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/src", dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/src/planted.c", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("void f(km_server *s)\n{\n    km_srv_log(s, KM_LOG_INFO \"stated\");\n"
          "    km_srv_log(s, \"not stated %d\", 1);\n}\n",
          f);
    fclose(f);
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "python3 tests/check_log_levels.py %s", dir);
    int status = km_test_run_capture(cmd, out, sizeof out);
    cr_assert_eq(status, 1, "%s", out);
    cr_assert(strstr(out, "src/planted.c:4: km_srv_log states no level"), "%s", out);
    cr_assert(!strstr(out, "planted.c:3"), "%s", out);
    unlink(path);
    snprintf(path, sizeof path, "%s/src", dir);
    rmdir(path);
    rmdir(dir);
    status = km_test_run_capture("python3 tests/check_log_levels.py .", out, sizeof out);
    cr_assert_eq(status, 0, "calls that state no level:\n%s", out);
}
