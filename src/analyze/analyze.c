/* SPDX-License-Identifier: Apache-2.0 */
/* The analysis handle (src/analyze/analyze.h, docs/ANALYZE.md): lifecycle, last error, the
 * problem lists, and the interned strings every part of the analysis names things by. Reading and
 * joining the records is join.c, the metrics metrics.c, the reports render_text.c, render_json.c
 * and render_html.c. */
#include "analyze/analyze_internal.h"
#include "base/utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

/* ---- interned byte strings ------------------------------------------------------------------- */

static void intern_init(intern_table *t, km_memory *memory)
{
    memset(t, 0, sizeof *t);
    km_u64map_init(&t->map, memory);
}

static void intern_free(intern_table *t)
{
    for (size_t i = 0; i < t->n; i++)
        free(t->items[i]);
    free(t->items);
    free(t->lengths);
    km_u64map_free(&t->map);
}

/* The id of bytes[0..len), adding it when new. NONE on out of memory. */
uint32_t km_analysis_intern(intern_table *t, const void *bytes, size_t len)
{
    for (uint64_t seed = 0;; seed++) {
        uint64_t key = km_u64map_key(XXH3_64bits_withSeed(bytes, len, seed));
        uint64_t *found = km_u64map_find(&t->map, key);
        if (found) {
            uint32_t id = (uint32_t)*found;
            if (t->lengths[id] == len && !memcmp(t->items[id], bytes, len))
                return id;
            continue; /* another string under this hash: try the next seed */
        }
        if (t->n >= NONE - 1)
            return NONE;
        if (t->n == t->capacity) {
            size_t capacity = t->capacity ? t->capacity * 2 : 64;
            char **items = realloc(t->items, capacity * sizeof *items);
            if (!items)
                return NONE;
            t->items = items;
            size_t *lengths = realloc(t->lengths, capacity * sizeof *lengths);
            if (!lengths)
                return NONE;
            t->lengths = lengths;
            t->capacity = capacity;
        }
        char *copy = malloc(len + 1);
        if (!copy)
            return NONE;
        memcpy(copy, bytes, len);
        copy[len] = '\0';
        if (km_u64map_put(&t->map, key, t->n, 1) != KM_OK) {
            free(copy);
            return NONE;
        }
        t->items[t->n] = copy;
        t->lengths[t->n] = len;
        return (uint32_t)t->n++;
    }
}

uint32_t km_analysis_intern_cstr(intern_table *t, const char *s)
{
    return km_analysis_intern(t, s ? s : "", s ? strlen(s) : 0);
}

/* ---- strings as the reports show them -------------------------------------------------------- */

size_t km_analysis_substitute(const char *s, char substitute[8])
{
    const unsigned char *p = (const unsigned char *)s;
    if (p[0] < 0x20 || p[0] == 0x7F) {
        snprintf(substitute, 8, "\\x%02x", p[0]);
        return 1;
    }
    /* U+FFFE, U+FFFF: EF BF BE, EF BF BF */
    if (p[0] == 0xEF && p[1] == 0xBF && (p[2] == 0xBE || p[2] == 0xBF)) {
        snprintf(substitute, 8, "\\uFFF%c", p[2] == 0xBE ? 'E' : 'F');
        return 3;
    }
    return 0;
}

void km_analysis_append_shown(km_text *out, const char *s)
{
    const char *run = s;
    char substitute[8];
    while (*s) {
        size_t n = km_analysis_substitute(s, substitute);
        if (!n) {
            s++;
            continue;
        }
        km_text_append(out, run, (size_t)(s - run));
        km_text_append_cstr(out, substitute);
        s += n;
        run = s;
    }
    km_text_append(out, run, (size_t)(s - run));
}

/* ---- errors ---------------------------------------------------------------------------------- */

void km_analysis_set_error(km_analysis *a, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    vsnprintf(a->last_error, sizeof a->last_error, format, ap);
    va_end(ap);
}

int km_analysis_fail_memory(km_analysis *a, const char *where)
{
    a->broken = 1;
    km_analysis_set_error(a, "out of memory while %s", where);
    return KM_ERR_OUT_OF_MEMORY;
}

const char *km_analysis_last_error(const km_analysis *analysis)
{
    return analysis ? analysis->last_error : "";
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

int km_analysis_create(const km_analysis_config *cfg, km_analysis **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_analysis *a = calloc(1, sizeof *a);
    if (!a)
        return KM_ERR_OUT_OF_MEMORY;
    if (cfg)
        a->cfg = *cfg;
    if (!a->cfg.max_line_bytes)
        a->cfg.max_line_bytes = KM_ANALYSIS_DEFAULT_MAX_LINE;
    if (!a->cfg.max_listed)
        a->cfg.max_listed = KM_ANALYSIS_DEFAULT_MAX_LISTED;
    if (!a->cfg.chart_buckets)
        a->cfg.chart_buckets = KM_ANALYSIS_DEFAULT_BUCKETS;
    intern_init(&a->strings, &a->memory);
    intern_init(&a->worker_keys, &a->memory);
    km_u64map_init(&a->by_decision, &a->memory);
    km_u64map_init(&a->pending, &a->memory);
    a->live_state = km_analysis_intern_cstr(&a->strings, "LIVE");
    a->approx_state = km_analysis_intern_cstr(&a->strings, "APPROX");
    if (a->live_state == NONE || a->approx_state == NONE) {
        km_analysis_destroy(a);
        return KM_ERR_OUT_OF_MEMORY;
    }
    *out = a;
    return KM_OK;
}

/* Free every decision's kept candidates (those never joined with an outcome). */
void km_analysis_pending_free(km_analysis *a)
{
    uint64_t cursor = 0;
    for (km_u64map_entry *e; (e = km_u64map_next(&a->pending, &cursor));)
        free((void *)(uintptr_t)e->value);
    km_u64map_free(&a->pending); /* leaves it empty and usable */
}

static void problems_free(problem_list *list)
{
    for (size_t i = 0; i < list->n; i++)
        free((char *)list->items[i].what);
    free(list->items);
}

void km_analysis_destroy(km_analysis *a)
{
    if (!a)
        return;
    intern_free(&a->strings);
    intern_free(&a->worker_keys);
    free(a->workers);
    free(a->points);
    km_u64map_free(&a->by_decision);
    km_analysis_pending_free(a);
    free(a->observations);
    problems_free(&a->invalid);
    problems_free(&a->unjoined_decisions);
    problems_free(&a->unjoined_outcomes);
    free(a->windows);
    free(a->policies);
    free(a->worker_stats);
    free(a->reasons);
    free(a->time_order);
    free(a);
}

/* Keep a problem when fewer than max_listed are kept. */
int km_analysis_add_problem(km_analysis *a, problem_list *list, uint32_t file, uint64_t line,
                                   const char *format, ...)
{
    if (list->n >= a->cfg.max_listed)
        return KM_OK;
    if (!list->items) {
        list->items = calloc(a->cfg.max_listed, sizeof *list->items);
        if (!list->items)
            return km_analysis_fail_memory(a, "listing a problem");
    }
    char buffer[512];
    va_list ap;
    va_start(ap, format);
    vsnprintf(buffer, sizeof buffer, format, ap);
    va_end(ap);
    /* The text may hold a cut character (a field quoted from a record, a file name): the JSON
     * report can only carry UTF-8. */
    char *what = km_utf8_clean_dup(buffer);
    if (!what)
        return km_analysis_fail_memory(a, "listing a problem");
    list->items[list->n++] = (km_analysis_problem){.file = str(a, file), .line = line, .what = what};
    return KM_OK;
}
