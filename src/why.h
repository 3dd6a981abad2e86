/* Internal: the error-with-detail helper of functions that have no handle to keep a last_error in
 * (constructors, configuration readers): write the sentence into the caller's buffer (which may be
 * NULL) and return the status. */
#ifndef KM_WHY_H
#define KM_WHY_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

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

#endif
