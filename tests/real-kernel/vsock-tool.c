/*
 * vsock-tool: vsock from Linux user space for the real-kernel tier, on both sides of gpuvm's hybrid vsock
 * (busybox has no AF_VSOCK). run.sh builds it statically; it goes into the outer machine and into gpuvm's
 * Linux guests.
 *
 * In a guest (AF_VSOCK):
 *   vsock-tool echo-client CID PORT BYTES   connect, send BYTES patterned bytes, read them back, compare
 *   vsock-tool echo-server PORT             accept one connection and echo it until EOF
 *   vsock-tool agent PORT HOOK              gpuvm's GPU agent (vmm/src/gpu_release.rs): for each line
 *                                           "RELEASE|ATTACH <id> <bdf>" run `HOOK release|attach <id> <bdf>`
 *                                           and answer RELEASED/RESUMED <id>, or ERROR <id> <why>
 * On the host side (gpuvm's Unix socket):
 *   vsock-tool uds-echo-server PATH         accept one connection on PATH (a guest's connection to port P
 *                                           arrives on <uds>_<P>) and echo it until EOF
 *   vsock-tool uds-echo-client PATH PORT BYTES
 *                                           "CONNECT PORT", expect "OK", then as echo-client
 *   vsock-tool uds-echo-rounds PATH PORT BYTES ROUNDS PAUSE_MS
 *                                           as uds-echo-client, on one connection ROUNDS times,
 *                                           PAUSE_MS apart (a live update goes on meanwhile)
 * Each mode prints one `vsock-tool: ...` line per step and exits 0 only when the step it was asked for
 * happened; every wait is bounded (SIGALRM), so a lost connection fails instead of hanging the tier.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

#define TIMEOUT_S 120
#define CHUNK 4096

static void say(const char *format, ...)
{
    static const char prefix[] = "vsock-tool: ";
    char line[512];
    va_list args;
    memcpy(line, prefix, sizeof(prefix) - 1);
    size_t room = sizeof(line) - (sizeof(prefix) - 1) - 1;
    va_start(args, format);
    int n = vsnprintf(line + sizeof(prefix) - 1, room, format, args);
    va_end(args);
    if (n < 0)
        return;
    if (n > (int)room - 1)
        n = (int)room - 1;
    n += sizeof(prefix) - 1;
    line[n++] = '\n';
    /* One write per line, prefix included: the console interleaves it with the shell's output
     * whole (two writes let init's `inner: ...` land between them). */
    (void)!write(STDOUT_FILENO, line, n);
}

static void die(const char *format, ...)
{
    char text[400];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof(text), format, args);
    va_end(args);
    say("FAIL %s", text);
    exit(1);
}

static void on_alarm(int signal)
{
    (void)signal;
    die("no progress in %d s", TIMEOUT_S);
}

/* The byte at offset i of every transfer: position-dependent, so a lost or repeated chunk shows. */
static unsigned char pattern(unsigned long i)
{
    return (unsigned char)((i * 2654435761u) >> 13);
}

/* Sends `total` patterned bytes and reads as many back, interleaved (the echo may not buffer it all). */
static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void echo_exchange(int fd, unsigned long total)
{
    double started = now_s();
    unsigned long sent = 0, received = 0;
    unsigned char out[CHUNK], in[CHUNK];
    while (received < total) {
        struct pollfd p = {.fd = fd, .events = POLLIN | (sent < total ? POLLOUT : 0)};
        if (poll(&p, 1, TIMEOUT_S * 1000) <= 0)
            die("the echo stalled at %lu of %lu bytes back", received, total);
        if ((p.revents & POLLOUT) && sent < total) {
            size_t n = total - sent < CHUNK ? total - sent : CHUNK;
            for (size_t i = 0; i < n; i++)
                out[i] = pattern(sent + i);
            ssize_t w = write(fd, out, n);
            if (w < 0 && errno != EAGAIN)
                die("write: %s", strerror(errno));
            if (w > 0)
                sent += w;
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = read(fd, in, sizeof(in));
            if (r < 0)
                die("read: %s", strerror(errno));
            if (r == 0)
                die("the peer closed after %lu of %lu bytes back", received, total);
            for (ssize_t i = 0; i < r; i++)
                if (in[i] != pattern(received + i))
                    die("byte %lu came back as 0x%02x, sent 0x%02x", received + i, in[i],
                        pattern(received + i));
            received += r;
        }
    }
    double seconds = now_s() - started;
    say("ok: %lu bytes sent and read back unchanged in %.0f ms (%.1f MiB/s each way)", total, seconds * 1e3,
        total / 1048576.0 / (seconds > 0 ? seconds : 1e-9));
}

