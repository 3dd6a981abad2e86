/* SPDX-License-Identifier: Apache-2.0 */
/* Internal to the records module (src/service/records.c, src/service/record_writer.c): what the
 * formatting and the writer share. */
#ifndef KM_RECORDS_INTERNAL_H
#define KM_RECORDS_INTERNAL_H

#include <stdint.h>
#include <time.h>

static inline int64_t km_record_clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * INT64_C(1000000000) + (int64_t)ts.tv_nsec;
}

#endif
