/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_server_config into the directory given as argv[1]: the example of
 * docs/SERVICE.md and a few smaller configurations. */
#include <stdio.h>
#include <string.h>

static const char *const seeds[] = {
    "{\"socket\": \"/run/kvmatch/kvmatch.sock\", \"tcp\": \"127.0.0.1:7700\", \"http\": "
    "\"127.0.0.1:7701\", \"records\": {\"path\": \"/var/log/kvmatch/records.jsonl\", "
    "\"max_file_bytes\": 268435456}, \"snapshot\": {\"dir\": \"/var/lib/kvmatch\", \"interval_ms\": "
    "60000}, \"index\": {\"max_workers\": 1024, \"backend\": \"auto\", \"threads\": 0, "
    "\"memory_cap_bytes\": 0, \"initial_blocks\": 1048576}, \"scheduler\": {\"max_batch_routes\": "
    "512, \"max_queued_routes\": 65536, \"inline_routes\": 16}, \"limits\": {\"max_frame_bytes\": "
    "16777216, \"max_batch_items\": 4096}, \"max_connections\": 1024, \"max_outbox_bytes\": "
    "67108864, \"active_ttl_ms\": 600000, \"max_active_entries\": 1048576, "
    "\"approx_dispatch_max_bytes\": 33554432, \"ready_share\": 0.8, \"drain_timeout_ms\": 10000, "
    "\"default_pool\": \"llama\", \"pools\": [{\"name\": \"llama\", \"model\": "
    "\"meta-llama/Llama-3.1-8B\", \"block_size\": 16, \"policy\": \"kv\", \"params\": "
    "{\"temperature\": 0, \"host_weight\": 0.75}, \"workers\": [{\"id\": 0, \"name\": \"a\", "
    "\"events\": \"tcp://10.0.0.5:5557\", \"replay\": \"tcp://10.0.0.5:5558\"}, {\"id\": 2, "
    "\"name\": \"b\", \"events\": \"tcp://10.0.0.6:5557\", \"dp_size\": 2}]}, {\"name\": "
    "\"small\", \"block_size\": 16, \"policy\": \"cache_aware\", \"approx_ttl_ms\": 120000, "
    "\"workers\": [{\"id\": 10}, {\"id\": 11}]}]}",
    "{\"records\": null, \"socket\": null, \"pools\": [{\"name\": \"p\", \"block_size\": 1, "
    "\"approx_capacity_blocks\": 5, \"approx_every_touch\": true, \"workers\": [{\"id\": 4294967295}]}]}",
    "{\"pools\": [{\"name\": \"x\", \"block_size\": 16, \"policy\": \"prefix\", \"params\": "
    "{\"cache_threshold\": 0.5}, \"workers\": [{\"id\": 1, \"events\": \"ipc:///tmp/e\", "
    "\"dp_size\": 64}]}], \"index\": {\"max_workers\": 128}}",
    "[]",
    "{}",
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
        snprintf(path, sizeof path, "%s/seed%zu.json", argv[1], i);
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
