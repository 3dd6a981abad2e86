/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the server configuration loader, km_server_config_load_json
 * (src/service/server_config.c), on a file of fuzzed bytes (a memfd, read through /proc/self/fd).
 *
 * Contracts checked: a failure has a negative code, a non-empty why and no owner; a success has
 * an owner, and every string and array the configuration points to is readable (pools, their
 * workers, names, endpoints) until km_server_config_json_free. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvmatch/server.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

static volatile size_t sink;

static void touch(const char *s)
{
    if (s)
        sink += strlen(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("config", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(write(fd, data, size) == (ssize_t)size);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    km_server_config cfg;
    km_server_config_init(&cfg);
    km_server_config_json *owner = (km_server_config_json *)&cfg; /* must be reset */
    char why[256] = "";
    int rc = km_server_config_load_json(path, &cfg, &owner, why, sizeof why);
    close(fd);
    if (rc != KM_OK) {
        CHECK(rc < 0);
        CHECK(why[0] != '\0');
        CHECK(owner == NULL);
        return 0;
    }
    CHECK(owner != NULL);
    touch(cfg.socket_path), touch(cfg.tcp), touch(cfg.http), touch(cfg.records_path);
    touch(cfg.snapshot_dir), touch(cfg.default_pool);
    CHECK(cfg.n_pools == 0 || cfg.pools);
    for (uint32_t i = 0; i < cfg.n_pools; i++) {
        const km_server_pool *p = &cfg.pools[i];
        touch(p->name), touch(p->model);
        CHECK(p->n_workers == 0 || p->workers);
        for (uint32_t j = 0; j < p->n_workers; j++) {
            touch(p->workers[j].name);
            touch(p->workers[j].event_endpoint);
            touch(p->workers[j].replay_endpoint);
        }
    }
    km_server_config_json_free(owner);
    return 0;
}
