/* `kvmatch hash`: read decimal token ids from stdin (separated by spaces, commas or newlines), print
 * one line per full block: <block index> <local hash, 16 hex> <chain hash, 16 hex>. Input is read
 * incrementally: memory grows only with the tokens of the current block. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "kvmatch/kvmatch.h"

/* Largest block size accepted on the command line (tokens). */
#define HASH_CMD_MAX_BLOCK_SIZE (1u << 20)
/* Longest token literal accepted (digits); anything longer is over 2^32-1 anyway. */
#define HASH_CMD_MAX_DIGITS 32

static int parse_block_size(const char *s, uint32_t *out)
{
    if (!s || !*s)
        return -1;
    for (const char *p = s; *p; p++)
        if (!isdigit((unsigned char)*p))
            return -1;
    errno = 0;
    unsigned long long v = strtoull(s, NULL, 10);
    if (errno || v == 0 || v > HASH_CMD_MAX_BLOCK_SIZE)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int is_separator(int c)
{
    return c == ' ' || c == ',' || c == '\n' || c == '\r' || c == '\t';
}

int km_cmd_hash(int argc, char **argv)
{
    km_hash_config cfg = {.block_size = 0};
    const char *block_size_arg = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **target = NULL;
        if (!strcmp(a, "--block-size"))
            target = &block_size_arg;
        else if (!strcmp(a, "--lora"))
            target = &cfg.lora_name;
        else if (!strcmp(a, "--salt"))
            target = &cfg.cache_salt;
        else {
            fprintf(stderr, "kvmatch hash: unknown option '%s'\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvmatch hash: %s needs a value\n", a);
            return 2;
        }
        *target = argv[++i];
    }
    if (!block_size_arg) {
        fprintf(stderr, "kvmatch hash: --block-size N is required\n");
        return 2;
    }
    if (parse_block_size(block_size_arg, &cfg.block_size)) {
        fprintf(stderr, "kvmatch hash: block size must be an integer from 1 to %u, got '%s'\n",
                HASH_CMD_MAX_BLOCK_SIZE, block_size_arg);
        return 2;
    }
    uint32_t *block = malloc((size_t)cfg.block_size * sizeof *block);
    if (!block) {
        fprintf(stderr, "kvmatch hash: out of memory for a block of %u tokens\n", cfg.block_size);
        return 1;
    }
    char digits[HASH_CMD_MAX_DIGITS + 1];
    size_t n_digits = 0, n_in_block = 0;
    uint64_t token_index = 0, block_index = 0, chain = 0;
    int status = 0;
    for (;;) {
        int c = getchar();
        if (c != EOF && !is_separator(c)) {
            if (!isdigit(c)) {
                fprintf(stderr, "kvmatch hash: token %" PRIu64 ": '%c' is not a decimal digit "
                        "(token ids are unsigned integers up to 4294967295)\n", token_index, c);
                status = 1;
                break;
            }
            if (n_digits == HASH_CMD_MAX_DIGITS) {
                fprintf(stderr, "kvmatch hash: token %" PRIu64 ": value is over 4294967295\n",
                        token_index);
                status = 1;
                break;
            }
            digits[n_digits++] = (char)c;
            continue;
        }
        if (n_digits > 0) {
            digits[n_digits] = '\0';
            unsigned long long v = strtoull(digits, NULL, 10);
            if (v > UINT32_MAX) {
                fprintf(stderr, "kvmatch hash: token %" PRIu64 ": value %s is over 4294967295\n",
                        token_index, digits);
                status = 1;
                break;
            }
            block[n_in_block++] = (uint32_t)v;
            n_digits = 0;
            token_index++;
            if (n_in_block == cfg.block_size) {
                uint64_t local;
                size_t n_blocks;
                km_hash_sequence(&cfg, block, n_in_block, block_index, chain, &local, &chain, &n_blocks);
                printf("%" PRIu64 " %016" PRIx64 " %016" PRIx64 "\n", block_index, local, chain);
                block_index++;
                n_in_block = 0;
            }
        }
        if (c == EOF)
            break;
    }
    free(block);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvmatch hash: write error\n");
        return 1;
    }
    return status;
}
