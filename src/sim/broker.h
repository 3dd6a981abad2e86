/* Internal: the NATS broker of the simulator's shared mode (docs/SIM.md, "Several instances"):
 * Debian's nats-server started as a child process on a free loopback port, stopped at the end. */
#ifndef KM_SIM_BROKER_H
#define KM_SIM_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct km_sim_broker {
    pid_t pid;     /* 0 when not running */
    uint16_t port; /* the loopback port, kept across a restart */
    char url[64];  /* nats://127.0.0.1:PORT */
    char log_path[96];
} km_sim_broker;

/* The nats-server executable (PATH, then /usr/sbin and /usr/local/sbin), or NULL. */
const char *km_sim_broker_binary(void);

/* Start nats-server on a free loopback port and wait (5 s at most) until it accepts connections.
 * Errors: KM_ERR_NOT_FOUND when nats-server is not installed, KM_ERR_IO when it cannot start
 * or never listens (why names the binary and its log). */
int km_sim_broker_start(km_sim_broker *b, char *why, size_t why_size);

/* The NATS outage fault: kill and reap it, keeping its port and log (a killed broker does
 * nothing), then start it again on the same port, waiting as start does (same errors). */
int km_sim_broker_kill(km_sim_broker *b);
int km_sim_broker_restart(km_sim_broker *b, char *why, size_t why_size);

/* Kill and reap it, removing its log. Stopping a stopped broker does nothing. */
void km_sim_broker_stop(km_sim_broker *b);

#endif
