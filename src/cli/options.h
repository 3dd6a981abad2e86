/* SPDX-License-Identifier: Apache-2.0 */
/* What every subcommand's option parsing shares: the exit statuses, getopt_long set up for a
 * subcommand, and value parsers whose errors name the option, the valid range and what was given.
 *
 * Exit statuses of every `kvmatch` command (man page kvmatch(1), "EXIT STATUS"):
 *   0  success
 *   1  the command ran and failed: could not start (a socket that cannot be bound, a path that
 *      cannot be written), an I/O error, records lost, input with nothing valid in it, a server
 *      that answered with an error
 *   2  usage: an unknown option, a missing or out-of-range value, a bad configuration file (its
 *      syntax, an unknown key, a value the server refuses) */
#ifndef KM_CLI_OPTIONS_H
#define KM_CLI_OPTIONS_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    KM_EXIT_OK = 0,
    KM_EXIT_FAILURE = 1,
    KM_EXIT_USAGE = 2,
};

/* Prepare getopt_long for a subcommand: its messages say "kvmatch <name>: ...", parsing restarts
 * at argv[1]. Call before the getopt_long loop. */
void km_cli_getopt_begin(char **argv, const char *name);

/* "kvmatch <cmd>: try 'kvmatch <cmd> --help'" on stderr after getopt_long reported an unknown
 * option or a missing value; returns KM_EXIT_USAGE. */
int km_cli_usage_error(const char *cmd);

/* An unsigned decimal integer in min..max, the whole of text (no sign, no space). On failure
 * prints "kvmatch <cmd>: --<option> wants an integer in MIN..MAX, got "TEXT"" and returns false. */
bool km_cli_u64(const char *cmd, const char *option, const char *text, uint64_t min, uint64_t max,
                uint64_t *out);
bool km_cli_u32(const char *cmd, const char *option, const char *text, uint32_t min, uint32_t max,
                uint32_t *out);
/* A finite number in min..max, likewise. */
bool km_cli_double(const char *cmd, const char *option, const char *text, double min, double max,
                   double *out);

/* Is text[0 .. len) exactly a finite number (strtod's syntax, nothing before or after it)? Its
 * value in *out. For the parts of a compound value (W:T:D), whose caller names the whole value in
 * its message. */
bool km_cli_parse_double(const char *text, size_t len, double *out);
/* Is text[0 .. len) exactly an unsigned decimal integer of at most max? Its value in *out. */
bool km_cli_parse_u64(const char *text, size_t len, uint64_t max, uint64_t *out);

#endif
