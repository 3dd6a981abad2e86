/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: the error-with-detail helpers. km_why is for functions that have no handle to keep a
 * last_error in (constructors, configuration readers): it writes the sentence into the caller's
 * buffer (which may be NULL) and returns the status. km_vstatus_message is the shared body of every
 * handle's *_fail: "KM_ERR_NAME: detail" into a last_error buffer. */
#ifndef KM_WHY_H
#define KM_WHY_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kvmatch/error.h"

static inline int km_why(char *why, size_t why_size, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int km_why(char *why, size_t why_size, int status, const char *fmt, ...)
{
    if (why && why_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, why_size, fmt, ap);
        va_end(ap);
    }
    return status;
}

/* A message less the leading "KM_ERR_NAME: " of `status` that km_vstatus_message (or a server's
 * decoder) put before it: what a sentence that names the status already passes on, so the name
 * is not said twice. */
static inline const char *km_error_detail(const char *message, int status)
{
    const char *name = km_error_name(status);
    size_t n = strlen(name);
    if (strncmp(message, name, n) == 0 && message[n] == ':' && message[n + 1] == ' ')
        return message + n + 2;
    return message;
}

/* "KM_ERR_NAME: " and the formatted detail into buf (NULL or size 0: nothing), cut to fit. */
static inline void km_vstatus_message(char *buf, size_t size, int status, const char *fmt, va_list ap)
{
    if (!buf || !size)
        return;
    int n = snprintf(buf, size, "%s: ", km_error_name(status));
    if (n > 0 && (size_t)n < size)
        vsnprintf(buf + n, size - (size_t)n, fmt, ap);
}

#endif
