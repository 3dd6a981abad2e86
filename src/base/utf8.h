/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: UTF-8 checks shared by the records writer and the service's name validation. */
#ifndef KM_UTF8_H
#define KM_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The length of the UTF-8 sequence starting at s (at most `left` bytes), or 0 when it is not
 * well-formed: overlong forms, surrogates and code points past U+10FFFF are not (RFC 3629). */
static inline size_t km_utf8_sequence(const unsigned char *s, size_t left)
{
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    size_t n;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF)
        n = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4)
        n = 4, cp = c & 0x07;
    else
        return 0;
    if (n > left)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return n;
}

/* A name fit for records, /status (JSON) and /metrics (Prometheus label values): well-formed
 * UTF-8 without control characters (U+0000..U+001F, U+007F). */
static inline bool km_utf8_name(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        if (p[i] < 0x20 || p[i] == 0x7F)
            return false;
        size_t k = km_utf8_sequence(p + i, n - i);
        if (!k)
            return false;
        i += k;
    }
    return true;
}

#endif
