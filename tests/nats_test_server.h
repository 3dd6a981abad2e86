/* A real nats-server for the tests: started on a free loopback port, stopped and started again on
 * the same port (NATS down and back), killed at teardown. */
#ifndef KM_NATS_TEST_SERVER_H
#define KM_NATS_TEST_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct km_nats_test_server {
    pid_t pid; /* 0 when stopped */
    uint16_t port;
    char url[64]; /* nats://127.0.0.1:PORT */
    char log_path[64];
    char config[256]; /* the configuration lines it was started with; "" = none */
} km_nats_test_server;

/* The nats-server binary (PATH, then /usr/sbin), or NULL. */
const char *km_nats_server_binary(void);

/* Start on a free loopback port and wait (5 s at most) until it accepts connections. False with
 * the reason in why when it cannot start (the log it names is left for reading). */
bool km_nats_test_server_start(km_nats_test_server *s, char *why, size_t why_size);
/* km_nats_test_server_start with `config` (nats-server configuration lines, such as
 * "max_payload: 4096") added to its listen address in a configuration file. */
bool km_nats_test_server_start_with(km_nats_test_server *s, const char *config, char *why,
                                    size_t why_size);
/* Start again on s->port (after km_nats_test_server_stop). */
bool km_nats_test_server_restart(km_nats_test_server *s, char *why, size_t why_size);
/* SIGKILL and reap, and remove its log; the port is free again. A stopped server is a no-op. */
void km_nats_test_server_stop(km_nats_test_server *s);

/* A loopback port nothing listens on now. */
uint16_t km_test_free_port(void);

#endif