static void echo_until_eof(int fd)
{
    unsigned char buffer[CHUNK];
    unsigned long total = 0;
    for (;;) {
        alarm(TIMEOUT_S);
        ssize_t r = read(fd, buffer, sizeof(buffer));
        if (r < 0)
            die("read: %s", strerror(errno));
        if (r == 0)
            break;
        for (ssize_t done = 0; done < r;) {
            ssize_t w = write(fd, buffer + done, r - done);
            if (w < 0)
                die("write: %s", strerror(errno));
            done += w;
        }
        total += r;
    }
    say("echoed %lu bytes", total);
}

static int vsock_listen(unsigned port)
{
    int fd = socket(AF_VSOCK, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket(AF_VSOCK): %s", strerror(errno));
    struct sockaddr_vm address = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY, .svm_port = port};
    if (bind(fd, (struct sockaddr *)&address, sizeof(address)) < 0 || listen(fd, 4) < 0)
        die("listen on vsock port %u: %s", port, strerror(errno));
    say("listening on vsock port %u", port);
    return fd;
}

static int unix_socket(const char *path, struct sockaddr_un *address)
{
    if (strlen(path) >= sizeof(address->sun_path))
        die("socket path too long: %s", path);
    memset(address, 0, sizeof(*address));
    address->sun_family = AF_UNIX;
    strcpy(address->sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket(AF_UNIX): %s", strerror(errno));
    return fd;
}

/* Reads one line (without its newline) into `line`; 0 at EOF before any byte. */
static int read_line(int fd, char *line, size_t size)
{
    size_t n = 0;
    line[0] = 0;
    for (;;) {
        char c;
        ssize_t r = read(fd, &c, 1);
        if (r < 0)
            die("read: %s", strerror(errno));
        if (r == 0)
            return n > 0 ? (line[n] = 0, 1) : 0;
        if (c == '\n') {
            line[n] = 0;
            return 1;
        }
        if (n + 1 >= size)
            die("a line longer than %zu bytes", size);
        line[n++] = c;
    }
}

static void write_all(int fd, const char *text)
{
    size_t length = strlen(text);
    for (size_t done = 0; done < length;) {
        ssize_t w = write(fd, text + done, length - done);
        if (w < 0)
            die("write: %s", strerror(errno));
        done += w;
    }
}

static int run_hook(const char *hook, const char *verb, const char *id, const char *bdf)
{
    pid_t child = fork();
    if (child < 0)
        die("fork: %s", strerror(errno));
    if (child == 0) {
        execl("/bin/sh", "sh", hook, verb, id, bdf, (char *)NULL);
        _exit(127);
    }
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            die("waitpid: %s", strerror(errno));
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/* gpuvm's GPU agent: serves connections one after another for as long as the guest runs. */
static void agent(unsigned port, const char *hook)
{
    int listener = vsock_listen(port);
    for (;;) {
        alarm(0);
        int fd = accept(listener, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            die("accept: %s", strerror(errno));
        }
        say("agent: connected");
        char line[256], answer[320];
        while (read_line(fd, line, sizeof(line))) {
            char verb[16], id[64], bdf[64];
            if (sscanf(line, "%15s %63s %63s", verb, id, bdf) != 3) {
                say("agent: a line it cannot read: %s", line);
                write_all(fd, "ERROR - malformed request\n");
                continue;
            }
            say("agent: %s %s %s", verb, id, bdf);
            const char *done = strcmp(verb, "RELEASE") == 0  ? "RELEASED"
                               : strcmp(verb, "ATTACH") == 0 ? "RESUMED"
                                                             : NULL;
            if (!done) {
                snprintf(answer, sizeof(answer), "ERROR %s unknown verb %s\n", id, verb);
            } else {
                int status = run_hook(hook, strcmp(verb, "RELEASE") == 0 ? "release" : "attach", id, bdf);
                if (status == 0)
                    snprintf(answer, sizeof(answer), "%s %s\n", done, id);
                else
                    snprintf(answer, sizeof(answer), "ERROR %s the hook exited %d\n", id, status);
            }
            say("agent: answers %.*s", (int)strcspn(answer, "\n"), answer);
            write_all(fd, answer);
        }
        say("agent: connection closed");
        close(fd);
    }
}

static unsigned long number(const char *text, const char *what)
{
    char *end;
    errno = 0;
    unsigned long value = strtoul(text, &end, 0);
    if (errno || *end || end == text)
        die("bad %s: %s", what, text);
    return value;
}

/* Connects to gpuvm's hybrid vsock socket at `path` and asks for the guest's `port`
 * ("CONNECT port", then gpuvm's "OK ..."): the stream to the guest. */
static int uds_connect(const char *path, const char *port)
{
    struct sockaddr_un address;
    int fd = unix_socket(path, &address);
    if (connect(fd, (struct sockaddr *)&address, sizeof(address)) < 0)
        die("connect to %s: %s", path, strerror(errno));
    char request[64], line[128];
    snprintf(request, sizeof(request), "CONNECT %lu\n", number(port, "port"));
    write_all(fd, request);
    if (!read_line(fd, line, sizeof(line)) || strncmp(line, "OK ", 3) != 0)
        die("CONNECT %s was answered \"%s\"", port, line);
    say("connected to the guest's port %s (%s)", port, line);
    return fd;
}

int main(int argc, char **argv)
{
    signal(SIGALRM, on_alarm);
    signal(SIGPIPE, SIG_IGN);
    alarm(TIMEOUT_S);
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "echo-client") == 0 && argc == 5) {
        int fd = socket(AF_VSOCK, SOCK_STREAM, 0);
        if (fd < 0)
            die("socket(AF_VSOCK): %s", strerror(errno));
        struct sockaddr_vm address = {.svm_family = AF_VSOCK,
                                      .svm_cid = (unsigned)number(argv[2], "cid"),
                                      .svm_port = (unsigned)number(argv[3], "port")};
        if (connect(fd, (struct sockaddr *)&address, sizeof(address)) < 0)
            die("connect to vsock %s:%s: %s", argv[2], argv[3], strerror(errno));
        say("connected to vsock %s:%s", argv[2], argv[3]);
        echo_exchange(fd, number(argv[4], "byte count"));
        return 0;
    }
    if (strcmp(mode, "echo-server") == 0 && argc == 3) {
        int listener = vsock_listen((unsigned)number(argv[2], "port"));
        int fd = accept(listener, NULL, NULL);
        if (fd < 0)
            die("accept: %s", strerror(errno));
        say("accepted a connection");
        echo_until_eof(fd);
        return 0;
    }
    if (strcmp(mode, "agent") == 0 && argc == 4) {
        agent((unsigned)number(argv[2], "port"), argv[3]);
        return 1;
    }
    if (strcmp(mode, "uds-echo-server") == 0 && argc == 3) {
        struct sockaddr_un address;
        int listener = unix_socket(argv[2], &address);
        unlink(argv[2]);
        if (bind(listener, (struct sockaddr *)&address, sizeof(address)) < 0 || listen(listener, 1) < 0)
            die("listen on %s: %s", argv[2], strerror(errno));
        say("listening on %s", argv[2]);
        alarm(0); /* the guest connects when its boot gets there */
        int fd = accept(listener, NULL, NULL);
        if (fd < 0)
            die("accept: %s", strerror(errno));
        say("accepted a connection on %s", argv[2]);
        echo_until_eof(fd);
        return 0;
    }
    if (strcmp(mode, "uds-echo-client") == 0 && argc == 5) {
        int fd = uds_connect(argv[2], argv[3]);
        echo_exchange(fd, number(argv[4], "byte count"));
        return 0;
    }
    if (strcmp(mode, "uds-echo-rounds") == 0 && argc == 7) {
        int fd = uds_connect(argv[2], argv[3]);
        unsigned long bytes = number(argv[4], "byte count"), rounds = number(argv[5], "rounds");
        unsigned long pause_ms = number(argv[6], "pause");
        for (unsigned long round = 1; round <= rounds; round++) {
            alarm(TIMEOUT_S);
            echo_exchange(fd, bytes);
            say("round %lu ok", round);
            usleep(pause_ms * 1000);
        }
        say("all %lu rounds ok on one connection", rounds);
        return 0;
    }
    fprintf(stderr,
            "usage: vsock-tool echo-client CID PORT BYTES | echo-server PORT | agent PORT HOOK |\n"
            "                  uds-echo-server PATH | uds-echo-client PATH PORT BYTES |\n"
            "                  uds-echo-rounds PATH PORT BYTES ROUNDS PAUSE_MS\n");
    return 2;
}
