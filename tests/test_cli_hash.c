/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch hash`: reads token ids from stdin (separated by spaces, commas or newlines) and prints
 * one line per full block, `<block index> <local hash, 16 hex> <chain hash, 16 hex>`, equal to the
 * library's hashing. Bad input exits non-zero with a message on stderr that names the problem.
 * The binary is $KM_BIN, else build/kvmatch relative to the repository root (where `make test`
 * runs the suite). Each run is bounded by a timeout. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#define CLI_TIMEOUT_S 20.0

typedef struct cli_result {
    int exited;     /* 1 if it exited normally */
    int status;     /* exit status */
    int timed_out;
    char *out, *err;
    size_t out_len, err_len;
} cli_result;

static const char *cli_binary(void)
{
    const char *b = getenv("KM_BIN");
    return b && *b ? b : "build/kvmatch";
}

static void append(char **buf, size_t *len, const char *data, size_t n)
{
    *buf = realloc(*buf, *len + n + 1);
    cr_assert(*buf);
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = 0;
}

/* Run `kvmatch hash ARGS...` with `input` on stdin. args is NULL-terminated. */
static void run_hash(const char *const *args, const char *input, cli_result *res)
{
    memset(res, 0, sizeof *res);
    const char *bin = cli_binary();
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (build it with make; or set KM_BIN)",
              bin);
    const char *argv[32];
    int argc = 0;
    argv[argc++] = bin;
    argv[argc++] = "hash";
    for (int i = 0; args && args[i]; i++) {
        cr_assert(argc < 31);
        argv[argc++] = args[i];
    }
    argv[argc] = NULL;

    int in[2], out[2], err[2];
    cr_assert(pipe(in) == 0 && pipe(out) == 0 && pipe(err) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        dup2(err[1], 2);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]), close(err[0]), close(err[1]);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(in[0]), close(out[1]), close(err[1]);
    signal(SIGPIPE, SIG_IGN); /* the child may exit before reading all its input */
    fcntl(in[1], F_SETFL, O_NONBLOCK);
    size_t in_len = input ? strlen(input) : 0, in_off = 0;
    if (in_len == 0)
        close(in[1]), in[1] = -1;
    append(&res->out, &res->out_len, "", 0);
    append(&res->err, &res->err_len, "", 0);

    double deadline = km_test_now() + CLI_TIMEOUT_S;
    int open_out = 1, open_err = 1;
    while (open_out || open_err) {
        struct pollfd p[3];
        int np = 0, io = -1, iout = -1, ierr = -1;
        if (in[1] >= 0)
            io = np, p[np++] = (struct pollfd){in[1], POLLOUT, 0};
        if (open_out)
            iout = np, p[np++] = (struct pollfd){out[0], POLLIN, 0};
        if (open_err)
            ierr = np, p[np++] = (struct pollfd){err[0], POLLIN, 0};
        double left = deadline - km_test_now();
        if (left <= 0) {
            res->timed_out = 1;
            break;
        }
        int rc = poll(p, (nfds_t)np, (int)(left * 1000) + 1);
        if (rc < 0 && errno == EINTR)
            continue;
        cr_assert(rc >= 0, "poll: %s", strerror(errno));
        char buf[65536];
        if (io >= 0 && (p[io].revents & (POLLOUT | POLLERR | POLLHUP))) {
            ssize_t w = write(in[1], input + in_off, in_len - in_off);
            if (w > 0)
                in_off += (size_t)w;
            if (w < 0 && errno != EAGAIN)
                in_off = in_len; /* EPIPE: the child stopped reading */
            if (in_off == in_len)
                close(in[1]), in[1] = -1;
        }
        if (iout >= 0 && (p[iout].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = read(out[0], buf, sizeof buf);
            if (r > 0)
                append(&res->out, &res->out_len, buf, (size_t)r);
            else if (r == 0 || errno != EINTR)
                open_out = 0;
        }
        if (ierr >= 0 && (p[ierr].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = read(err[0], buf, sizeof buf);
            if (r > 0)
                append(&res->err, &res->err_len, buf, (size_t)r);
            else if (r == 0 || errno != EINTR)
                open_err = 0;
        }
    }
    if (in[1] >= 0)
        close(in[1]);
    close(out[0]), close(err[0]);
    if (res->timed_out)
        kill(pid, SIGKILL);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    res->exited = WIFEXITED(st);
    res->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    cr_assert(!res->timed_out, "kvmatch hash did not finish within %.0f s", CLI_TIMEOUT_S);
    cr_assert(!(res->exited && res->status == 127), "could not execute %s", bin);
}

static void free_result(cli_result *res)
{
    free(res->out);
    free(res->err);
}

static int is_hex16(const char *s, size_t n)
{
    if (n != 16)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!strchr("0123456789abcdefABCDEF", s[i]))
            return 0;
    return 1;
}

/* Check stdout against the library's hashes of tokens under cfg. */
static void expect_hash_output_lookahead(const cli_result *res, const km_hash_config *cfg,
                                         uint32_t lookahead, const uint32_t *tokens,
                                         size_t n_tokens, const char *what)
{
    cr_assert(res->exited && res->status == 0, "%s: exit status %d, stderr: %s", what, res->status,
              res->err);
    size_t nb = n_tokens < lookahead ? 0 : (n_tokens - lookahead) / cfg->block_size, got_n;
    uint64_t *local = calloc(nb + 1, sizeof *local), *chain = calloc(nb + 1, sizeof *chain);
    cr_assert_eq(km_hash_sequence_lookahead(cfg, lookahead, tokens, n_tokens, 0, KM_NO_PARENT,
                                            local, chain, &got_n),
                 KM_OK);
    cr_assert_eq(got_n, nb);
    char *copy = strdup(res->out), *save = NULL;
    size_t line_no = 0;
    for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char idx[32], l[64], c[64], extra[8];
        int fields = sscanf(line, "%31s %63s %63s %7s", idx, l, c, extra);
        cr_assert_eq(fields, 3, "%s: line %zu is not '<index> <local> <chain>': '%s'", what,
                     line_no, line);
        cr_assert(line_no < nb, "%s: more than %zu lines (a partial tail must not be printed)",
                  what, nb);
        cr_assert_eq(strtoull(idx, NULL, 10), line_no, "%s: line %zu has index %s", what, line_no,
                     idx);
        cr_assert(is_hex16(l, strlen(l)) && is_hex16(c, strlen(c)),
                  "%s: hashes must be 16 hex digits: '%s'", what, line);
        cr_assert_eq(strtoull(l, NULL, 16), local[line_no],
                     "%s: block %zu local %s, expected %016llx", what, line_no, l,
                     (unsigned long long)local[line_no]);
        cr_assert_eq(strtoull(c, NULL, 16), chain[line_no],
                     "%s: block %zu chain %s, expected %016llx", what, line_no, c,
                     (unsigned long long)chain[line_no]);
        line_no++;
    }
    cr_assert_eq(line_no, nb, "%s: %zu lines, expected %zu blocks", what, line_no, nb);
    free(copy);
    free(local);
    free(chain);
}

static void expect_hash_output(const cli_result *res, const km_hash_config *cfg,
                               const uint32_t *tokens, size_t n_tokens, const char *what)
{
    expect_hash_output_lookahead(res, cfg, 0, tokens, n_tokens, what);
}

/* Format tokens with separators drawn from `seps` (each a separator string). */
static char *format_tokens(km_rng *r, const uint32_t *tokens, size_t n, const char *const *seps,
                           size_t n_seps)
{
    size_t cap = n * 16 + 16, len = 0;
    char *s = malloc(cap);
    cr_assert(s);
    for (size_t i = 0; i < n; i++) {
        if (i > 0) {
            const char *sep = seps[km_rng_below(r, (uint32_t)n_seps)];
            len += (size_t)snprintf(s + len, cap - len, "%s", sep);
        }
        len += (size_t)snprintf(s + len, cap - len, "%u", tokens[i]);
    }
    if (n > 0 && km_rng_percent(r, 50))
        len += (size_t)snprintf(s + len, cap - len, "\n");
    s[len] = 0;
    return s;
}

Test(cli_hash, matches_library_with_any_separators, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const char *const seps[] = {" ", ",", "\n", ", ", "  ", " \n", ",\n"};
    const uint32_t sizes[] = {1, 4, 7, 16};
    const char *loras[] = {NULL, "my-lora"}, *salts[] = {NULL, "salt 1"};
    for (int round = 0; round < 16; round++) {
        uint32_t bs = sizes[round % 4];
        km_hash_config cfg = {bs, loras[(round / 4) & 1], salts[(round / 8) & 1]};
        size_t n = km_rng_below(&r, bs * 40 + 3) + 1;
        uint32_t *tokens = malloc(n * sizeof *tokens);
        for (size_t i = 0; i < n; i++)
            tokens[i] = km_rng_percent(&r, 5) ? UINT32_MAX
                        : km_rng_percent(&r, 5) ? 0 : (uint32_t)km_rng_next(&r);
        /* Rounds 0-3 use one separator kind each, the rest mix them. */
        const char *const *use = round < 3 ? &seps[round] : seps;
        size_t n_use = round < 3 ? 1 : sizeof seps / sizeof seps[0];
        char *input = format_tokens(&r, tokens, n, use, n_use);
        char bs_text[16];
        snprintf(bs_text, sizeof bs_text, "%u", bs);
        const char *args[8] = {"--block-size", bs_text};
        int a = 2;
        if (cfg.lora_name)
            args[a++] = "--lora", args[a++] = cfg.lora_name;
        if (cfg.cache_salt)
            args[a++] = "--salt", args[a++] = cfg.cache_salt;
        args[a] = NULL;
        cli_result res;
        run_hash(args, input, &res);
        char what[128];
        snprintf(what, sizeof what, "[KM_TEST_SEED=%llu] round %d (bs %u, %zu tokens)",
                 (unsigned long long)km_test_seed(), round, bs, n);
        expect_hash_output(&res, &cfg, tokens, n, what);
        free_result(&res);
        free(input);
        free(tokens);
    }
}

Test(cli_hash, partial_tail_and_empty_input, .timeout = 30)
{
    const uint32_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    km_hash_config cfg = {4, NULL, NULL};
    cli_result res;
    run_hash((const char *[]){"--block-size", "4", NULL}, "1 2 3 4 5 6 7 8 9 10\n", &res);
    expect_hash_output(&res, &cfg, tokens, 10, "10 tokens, block size 4");
    free_result(&res);

    run_hash((const char *[]){"--block-size", "4", NULL}, "1,2,3", &res);
    cr_assert(res.exited && res.status == 0, "partial block only: status %d (%s)", res.status,
              res.err);
    cr_assert_eq(res.out_len, 0, "partial block only printed: %s", res.out);
    free_result(&res);

    run_hash((const char *[]){"--block-size", "16", NULL}, "", &res);
    cr_assert(res.exited && res.status == 0, "empty input: status %d (%s)", res.status, res.err);
    cr_assert_eq(res.out_len, 0, "empty input printed: %s", res.out);
    free_result(&res);

    /* The largest token value is accepted. */
    const uint32_t max_tokens[] = {UINT32_MAX, UINT32_MAX};
    km_hash_config cfg1 = {1, NULL, NULL};
    run_hash((const char *[]){"--block-size", "1", NULL}, "4294967295\n4294967295", &res);
    expect_hash_output(&res, &cfg1, max_tokens, 2, "max u32 tokens");
    free_result(&res);
}

/* --lookahead L: each printed block also covers the L tokens after it and is printed only once
 * they have been read, equal to km_hash_sequence_lookahead for random inputs, with LoRA and salt
 * too; --lookahead 0 is plain hashing. */
Test(cli_hash, lookahead_matches_library, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const char *const seps[] = {" ", ",", "\n"};
    const uint32_t sizes[] = {1, 4, 7}, lookaheads[] = {0, 1, 2, 5, 9};
    for (int round = 0; round < 15; round++) {
        uint32_t bs = sizes[round % 3], la = lookaheads[round % 5];
        km_hash_config cfg = {bs, round & 4 ? "my-lora" : NULL, round & 8 ? "salt 1" : NULL};
        size_t n = km_rng_below(&r, bs * 12 + la + 3);
        uint32_t *tokens = malloc((n + 1) * sizeof *tokens);
        for (size_t i = 0; i < n; i++)
            tokens[i] = (uint32_t)km_rng_next(&r);
        char *input = format_tokens(&r, tokens, n, seps, 3);
        char bs_text[16], la_text[16];
        snprintf(bs_text, sizeof bs_text, "%u", bs);
        snprintf(la_text, sizeof la_text, "%u", la);
        const char *args[10] = {"--block-size", bs_text, "--lookahead", la_text};
        int a = 4;
        if (cfg.lora_name)
            args[a++] = "--lora", args[a++] = cfg.lora_name;
        if (cfg.cache_salt)
            args[a++] = "--salt", args[a++] = cfg.cache_salt;
        args[a] = NULL;
        cli_result res;
        run_hash(args, input, &res);
        char what[128];
        snprintf(what, sizeof what, "[KM_TEST_SEED=%llu] round %d (bs %u, L %u, %zu tokens)",
                 (unsigned long long)km_test_seed(), round, bs, la, n);
        expect_hash_output_lookahead(&res, &cfg, la, tokens, n, what);
        free_result(&res);
        free(input);
        free(tokens);
    }
}

/* Expect failure with a message on stderr that names the problem: it contains one of the
 * NULL-terminated `needles` (case-insensitive): the offending text, or the offending character
 * quoted, or the option's name. */
static void expect_failure(const char *const *args, const char *input, const char *const *needles,
                           const char *what)
{
    cli_result res;
    run_hash(args, input, &res);
    cr_assert(!(res.exited && res.status == 0), "%s: exit status 0, expected failure (stdout: %s)",
              what, res.out);
    cr_assert(res.exited, "%s: killed by a signal (%d) instead of a clean error exit", what,
              res.status - 128);
    cr_assert(res.err_len > 0, "%s: nothing on stderr", what);
    int named = 0;
    for (size_t i = 0; needles[i]; i++)
        named |= strcasestr(res.err, needles[i]) != NULL;
    cr_assert(named, "%s: stderr does not name the problem (e.g. '%s'): %s", what, needles[0],
              res.err);
    free_result(&res);
}

#define NEEDLES(...) ((const char *const[]){__VA_ARGS__, NULL})

Test(cli_hash, bad_input_is_rejected_with_a_message, .timeout = 60)
{
    const char *bs16[] = {"--block-size", "16", NULL};
    expect_failure(bs16, "1 2 abc 4\n", NEEDLES("abc", "'a'"), "non-number token");
    expect_failure(bs16, "1 2 12x 4\n", NEEDLES("12x", "'x'"), "number with trailing garbage");
    expect_failure(bs16, "1 4294967296 3", NEEDLES("4294967296"), "token over u32");
    expect_failure(bs16, "1 99999999999999999999999 3", NEEDLES("99999999999999999999999", "over"),
                   "token overflowing u64");
    expect_failure(bs16, "1 -5 3", NEEDLES("-5", "'-'", "negative"), "negative token");
    expect_failure((const char *[]){"--block-size", "0", NULL}, "1 2 3", NEEDLES("block"),
                   "block size 0");
    expect_failure((const char *[]){"--block-size", "abc", NULL}, "1 2 3", NEEDLES("abc"),
                   "block size not a number");
    expect_failure((const char *[]){"--block-size", NULL}, "1 2 3", NEEDLES("block-size"),
                   "--block-size without a value");
    expect_failure((const char *[]){"--block-size", "4", "--lora", NULL}, "1 2 3 4",
                   NEEDLES("lora"), "--lora without a value");
    expect_failure((const char *[]){"--block-size", "4", "--salt", NULL}, "1 2 3 4",
                   NEEDLES("salt"), "--salt without a value");
    expect_failure((const char *[]){"--block-size", "4", "--bogus", NULL}, "1 2 3 4",
                   NEEDLES("bogus"), "unknown option");
    expect_failure((const char *[]){NULL}, "1 2 3 4", NEEDLES("block-size", "block size"),
                   "no --block-size");
    expect_failure((const char *[]){"--block-size", "1048577", NULL}, "1 2 3 4",
                   NEEDLES("1048577"), "block size over 2^20");
    expect_failure((const char *[]){"--block-size", "4", "--lookahead", "1025", NULL}, "1 2 3 4",
                   NEEDLES("1025"), "lookahead over 1024");
    expect_failure((const char *[]){"--block-size", "4", "--lookahead", "x", NULL}, "1 2 3 4",
                   NEEDLES("\"x\"", "lookahead"), "lookahead not a number");
    expect_failure((const char *[]){"--block-size", "4", "--lookahead", NULL}, "1 2 3 4",
                   NEEDLES("lookahead"), "--lookahead without a value");
}

/* The examples printed in docs/HASHING.md, byte for byte. */
Test(cli_hash, documented_examples, .timeout = 30)
{
    static const struct {
        const char *args[8];
        const char *input, *output;
    } examples[] = {
        {{"--block-size", "4", NULL}, "1 2 3 4 5 6 7 8",
         "0 cb38e4d7fb2dca5c cb38e4d7fb2dca5c\n1 e8d3ec39b907b74c 44a2b2379d6d3c3d\n"},
        {{"--block-size", "4", "--lora", "sql-adapter", NULL}, "1 2 3 4 5 6 7 8",
         "0 2671cf3992bf3d92 2671cf3992bf3d92\n1 d686ef7061622a1d 0058bb352dd9c756\n"},
        {{"--block-size", "4", "--salt", "tenant-42", NULL}, "1,2,3,4,5,6,7,8\n",
         "0 a0dd2602b05d6f92 a0dd2602b05d6f92\n1 e8d3ec39b907b74c 6804a61aadeb6455\n"},
        {{"--block-size", "2", NULL}, "4294967295\n0\n7\n7\n7\n",
         "0 281d4ec618d46521 281d4ec618d46521\n1 1a095246526a89ec 03a0e2019fae48c0\n"},
        {{"--block-size", "4", "--lookahead", "1", NULL}, "1 2 3 4 5 6 7 8 9",
         "0 1a92ffa9004c0851 1a92ffa9004c0851\n1 1ac55a72d61806e3 b64e31be06d3e9dd\n"},
        {{"--block-size", "4", "--lookahead", "2", NULL}, "1 2 3 4 5 6 7 8 9 10",
         "0 e53e9f562d4d0eda e53e9f562d4d0eda\n1 38fbdb9103e14577 8bc30087951001ac\n"},
    };
    for (size_t i = 0; i < sizeof examples / sizeof examples[0]; i++) {
        cli_result res;
        run_hash(examples[i].args, examples[i].input, &res);
        cr_assert(res.exited && res.status == 0, "example %zu: status %d (%s)", i, res.status,
                  res.err);
        cr_assert_str_eq(res.out, examples[i].output, "example %zu", i);
        free_result(&res);
    }
}
