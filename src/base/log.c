/* SPDX-License-Identifier: Apache-2.0 */
/* The logger (include/kvmatch/log.h): timestamp, level and component on every line, text or JSON,
 * a file that can be reopened, and a per-shape rate limit. One mutex serialises the writes, so
 * lines from several threads never interleave. */
#include "kvmatch/log.h"

#include "base/utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/error_detail.h"
#include "kvmatch/error.h"

#define SHAPES 64u /* shapes tracked for the rate limit (a hash table; a collision evicts) */
#define LINE_MAX_BYTES 2048u

typedef struct shape {
    uint64_t hash;
    int64_t window_ns;   /* start of its current one-second window */
    uint32_t in_window;  /* lines of it written in that window */
    uint64_t suppressed; /* left out since the last one written */
} shape;

struct km_logger {
    pthread_mutex_t lock;
    int fd; /* 2 for stderr */
    char *path;
    km_log_format format;
    char component[32];
    uint32_t burst;
    uint64_t suppressed_total;
    shape shapes[SHAPES];
};

void km_logger_config_init(km_logger_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->format = KM_LOG_FORMAT_TEXT;
    cfg->component = "kvmatch";
    cfg->burst = 5;
}

int km_log_format_parse(const char *name, km_log_format *out)
{
    if (name && !strcmp(name, "text"))
        *out = KM_LOG_FORMAT_TEXT;
    else if (name && !strcmp(name, "json"))
        *out = KM_LOG_FORMAT_JSON;
    else
        return KM_ERR_INVALID_ARGUMENT;
    return KM_OK;
}

static int open_log(const char *path, char *why, size_t why_size, int *fd)
{
    *fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (*fd < 0)
        return km_why(why, why_size, KM_ERR_IO, "log file %s: %s", path, strerror(errno));
    return KM_OK;
}

int km_logger_create(const km_logger_config *cfg, km_logger **out, char *why, size_t why_size)
{
    if (!cfg || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or out is NULL");
    *out = NULL;
    km_logger *l = calloc(1, sizeof *l);
    if (!l)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "logger");
    l->fd = 2;
    l->format = cfg->format;
    l->burst = cfg->burst;
    snprintf(l->component, sizeof l->component, "%s", cfg->component ? cfg->component : "kvmatch");
    if (cfg->path) {
        int rc;
        if (!(l->path = strdup(cfg->path))) {
            free(l);
            return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "logger");
        }
        if ((rc = open_log(l->path, why, why_size, &l->fd)) != KM_OK) {
            free(l->path);
            free(l);
            return rc;
        }
    }
    pthread_mutex_init(&l->lock, NULL);
    *out = l;
    return KM_OK;
}

int km_logger_reopen(km_logger *l, char *why, size_t why_size)
{
    if (!l)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "logger is NULL");
    if (!l->path)
        return KM_OK;
    int fd;
    int rc = open_log(l->path, why, why_size, &fd);
    if (rc != KM_OK)
        return rc;
    pthread_mutex_lock(&l->lock);
    close(l->fd);
    l->fd = fd;
    pthread_mutex_unlock(&l->lock);
    return KM_OK;
}

uint64_t km_logger_suppressed(const km_logger *l)
{
    if (!l)
        return 0;
    pthread_mutex_lock((pthread_mutex_t *)&l->lock);
    uint64_t n = l->suppressed_total;
    pthread_mutex_unlock((pthread_mutex_t *)&l->lock);
    return n;
}

void km_logger_destroy(km_logger *l)
{
    if (!l)
        return;
    if (l->path)
        close(l->fd);
    pthread_mutex_destroy(&l->lock);
    free(l->path);
    free(l);
}

/* FNV-1a of the line without its digits: "refused 17 connections" and "refused 18 connections"
 * are one shape. */
static uint64_t shape_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325u;
    for (; *s; s++)
        if (*s < '0' || *s > '9')
            h = (h ^ (unsigned char)*s) * 0x100000001b3u;
    return h;
}

/* The level a line states with a syslog priority prefix ("<4>..."), moving *line past it; NULL
 * when it states none. */
static const char *stated_level(const char **line)
{
    const char *l = *line;
    if (l[0] != '<' || l[1] < '0' || l[1] > '7' || l[2] != '>')
        return NULL;
    *line = l + 3;
    return l[1] <= '3' ? "error" : l[1] == '4' ? "warning" : "info";
}

