/* linkem: a point-to-point link emulator between two network namespaces (rate, delay, loss).
 *
 * This kernel has no netem. linkem creates a TUN device in each of two existing
 * namespaces (setns into /var/run/netns/NAME) and forwards every packet between
 * them in user space, each direction through its own bottleneck:
 *
 *   arrival t -> dropped if blackholed, by random loss, or if the bottleneck queue
 *                already holds more than queue_us of serialisation;
 *             -> else it leaves the bottleneck at  free = max(t, free) + len * 8 / rate
 *                and is delivered at  due = free + delay  (FIFO, never reordered).
 *
 * Usage: linkem NS_A TUN_A NS_B TUN_B RATE_MBIT DELAY_US LOSS_PPM QUEUE_US
 * Control: one command per line on stdin, applied to both directions:
 *   rate MBIT | delay US | loss PPM | queue US | blackhole 0|1 | stats
 * "stats" prints one JSON line; "ready" is printed once both devices exist;
 * EOF on stdin ends the process. Needs CAP_NET_ADMIN. Part of prfaas-sglang's
 * test and benchmark fixtures (prfaas_sglang/transport/linkem/__init__.py builds it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define SLOT 2048
#define RING 32768 /* packets per direction in flight (queue + propagation) */

struct pkt {
    uint64_t due_ns;
    uint32_t len;
    unsigned char data[SLOT];
};

struct dir {
    int in_fd, out_fd;
    struct pkt *ring;
    uint32_t head, count;
    uint64_t free_ns, last_due_ns;
    uint64_t sent_pkts, sent_bytes, lost, overflow, blackholed;
};

static double rate_bps, loss_ppm;
static uint64_t delay_ns, queue_ns;
static int blackhole;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int open_tun(const char *ns, const char *name) {
    char path[256];
    snprintf(path, sizeof path, "/var/run/netns/%s", ns);
    int nsfd = open(path, O_RDONLY | O_CLOEXEC);
    if (nsfd < 0 || setns(nsfd, CLONE_NEWNET) != 0) {
        fprintf(stderr, "linkem: cannot enter namespace %s: %s\n", ns, strerror(errno));
        exit(2);
    }
    close(nsfd);
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (fd < 0 || ioctl(fd, TUNSETIFF, &ifr) != 0) {
        fprintf(stderr, "linkem: cannot create %s in %s: %s\n", name, ns, strerror(errno));
        exit(2);
    }
    return fd;
}

static void arrive(struct dir *d, uint64_t t) {
    for (int burst = 0; burst < 64; burst++) {
        unsigned char buf[SLOT];
        ssize_t n = read(d->in_fd, buf, sizeof buf);
        if (n <= 0) return;
        if (blackhole) { d->blackholed++; continue; }
        if (loss_ppm > 0 && (double)random() / ((double)RAND_MAX + 1.0) * 1e6 < loss_ppm) { d->lost++; continue; }
        if (d->free_ns > t && d->free_ns - t > queue_ns) { d->overflow++; continue; }
        if (d->count == RING) { d->overflow++; continue; }
        uint64_t start = d->free_ns > t ? d->free_ns : t;
        d->free_ns = start + (uint64_t)((double)n * 8e9 / rate_bps);
        uint64_t due = d->free_ns + delay_ns;
        if (due < d->last_due_ns) due = d->last_due_ns; /* a delay change never reorders */
        d->last_due_ns = due;
        struct pkt *p = &d->ring[(d->head + d->count) % RING];
        p->due_ns = due;
        p->len = (uint32_t)n;
        memcpy(p->data, buf, (size_t)n);
        d->count++;
    }
}

static void deliver(struct dir *d, uint64_t t) {
    while (d->count > 0 && d->ring[d->head].due_ns <= t) {
        struct pkt *p = &d->ring[d->head];
        if (write(d->out_fd, p->data, p->len) == (ssize_t)p->len) {
            d->sent_pkts++;
            d->sent_bytes += p->len;
        }
        d->head = (d->head + 1) % RING;
        d->count--;
    }
}

