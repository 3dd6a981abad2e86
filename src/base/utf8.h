/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: UTF-8 checks and cleaning shared by the records writer, the service's name validation,
 * the protocol decoder and the analyzer. */
#ifndef KM_UTF8_H
#define KM_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
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

/* The offset of the first byte of s[0..n) that does not begin a well-formed UTF-8 sequence; n
 * when there is none. */
static inline size_t km_utf8_bad_offset(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t k = s[i] < 0x80 ? 1 : km_utf8_sequence(s + i, n - i);
        if (!k)
            return i;
        i += k;
    }
    return n;
}

/* The length of the longest prefix of s of at most max bytes that ends between characters: a cut
 * there never splits a well-formed UTF-8 sequence (an ill-formed byte counts as one character). */
static inline size_t km_utf8_prefix(const char *s, size_t max)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s), i = 0;
    while (i < n) {
        size_t k = p[i] < 0x80 ? 1 : km_utf8_sequence(p + i, n - i);
        if (!k)
            k = 1;
        if (i + k > max)
            break;
        i += k;
    }
    return i;
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

/* The bytes of the maximal subpart of an ill-formed UTF-8 sequence at s (Unicode 3.9, "U+FFFD
 * substitution of maximal subparts"): a lead byte and the continuation bytes that could still have
 * completed it; one byte when the first byte cannot start a sequence. Only called where
 * km_utf8_sequence found no well-formed sequence. */
static inline size_t km_utf8_bad_prefix(const unsigned char *s, size_t left)
{
    unsigned char c = s[0], lo = 0x80, hi = 0xBF;
    size_t n;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4)
        n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else
        return 1;
    size_t i = 1;
    if (i < left && s[i] >= lo && s[i] <= hi)
        for (i++; i < n && i < left && (s[i] & 0xC0) == 0x80; i++)
            ;
    return i;
}

/* Copy s to out (when not NULL) with every ill-formed UTF-8 sequence replaced by U+FFFD, and NUL;
 * returns the bytes that takes, NUL included (at most 3 per input byte, and 1). For text that
 * must be UTF-8 where it goes (JSON) but nothing forced to be: what a router sends as msgpack
 * str, a line cut in the middle of a character. */
static inline size_t km_utf8_clean_copy(char *out, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s), o = 0;
    for (size_t i = 0; i < n;) {
        /* ASCII runs (ids and names, nearly always the whole string) in one copy. */
        size_t run = 0;
        while (i + run < n && p[i + run] < 0x80)
            run++;
        if (run) {
            if (out)
                memcpy(out + o, p + i, run);
            i += run;
            o += run;
            continue;
        }
        size_t k = km_utf8_sequence(p + i, n - i);
        if (k) {
            if (out)
                memcpy(out + o, p + i, k);
            i += k;
            o += k;
        } else {
            if (out)
                memcpy(out + o, "\xef\xbf\xbd", 3);
            i += km_utf8_bad_prefix(p + i, n - i);
            o += 3;
        }
    }
    if (out)
        out[o] = '\0';
    return o + 1;
}

/* km_utf8_clean_copy into a fresh allocation (the caller frees it); NULL without memory. */
static inline char *km_utf8_clean_dup(const char *s)
{
    char *out = malloc(km_utf8_clean_copy(NULL, s));
    if (out)
        km_utf8_clean_copy(out, s);
    return out;
}

#endif