/* The level of a line that states none, read from its words. */
static const char *level_of(const char *msg)
{
    if (!strncmp(msg, "KM_ERR_", 7) || strstr(msg, " lost"))
        return "error";
    static const char *const warn[] = {"refused", "failed", "cannot", "fallback", "deprecated",
                                       "not written", "not ready"};
    for (size_t i = 0; i < sizeof warn / sizeof warn[0]; i++)
        if (strstr(msg, warn[i]))
            return "warning";
    return "info";
}

/* JSON string body of s (quotes not included) into out; control bytes as \u00XX. */
static size_t json_escape(char *out, size_t size, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t left = strlen(s), n = 0;
    while (left && n + 7 < size) {
        unsigned char c = *p;
        size_t k = c < 0x80 ? 1 : km_utf8_sequence(p, left);
        if (c == '"' || c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)c;
        } else if (c < 0x20) {
            n += (size_t)snprintf(out + n, size - n, "\\u%04x", c);
        } else if (k == 0) { /* not UTF-8 (text from an engine or a router): U+FFFD */
            n += (size_t)snprintf(out + n, size - n, "\\ufffd");
            k = 1;
        } else if (n + k + 7 < size) {
            memcpy(out + n, p, k);
            n += k;
        } else {
            break; /* a whole character only */
        }
        p += k ? k : 1;
        left -= k ? k : 1;
    }
    out[n] = '\0';
    return n;
}

void km_logger_write(void *user, const char *line)
{
    km_logger *l = user;
    if (!l || !line)
        return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct timespec mono;
    clock_gettime(CLOCK_MONOTONIC, &mono);
    int64_t mono_ns = (int64_t)mono.tv_sec * 1000000000 + mono.tv_nsec;

    const char *level = stated_level(&line);
    /* component: a leading word before ": " that names one of the library's parts */
    static const char *const components[] = {"http", "records", "reload", "backend", "index",
                                             "feed", "subscriber", "snapshot", "serve", NULL};
    char component[32];
    const char *msg = line;
    size_t word = strspn(line, "abcdefghijklmnopqrstuvwxyz_");
    bool known = false;
    for (const char *const *c = components; *c && !known; c++)
        known = strlen(*c) == word && !strncmp(*c, line, word);
    if (known && line[word] == ':' && line[word + 1] == ' ') {
        memcpy(component, line, word);
        component[word] = '\0';
        msg = line + word + 2;
    } else {
        snprintf(component, sizeof component, "%s", l->component);
    }

    uint64_t left_out = 0;
    pthread_mutex_lock(&l->lock);
    if (l->burst) {
        uint64_t h = shape_hash(line);
        shape *sh = &l->shapes[h % SHAPES];
        if (sh->hash != h) {
            memset(sh, 0, sizeof *sh);
            sh->hash = h;
        }
        if (mono_ns - sh->window_ns >= 1000000000) {
            sh->window_ns = mono_ns;
            sh->in_window = 0;
        }
        if (sh->in_window >= l->burst) {
            sh->suppressed++;
            l->suppressed_total++;
            pthread_mutex_unlock(&l->lock);
            return;
        }
        sh->in_window++;
        left_out = sh->suppressed;
        sh->suppressed = 0;
    }
    struct tm tm;
    gmtime_r(&now.tv_sec, &tm);
    char ts[64];
    snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, now.tv_nsec / 1000);
    char suffix[64] = "";
    if (left_out)
        snprintf(suffix, sizeof suffix, " (%" PRIu64 " similar lines left out)", left_out);
    if (!level)
        level = level_of(msg);
    char out[LINE_MAX_BYTES * 2];
    int n;
    if (l->format == KM_LOG_FORMAT_JSON) {
        char body[LINE_MAX_BYTES * 2 - 256], comp[80];
        json_escape(body, sizeof body, msg);
        json_escape(comp, sizeof comp, component);
        n = snprintf(out, sizeof out,
                     "{\"ts\":\"%s\",\"level\":\"%s\",\"component\":\"%s\",\"msg\":\"%s%s\"}\n", ts,
                     level, comp, body, suffix);
    } else {
        n = snprintf(out, sizeof out, "%s %s %s: %s%s\n", ts, level, component, msg, suffix);
    }
    if (n > (int)sizeof out - 1) { /* a long text line is cut, still ending with its newline
                                    * (a JSON body is cut whole escapes at a time, above) */
        n = (int)sizeof out - 1;
        out[n - 1] = '\n';
    }
    for (ssize_t done = 0, w; done < n; done += w)
        if ((w = write(l->fd, out + done, (size_t)(n - done))) <= 0)
            break;
    pthread_mutex_unlock(&l->lock);
}
