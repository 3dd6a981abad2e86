/* SPDX-License-Identifier: Apache-2.0 */
/* The level a log line of kvmatch's own states (kvmatch/log.h): its format starts with
 * KM_LOG_ERROR, KM_LOG_WARNING or KM_LOG_INFO. A helper that puts a component before the message
 * ("feed: worker 3 (a): ...") writes those three bytes first, so the line still starts with them;
 * a line written to stderr without a logger leaves them out. */
#ifndef KM_BASE_LOG_LEVEL_H
#define KM_BASE_LOG_LEVEL_H

#include <stddef.h>

/* 3 when text starts with a stated level ("<0>" .. "<7>"), else 0. */
static inline size_t km_log_level_length(const char *text)
{
    return text && text[0] == '<' && text[1] >= '0' && text[1] <= '7' && text[2] == '>' ? 3 : 0;
}

#endif
