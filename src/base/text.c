/* SPDX-License-Identifier: Apache-2.0 */
/* The growing string (contract in include/kvmatch/text.h). */
#include "kvmatch/text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/array.h"

void km_text_init(km_text *text, size_t max_bytes)
{
    if (!text)
        return;
    memset(text, 0, sizeof *text);
    text->max_bytes = max_bytes;
}

void km_text_free(km_text *text)
{
    if (!text)
        return;
    size_t max_bytes = text->max_bytes;
    free(text->data);
    km_text_init(text, max_bytes);
}

void km_text_clear(km_text *text)
{
    if (!text)
        return;
    text->length = 0;
    text->status = KM_OK;
    if (text->data)
        text->data[0] = '\0';
}

const char *km_text_cstr(const km_text *text)
{
    return text && text->data ? text->data : "";
}

static size_t text_limit(const km_text *text)
{
    return text->max_bytes ? text->max_bytes : KM_TEXT_DEFAULT_MAX_BYTES;
}

/* Make room for `extra` more bytes plus the NUL; sets the sticky status on failure. */
static int text_reserve(km_text *text, size_t extra)
{
    if (text->status != KM_OK)
        return text->status;
    if (extra > text_limit(text) - text->length) {
        text->status = KM_ERR_TOO_LARGE;
        return text->status;
    }
    if (KM_ARRAY_GROW(text->data, text->capacity, text->length + extra + 1, 256))
        text->status = KM_ERR_OUT_OF_MEMORY;
    return text->status;
}

int km_text_append(km_text *text, const char *bytes, size_t length)
{
    if (!text)
        return KM_ERR_NULL_POINTER;
    if (length && !bytes)
        return KM_ERR_NULL_POINTER;
    int rc = text_reserve(text, length);
    if (rc != KM_OK)
        return rc;
    if (length)
        memcpy(text->data + text->length, bytes, length);
    text->length += length;
    text->data[text->length] = '\0';
    return KM_OK;
}

int km_text_append_cstr(km_text *text, const char *s)
{
    if (!s)
        return KM_ERR_NULL_POINTER;
    return km_text_append(text, s, strlen(s));
}

int km_text_vprintf(km_text *text, const char *format, va_list ap)
{
    if (!text || !format)
        return KM_ERR_NULL_POINTER;
    if (text->status != KM_OK)
        return text->status;
    va_list copy;
    va_copy(copy, ap);
    char small[256];
    int n = vsnprintf(small, sizeof small, format, copy);
    va_end(copy);
    if (n < 0) {
        text->status = KM_ERR_INVALID_ARGUMENT;
        return text->status;
    }
    if ((size_t)n < sizeof small)
        return km_text_append(text, small, (size_t)n);
    int rc = text_reserve(text, (size_t)n);
    if (rc != KM_OK)
        return rc;
    vsnprintf(text->data + text->length, (size_t)n + 1, format, ap);
    text->length += (size_t)n;
    return KM_OK;
}

int km_text_printf(km_text *text, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    int rc = km_text_vprintf(text, format, ap);
    va_end(ap);
    return rc;
}
