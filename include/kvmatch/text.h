/* SPDX-License-Identifier: Apache-2.0 */
/* km_text, the growing string that kvmatch's text writers build their output in piece by piece
 * (Prometheus exposition, analysis reports): a base type with no dependency but the error codes. */
#ifndef KVMATCH_TEXT_H
#define KVMATCH_TEXT_H

#include <stdarg.h>
#include <stddef.h>

#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A growing, NUL-terminated string with a size limit and a sticky status: after the first failure
 * (KM_ERR_OUT_OF_MEMORY, or KM_ERR_TOO_LARGE when the text would pass max_bytes) every append is a
 * no-op that returns the same status, so a writer can append many pieces and check once.
 * Zero-initialise or use km_text_init; data is NULL until the first append (km_text_cstr gives ""
 * then); data is malloc'd, so its owner may take it and free() it. Not thread-safe. */
typedef struct km_text {
    char *data;
    size_t length;    /* bytes in data, the NUL excluded */
    size_t capacity;  /* bytes allocated */
    size_t max_bytes; /* longest text allowed; 0 = KM_TEXT_DEFAULT_MAX_BYTES */
    int status;       /* KM_OK, or the first failure */
} km_text;

#define KM_TEXT_DEFAULT_MAX_BYTES ((size_t)64 << 20)

void km_text_init(km_text *text, size_t max_bytes);
void km_text_free(km_text *text); /* frees data and resets to empty (keeps max_bytes) */
/* Back to empty, status KM_OK, keeping the allocation. */
void km_text_clear(km_text *text);
/* The text, never NULL. */
const char *km_text_cstr(const km_text *text);
/* Appends; return text->status (KM_OK, KM_ERR_OUT_OF_MEMORY, KM_ERR_TOO_LARGE). */
int km_text_append(km_text *text, const char *bytes, size_t length);
int km_text_append_cstr(km_text *text, const char *s);
#if defined(__GNUC__)
#define KM_TEXT_PRINTF_CHECK __attribute__((format(printf, 2, 3)))
#else
#define KM_TEXT_PRINTF_CHECK
#endif
int km_text_printf(km_text *text, const char *format, ...) KM_TEXT_PRINTF_CHECK;
int km_text_vprintf(km_text *text, const char *format, va_list ap);

#ifdef __cplusplus
}
#endif
#endif
