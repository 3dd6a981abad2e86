/* SPDX-License-Identifier: Apache-2.0 */
/* Option parsing shared by the subcommands (cli/options.h). */
#include "cli/options.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char program[64];

void km_cli_getopt_begin(char **argv, const char *name)
{
    snprintf(program, sizeof program, "kvmatch %s", name);
    argv[0] = program;
    optind = 0; /* glibc: start over, argv[1] first */
    opterr = 1;
}

int km_cli_usage_error(const char *cmd)
{
    fprintf(stderr, "kvmatch %s: try 'kvmatch %s --help'\n", cmd, cmd);
    return KM_EXIT_USAGE;
}

bool km_cli_u64(const char *cmd, const char *option, const char *text, uint64_t min, uint64_t max,
                uint64_t *out)
{
    size_t digits = strspn(text, "0123456789");
    errno = 0;
    unsigned long long v = digits && !text[digits] ? strtoull(text, NULL, 10) : 0;
    if (!digits || text[digits] || errno || v < min || v > max) {
        fprintf(stderr, "kvmatch %s: --%s wants an integer in %" PRIu64 "..%" PRIu64 ", got \"%s\"\n",
                cmd, option, min, max, text);
        return false;
    }
    *out = v;
    return true;
}

bool km_cli_u32(const char *cmd, const char *option, const char *text, uint32_t min, uint32_t max,
                uint32_t *out)
{
    uint64_t v;
    if (!km_cli_u64(cmd, option, text, min, max, &v))
        return false;
    *out = (uint32_t)v;
    return true;
}

bool km_cli_double(const char *cmd, const char *option, const char *text, double min, double max,
                   double *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || errno || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "kvmatch %s: --%s wants a number in %g..%g, got \"%s\"\n", cmd, option, min,
                max, text);
        return false;
    }
    *out = v;
    return true;
}

bool km_cli_parse_double(const char *text, size_t len, double *out)
{
    char buf[64];
    if (len == 0 || len >= sizeof buf)
        return false;
    memcpy(buf, text, len);
    buf[len] = '\0';
    if (isspace((unsigned char)buf[0]))
        return false; /* strtod would skip it */
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    if (end == buf || *end || errno || !isfinite(v))
        return false;
    *out = v;
    return true;
}

bool km_cli_parse_u64(const char *text, size_t len, uint64_t max, uint64_t *out)
{
    char buf[32];
    if (len == 0 || len >= sizeof buf)
        return false;
    memcpy(buf, text, len);
    buf[len] = '\0';
    if (strspn(buf, "0123456789") != len)
        return false;
    errno = 0;
    unsigned long long v = strtoull(buf, NULL, 10);
    if (errno || v > max)
        return false;
    *out = v;
    return true;
}
