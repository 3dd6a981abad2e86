/* The shared mode's nats-server child (src/sim/broker.h). */
#include "sim/broker.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvmatch/error.h"
#include "base/error_detail.h"

const char *km_sim_broker_binary(void)
{
    static char found[512];
    const char *path = getenv("PATH");
    char dirs[4096];
    snprintf(dirs, sizeof dirs, "%s:/usr/sbin:/usr/local/sbin", path ? path : "/usr/bin:/bin");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(found, sizeof found, "%s/nats-server", d);
        if (access(found, X_OK) == 0)
            return found;
    }
    return NULL;
}

static uint16_t free_loopback_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    uint16_t port = 0;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static bool accepts(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* Start nats-server on `port` (b->url and b->log_path set) and wait until it listens. */
static int spawn(km_sim_broker *b, const char *bin, uint16_t port, char *why, size_t why_size)
{
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%u", port);
    pid_t pid = fork();
    if (pid < 0)
        return km_why(why, why_size, KM_ERR_IO, "fork for nats-server: %s", strerror(errno));
    if (pid == 0) {
        int fd = open(b->log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execl(bin, "nats-server", "-a", "127.0.0.1", "-p", port_s, (char *)NULL);
        _exit(127);
    }
    b->pid = pid;
    for (int i = 0; i < 500; i++) {
        if (accepts(port))
            return KM_OK;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            b->pid = 0;
            return km_why(why, why_size, KM_ERR_IO,
                          "%s exited (status %d) before listening on 127.0.0.1:%u; see %s", bin,
                          WIFEXITED(status) ? WEXITSTATUS(status) : -1, port, b->log_path);
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    km_sim_broker_stop(b);
    return km_why(why, why_size, KM_ERR_IO, "%s did not listen on 127.0.0.1:%u within 5 s", bin, port);
}

int km_sim_broker_start(km_sim_broker *b, char *why, size_t why_size)
{
    memset(b, 0, sizeof *b);
    const char *bin = km_sim_broker_binary();
    if (!bin)
        return km_why(why, why_size, KM_ERR_NOT_FOUND,
                      "the shared mode (--instances > 1) needs nats-server, which is not in PATH, "
                      "/usr/sbin or /usr/local/sbin (Debian package nats-server)");
    uint16_t port = free_loopback_port();
    if (!port)
        return km_why(why, why_size, KM_ERR_IO, "no free loopback port for nats-server");
    b->port = port;
    snprintf(b->url, sizeof b->url, "nats://127.0.0.1:%u", port);
    snprintf(b->log_path, sizeof b->log_path, "/tmp/kvmatch-sim-nats-%ld-%u.log", (long)getpid(), port);
    unlink(b->log_path);
    return spawn(b, bin, port, why, why_size);
}

int km_sim_broker_kill(km_sim_broker *b)
{
    if (!b->pid)
        return KM_OK;
    kill(b->pid, SIGKILL);
    waitpid(b->pid, NULL, 0);
    b->pid = 0;
    return KM_OK;
}

int km_sim_broker_restart(km_sim_broker *b, char *why, size_t why_size)
{
    const char *bin = km_sim_broker_binary();
    if (!bin || !b->port)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "no nats-server to restart");
    km_sim_broker_kill(b);
    return spawn(b, bin, b->port, why, why_size);
}

void km_sim_broker_stop(km_sim_broker *b)
{
    km_sim_broker_kill(b);
    if (b->log_path[0])
        unlink(b->log_path);
}
