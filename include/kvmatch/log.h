/* SPDX-License-Identifier: Apache-2.0 */
/* Logging.
 *
 * The log callback the handles' configs take (index, feed, subscriber, records writer, server):
 * one call per line, the line without a trailing newline and valid only during the call. A NULL
 * callback means stderr. A handle with threads of its own may call it from any of them. A line
 * may begin with its stated level (KM_LOG_ERROR / KM_LOG_WARNING / KM_LOG_INFO, below); a callback
 * other than km_logger_write reads or strips those three bytes itself.
 *
 * km_logger is a callback a program can hand them (km_logger_write): each line gets a UTC
 * timestamp, a level and a component, as text or as one JSON object per line, to stderr or to a
 * file that can be reopened (after a rotation), and lines that repeat are rate limited.
 *   text:  2026-12-02T03:04:05.123456Z info serve: serving on /run/kvmatch/kvmatch.sock (1 pools)
 *   json:  {"ts":"2026-12-02T03:04:05.123456Z","level":"info","component":"serve","msg":"..."}
 * The component is a line's leading word before ": " when it names a part of the library
 * (http, records, reload, backend, index, feed, subscriber, snapshot, serve), else the configured
 * default. A line that states its level begins with a syslog priority in angle brackets, the
 * prefix sd-daemon(3) defines (KM_LOG_ERROR "<3>", KM_LOG_WARNING "<4>", KM_LOG_INFO "<6>"; 0..3
 * are "error", 4 "warning", 5..7 "info"): the level is that one and the prefix is not written.
 * Lines of a library are written so, with the library's own level where it gives one, else the
 * fixed level its caller documents (libmicrohttpd's: KM_LOG_WARNING, src/service/http.c), and so
 * are kvmatch's own lines (tests/check_log_levels.py checks every call site). A line without the
 * prefix (a program's own, passed to km_logger_write) has its level read from its words: "error"
 * when it starts with an error code (KM_ERR_...) or says records were lost, "warning" when it says
 * something was refused, failed, cannot be done, fell back or is deprecated, else "info".
 * Rate limit: at most `burst` lines of one shape (the line with its digits left out) in a second;
 * the next line of that shape after the second says how many were left out.
 *
 * Lifecycle: km_logger_config_init -> adjust -> km_logger_create -> km_logger_write (any thread,
 * any number of times; km_logger_reopen between) -> km_logger_destroy. */
#ifndef KVMATCH_LOG_H
#define KVMATCH_LOG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*km_log_fn)(void *user, const char *line);

/* A line's own level, as its first bytes (see above). */
#define KM_LOG_ERROR "<3>"
#define KM_LOG_WARNING "<4>"
#define KM_LOG_INFO "<6>"

typedef enum km_log_format {
    KM_LOG_FORMAT_TEXT = 0,
    KM_LOG_FORMAT_JSON = 1,
} km_log_format;

typedef struct km_logger_config {
    const char *path;      /* appended to (created 0640); NULL = stderr */
    km_log_format format;  /* default text */
    const char *component; /* for lines without one; default "kvmatch" */
    uint32_t burst;        /* lines of one shape per second; 0 = no limit; default 5 */
} km_logger_config;

typedef struct km_logger km_logger;

void km_logger_config_init(km_logger_config *cfg);
/* "text" or "json" -> *out; KM_ERR_INVALID_ARGUMENT otherwise. */
int km_log_format_parse(const char *name, km_log_format *out);
/* Open the file (when a path is given). Errors: KM_ERR_NULL_POINTER, KM_ERR_IO (the file cannot
 * be opened for appending; why says so), KM_ERR_OUT_OF_MEMORY. */
int km_logger_create(const km_logger_config *cfg, km_logger **out, char *why, size_t why_size);
/* A km_log_fn: `user` is the km_logger. Thread-safe. */
void km_logger_write(void *logger, const char *line);
/* Close and open the path again (after logrotate moved it); stderr: nothing to do. On failure the
 * old file stays in use. Errors: KM_ERR_NULL_POINTER, KM_ERR_IO. Thread-safe. */
int km_logger_reopen(km_logger *logger, char *why, size_t why_size);
/* Lines left out by the rate limit so far. */
uint64_t km_logger_suppressed(const km_logger *logger);
/* NULL is a no-op. */
void km_logger_destroy(km_logger *logger);

#ifdef __cplusplus
}
#endif
#endif