static void command(char *line, struct dir *dirs) {
    char verb[32];
    double value = 0;
    if (sscanf(line, "%31s %lf", verb, &value) < 1) return;
    if (!strcmp(verb, "rate") && value > 0) rate_bps = value * 1e6;
    else if (!strcmp(verb, "delay") && value >= 0) delay_ns = (uint64_t)(value * 1e3);
    else if (!strcmp(verb, "loss") && value >= 0) loss_ppm = value;
    else if (!strcmp(verb, "queue") && value > 0) queue_ns = (uint64_t)(value * 1e3);
    else if (!strcmp(verb, "blackhole")) blackhole = value != 0;
    else if (!strcmp(verb, "stats")) {
        printf("{\"ab\": {\"pkts\": %llu, \"bytes\": %llu, \"lost\": %llu, \"overflow\": %llu, \"blackholed\": %llu}, "
               "\"ba\": {\"pkts\": %llu, \"bytes\": %llu, \"lost\": %llu, \"overflow\": %llu, \"blackholed\": %llu}}\n",
               (unsigned long long)dirs[0].sent_pkts, (unsigned long long)dirs[0].sent_bytes,
               (unsigned long long)dirs[0].lost, (unsigned long long)dirs[0].overflow, (unsigned long long)dirs[0].blackholed,
               (unsigned long long)dirs[1].sent_pkts, (unsigned long long)dirs[1].sent_bytes,
               (unsigned long long)dirs[1].lost, (unsigned long long)dirs[1].overflow, (unsigned long long)dirs[1].blackholed);
    } else {
        fprintf(stderr, "linkem: unknown command: %s", line);
        return;
    }
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: linkem NS_A TUN_A NS_B TUN_B RATE_MBIT DELAY_US LOSS_PPM QUEUE_US\n");
        return 2;
    }
    int a = open_tun(argv[1], argv[2]);
    int b = open_tun(argv[3], argv[4]);
    rate_bps = atof(argv[5]) * 1e6;
    delay_ns = (uint64_t)(atof(argv[6]) * 1e3);
    loss_ppm = atof(argv[7]);
    queue_ns = (uint64_t)(atof(argv[8]) * 1e3);
    if (rate_bps <= 0 || queue_ns == 0) {
        fprintf(stderr, "linkem: rate and queue must be > 0\n");
        return 2;
    }
    srandom((unsigned)now_ns());
    struct dir dirs[2] = {{.in_fd = a, .out_fd = b}, {.in_fd = b, .out_fd = a}};
    for (int i = 0; i < 2; i++) {
        dirs[i].ring = calloc(RING, sizeof(struct pkt));
        if (!dirs[i].ring) { fprintf(stderr, "linkem: out of memory\n"); return 2; }
    }
    printf("ready\n");
    fflush(stdout);
    char line[256];
    size_t used = 0;
    for (;;) {
        uint64_t t = now_ns();
        deliver(&dirs[0], t);
        deliver(&dirs[1], t);
        uint64_t next = UINT64_MAX;
        for (int i = 0; i < 2; i++)
            if (dirs[i].count > 0 && dirs[i].ring[dirs[i].head].due_ns < next) next = dirs[i].ring[dirs[i].head].due_ns;
        struct timespec wait = {1, 0};
        if (next != UINT64_MAX) {
            uint64_t gap = next > t ? next - t : 0;
            wait.tv_sec = (time_t)(gap / 1000000000ull);
            wait.tv_nsec = (long)(gap % 1000000000ull);
        }
        struct pollfd fds[3] = {{a, POLLIN, 0}, {b, POLLIN, 0}, {0, POLLIN, 0}};
        if (ppoll(fds, 3, &wait, NULL) < 0 && errno != EINTR) return 1;
        t = now_ns();
        if (fds[0].revents & POLLIN) arrive(&dirs[0], t);
        if (fds[1].revents & POLLIN) arrive(&dirs[1], t);
        if (fds[2].revents & (POLLIN | POLLHUP)) {
            ssize_t n = read(0, line + used, sizeof line - 1 - used);
            if (n <= 0) return 0; /* EOF: the owner is gone */
            used += (size_t)n;
            line[used] = 0;
            char *nl;
            while ((nl = strchr(line, '\n')) != NULL) {
                *nl = 0;
                command(line, dirs);
                used -= (size_t)(nl + 1 - line);
                memmove(line, nl + 1, used + 1);
            }
            if (used == sizeof line - 1) used = 0; /* an overlong line: dropped */
        }
    }
}
