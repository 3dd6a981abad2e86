/* Starting and stopping a real nats-server for the cluster tests (nats_test_server.h). Its log
 * (/tmp/km-nats-PORT.log) lives while it runs, and stays only where a start failed and the
 * reason names it. */
#include "nats_test_server.h"
#include "kv_test_publisher.h"
#include "test_util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *km_nats_server_binary(void)
{
    static char found[256];
    const char *path = getenv("PATH");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s:/usr/sbin:/usr/local/sbin", path ? path : "/usr/bin:/bin");
    for (char *save = NULL, *dir = strtok_r(buf, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        snprintf(found, sizeof found, "%s/nats-server", dir);
        if (access(found, X_OK) == 0)
            return found;
    }
    return NULL;
}

uint16_t km_test_free_port(void)
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

static bool start_and_wait(km_nats_test_server *s, const char *bin, const char *port,
                           const char *config_path, char *why, size_t why_size);

static void kill_and_reap(km_nats_test_server *s)
{
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

bool km_nats_test_server_restart(km_nats_test_server *s, char *why, size_t why_size)
{
    const char *bin = km_nats_server_binary();
    if (!bin) {
        snprintf(why, why_size, "nats-server not found in PATH or /usr/sbin (scripts/install-deps.sh "
                 "--test installs Debian's nats-server)");
        return false;
    }
    char port[16];
    snprintf(port, sizeof port, "%u", s->port);
    /* The configuration file lives until the server has read it (it is listening, or gone). */
    char config_path[64] = "";
    if (s->config[0]) {
        snprintf(config_path, sizeof config_path, "/tmp/km-nats-%u.conf", s->port);
        FILE *f = fopen(config_path, "w");
        if (!f) {
            snprintf(why, why_size, "%s: %s", config_path, strerror(errno));
            return false;
        }
        fprintf(f, "listen: 127.0.0.1:%u\n%s\n", s->port, s->config);
        fclose(f);
    }
    bool up = start_and_wait(s, bin, port, config_path, why, why_size);
    if (config_path[0])
        unlink(config_path);
    return up;
}

static bool start_and_wait(km_nats_test_server *s, const char *bin, const char *port,
                           const char *config_path, char *why, size_t why_size)
{
    int parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, why_size, "fork: %s", strerror(errno));
        return false;
    }
    if (pid == 0) {
        km_test_die_with_parent(parent);
        int fd = open(s->log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (s->config[0])
            execl(bin, "nats-server", "-c", config_path, (char *)NULL);
        else
            execl(bin, "nats-server", "-a", "127.0.0.1", "-p", port, (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < 500; i++) {
        if (accepts(s->port))
            return true;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            s->pid = 0;
            snprintf(why, why_size, "%s exited (status %d) before listening on 127.0.0.1:%u; see %s",
                     bin, WIFEXITED(status) ? WEXITSTATUS(status) : -1, s->port, s->log_path);
            return false;
        }
        km_test_sleep_ms(10);
    }
    kill_and_reap(s); /* the log stays: the reason points at it */
    snprintf(why, why_size, "%s did not listen on 127.0.0.1:%u within 5 s; see %s", bin, s->port,
             s->log_path);
    return false;
}

bool km_nats_test_server_start(km_nats_test_server *s, char *why, size_t why_size)
{
    return km_nats_test_server_start_with(s, "", why, why_size);
}

bool km_nats_test_server_start_with(km_nats_test_server *s, const char *config, char *why,
                                    size_t why_size)
{
    memset(s, 0, sizeof *s);
    s->port = km_test_free_port();
    if (!s->port) {
        snprintf(why, why_size, "no free loopback port");
        return false;
    }
    snprintf(s->url, sizeof s->url, "nats://127.0.0.1:%u", s->port);
    snprintf(s->log_path, sizeof s->log_path, "/tmp/km-nats-%u.log", s->port);
    unlink(s->log_path); /* one left by a process that died: this server's log starts empty */
    snprintf(s->config, sizeof s->config, "%s", config);
    return km_nats_test_server_restart(s, why, why_size);
}

void km_nats_test_server_stop(km_nats_test_server *s)
{
    if (!s->pid)
        return;
    kill_and_reap(s);
    unlink(s->log_path);
}
