/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_kv_events into the directory given as argv[1], from the fixtures
 * in tests/kv_events_vectors (run from the repository root): every *.msgpack payload with mode
 * byte 0 (payload) and 4 (tight limits), every *.frames message with mode 1 (SUB) and 2 (replay).
 * Among them v0.33_offload_placeholders*.msgpack: vLLM's OffloadingConnector placeholder stores
 * (block_size 0) on CPU and STORAGE, the same shape on the GPU and with a parent (rejected), and a
 * placeholder removal. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FIXTURE_DIR "tests/kv_events_vectors"

static int copy_with_mode(const char *dir, const char *name, unsigned char mode)
{
    char in[4096], out[4096];
    snprintf(in, sizeof in, "%s/%s", FIXTURE_DIR, name);
    snprintf(out, sizeof out, "%s/%u-%s", dir, mode, name);
    FILE *f = fopen(in, "rb");
    if (!f) {
        perror(in);
        return 1;
    }
    FILE *g = fopen(out, "wb");
    if (!g) {
        perror(out);
        fclose(f);
        return 1;
    }
    fputc(mode, g);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        fwrite(buf, 1, n, g);
    fclose(f);
    return fclose(g) != 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    DIR *d = opendir(FIXTURE_DIR);
    if (!d) {
        perror(FIXTURE_DIR);
        return 1;
    }
    int bad = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n > 8 && strcmp(e->d_name + n - 8, ".msgpack") == 0)
            bad |= copy_with_mode(argv[1], e->d_name, 0) | copy_with_mode(argv[1], e->d_name, 4);
        else if (n > 7 && strcmp(e->d_name + n - 7, ".frames") == 0)
            bad |= copy_with_mode(argv[1], e->d_name, 1) | copy_with_mode(argv[1], e->d_name, 2);
    }
    closedir(d);
    return bad;
}
