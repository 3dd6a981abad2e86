/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch hash`: read decimal token ids from stdin (separated by spaces, commas or newlines), print
 * one line per full block: <block index> <local hash, 16 hex> <chain hash, 16 hex>; under lookahead
 * hashing (--lookahead L) a block is printed once the L tokens after it have been read. Input is
 * read incrementally: memory holds only the current block and its lookahead tokens. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"

/* Largest block size accepted on the command line (tokens). */
#define HASH_CMD_MAX_BLOCK_SIZE (1u << 20)
/* Longest token literal accepted (digits); anything longer is over 2^32-1 anyway. */
#define HASH_CMD_MAX_DIGITS 32

static void hash_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch hash --block-size N [--lora NAME] [--salt S] [--lookahead L] < token ids\n"
            "  Chain-hash decimal token ids (separated by spaces, commas or newlines) as kvmatch\n"
            "  does (docs/HASHING.md); one line per full block: index, local hash, chain hash.\n"
            "  --block-size N  tokens per block, 1..%u (required)\n"
            "  --lora NAME     the LoRA adapter the tokens are for (changes every hash)\n"
            "  --salt S        the cache salt (changes every hash)\n"
            "  --lookahead L   each block's hash also covers the L tokens after it, 0..%u (the\n"
            "                  engines' lookahead hashing with EAGLE / MTP; default 0)\n"
            "  Exit status: 0 ok, 1 bad input or a write error, 2 usage.\n",
            HASH_CMD_MAX_BLOCK_SIZE, KM_HASH_MAX_LOOKAHEAD);
}

static int is_separator(int c)
{
    return c == ' ' || c == ',' || c == '\n' || c == '\r' || c == '\t';
}

int km_cmd_hash(int argc, char **argv)
{
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"block-size", required_argument, NULL, 'b'},
        {"lora", required_argument, NULL, 'l'},
        {"salt", required_argument, NULL, 's'},
        {"lookahead", required_argument, NULL, 'a'},
        {NULL, 0, NULL, 0},
    };
    km_hash_config cfg = {.block_size = 0};
    uint32_t lookahead = 0;
    km_cli_getopt_begin(argv, "hash");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            hash_usage(stdout);
            return KM_EXIT_OK;
        case 'b':
            if (!km_cli_u32("hash", "block-size", optarg, 1, HASH_CMD_MAX_BLOCK_SIZE,
                            &cfg.block_size))
                return KM_EXIT_USAGE;
            break;
        case 'l':
            cfg.lora_name = optarg;
            break;
        case 's':
            cfg.cache_salt = optarg;
            break;
        case 'a':
            if (!km_cli_u32("hash", "lookahead", optarg, 0, KM_HASH_MAX_LOOKAHEAD, &lookahead))
                return KM_EXIT_USAGE;
            break;
        default:
            return km_cli_usage_error("hash");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch hash: unexpected argument \"%s\" (token ids come on stdin)\n",
                argv[optind]);
        return km_cli_usage_error("hash");
    }
    if (!cfg.block_size) {
        fprintf(stderr, "kvmatch hash: --block-size N is required\n");
        return km_cli_usage_error("hash");
    }
    /* The current block followed by its lookahead tokens. */
    size_t window = (size_t)cfg.block_size + lookahead;
    uint32_t *block = malloc(window * sizeof *block);
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
            if (n_in_block == window) {
                uint64_t local;
                size_t n_blocks;
                km_hash_sequence_lookahead(&cfg, lookahead, block, n_in_block, block_index, chain,
                                           &local, &chain, &n_blocks);
                printf("%" PRIu64 " %016" PRIx64 " %016" PRIx64 "\n", block_index, local, chain);
                block_index++;
                /* The lookahead tokens start the next block. */
                memmove(block, block + cfg.block_size, (size_t)lookahead * sizeof *block);
                n_in_block = lookahead;
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
