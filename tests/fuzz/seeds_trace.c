/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_trace into the directory given as argv[1]: the two requests of the
 * Mooncake release's own format example (UPSTREAM-README.md), and lines near the loader's edges
 * (CRLF, no final newline, blank lines, reals, the largest values, bad fields). */
#include <stdio.h>
#include <string.h>

static const char *const seeds[] = {
    "{\"timestamp\": 27482, \"input_length\": 6955, \"output_length\": 52, \"hash_ids\": [46, 47, "
    "48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}\n{\"timestamp\": 30535, "
    "\"input_length\": 6472, \"output_length\": 26, \"hash_ids\": [46, 47, 48, 49, 50, 51, 52, 53, "
    "54, 55, 56, 57, 2366]}\n",
    "{\"timestamp\": 0, \"input_length\": 20, \"output_length\": 1, \"hash_ids\": [0, 1]}\r\n\r\n"
    "{\"timestamp\": 0, \"input_length\": 20, \"output_length\": 1, \"hash_ids\": [0, 1]}",
    "\n  \n{\"timestamp\": 1.5, \"input_length\": 4294967295, \"output_length\": 4294967295, "
    "\"hash_ids\": [4294967295, 0, 4294967295]}\n",
    "{\"timestamp\": 9007199254740992, \"input_length\": 1, \"output_length\": 0, \"hash_ids\": [7]}\n",
    "{\"timestamp\": 5, \"input_length\": 17, \"output_length\": 2, \"hash_ids\": [3]}\n"
    "{\"timestamp\": 4, \"input_length\": 17, \"output_length\": 2, \"hash_ids\": [3]}\n",
    "{\"timestamp\": 0, \"input_length\": -1, \"output_length\": 1, \"hash_ids\": [1]}\n",
    "{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": []}\n",
    "[1, 2, 3]\n",
    "",
};

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    int bad = 0;
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/seed%zu.jsonl", argv[1], i);
        FILE *f = fopen(path, "wb");
        if (!f) {
            perror(path);
            return 1;
        }
        fwrite(seeds[i], 1, strlen(seeds[i]), f);
        bad |= fclose(f) != 0;
    }
    return bad;
}
