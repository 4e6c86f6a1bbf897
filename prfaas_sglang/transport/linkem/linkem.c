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
 * Segmentation offload (version 2): the TUN devices take TCP/IPv4 segmentation and
 * checksum offload (IFF_VNET_HDR, TUNSETOFFLOAD), so a sender's stack hands linkem one
 * superpacket of up to 64 KiB where the wire carries up to 44 segments, and the receiving
 * stack takes it whole, as GRO would deliver it. The rules above still hold per wire
 * segment: each segment is charged its own headers at the rate, draws its own loss and
 * meets the queue limit on its own. A superpacket that loses none travels whole (due when
 * its last segment has crossed); one that loses some is cut into its surviving segments in
 * user space (headers rewritten, checksums computed), so a 0.1% loss drops single segments,
 * not 64 KiB bursts. Version 1 forwarded every 1500-byte packet with a read and a write,
 * which cost 0.75 of a CPU core for one TCP stream at 1 Gbit/s; this one 0.15.
 * In "stats", pkts counts wire segments; whole and cut count superpackets.
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
#include <linux/virtio_net.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define VNET ((ssize_t)sizeof(struct virtio_net_hdr))
#define MAX_PKT (VNET + 65536 + 256)
#define MAX_SEGS 128
#define RING 32768 /* packets per direction in flight (queue + propagation) */

struct pkt {
    uint64_t due_ns;
    uint32_t len;          /* bytes at data: a virtio_net_hdr, then the IP packet */
    uint32_t segs;         /* wire segments it stands for (1 unless a superpacket) */
    uint64_t wire_bytes;   /* their bytes on the wire, headers of each included */
    unsigned char *data;   /* malloc'd, freed when delivered */
};

struct dir {
    int in_fd, out_fd;
    struct pkt *ring;
    uint32_t head, count;
    uint64_t free_ns, last_due_ns;
    uint64_t sent_pkts, sent_bytes, lost, overflow, blackholed;
    uint64_t whole, cut; /* superpackets delivered whole, and cut into their surviving segments */
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
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (fd < 0 || ioctl(fd, TUNSETIFF, &ifr) != 0) {
        fprintf(stderr, "linkem: cannot create %s in %s: %s\n", name, ns, strerror(errno));
        exit(2);
    }
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4) != 0) {
        fprintf(stderr, "linkem: cannot set offloads on %s: %s\n", name, strerror(errno));
        exit(2);
    }
    return fd;
}

/* The layout of a TCP/IPv4 superpacket, or nseg = 0 if the packet is not one. */
struct gso {
    int nseg;
    uint32_t l3, l4, hdrs; /* offsets in the IP packet: TCP header, payload; hdrs = l4 + TCP header */
    uint32_t payload, mss;
};

static struct gso layout(const unsigned char *pkt, ssize_t n, const struct virtio_net_hdr *vh) {
    struct gso g = {0};
    if ((vh->gso_type & ~VIRTIO_NET_HDR_GSO_ECN) != VIRTIO_NET_HDR_GSO_TCPV4 || vh->gso_size == 0) return g;
    if (n < 40 || (pkt[0] >> 4) != 4 || pkt[9] != 6) return g;
    uint32_t ihl = (uint32_t)(pkt[0] & 15) * 4;
    if (ihl < 20 || (ssize_t)ihl + 20 > n) return g;
    uint32_t doff = (uint32_t)(pkt[ihl + 12] >> 4) * 4;
    if (doff < 20 || (ssize_t)(ihl + doff) > n) return g;
    g.l4 = ihl;
    g.hdrs = ihl + doff;
    g.payload = (uint32_t)n - g.hdrs;
    g.mss = vh->gso_size;
    g.nseg = (int)((g.payload + g.mss - 1) / g.mss);
    if (g.nseg < 1 || g.nseg > MAX_SEGS) g.nseg = 0;
    return g;
}

static uint32_t sum16(const unsigned char *p, size_t n, uint32_t acc) {
    for (; n > 1; p += 2, n -= 2) acc += (uint32_t)p[0] << 8 | p[1];
    if (n) acc += (uint32_t)p[0] << 8;
    return acc;
}

static uint16_t fold(uint32_t acc) {
    while (acc >> 16) acc = (acc & 0xffff) + (acc >> 16);
    return (uint16_t)~acc;
}

/* One wire segment i of superpacket pkt (IP packet, no vnet header), written at out with a
 * zeroed virtio_net_hdr (no offload: full checksums). Returns its length with the header. */
static uint32_t cut(const unsigned char *pkt, const struct gso *g, int i, unsigned char *out) {
    memset(out, 0, VNET);
    unsigned char *ip = out + VNET;
    uint32_t off = (uint32_t)i * g->mss;
    uint32_t len = g->payload - off < g->mss ? g->payload - off : g->mss;
    memcpy(ip, pkt, g->hdrs);
    memcpy(ip + g->hdrs, pkt + g->hdrs + off, len);
    uint32_t total = g->hdrs + len;
    ip[2] = (unsigned char)(total >> 8); ip[3] = (unsigned char)total;
    uint16_t id = (uint16_t)(((uint32_t)pkt[4] << 8 | pkt[5]) + (uint32_t)i);
    ip[4] = (unsigned char)(id >> 8); ip[5] = (unsigned char)id;
    ip[10] = ip[11] = 0;
    uint16_t ipsum = fold(sum16(ip, g->l4, 0));
    ip[10] = (unsigned char)(ipsum >> 8); ip[11] = (unsigned char)ipsum;
    unsigned char *tcp = ip + g->l4;
    uint32_t seq = ((uint32_t)tcp[4] << 24 | (uint32_t)tcp[5] << 16 | (uint32_t)tcp[6] << 8 | tcp[7]) + off;
    tcp[4] = (unsigned char)(seq >> 24); tcp[5] = (unsigned char)(seq >> 16);
    tcp[6] = (unsigned char)(seq >> 8); tcp[7] = (unsigned char)seq;
    if (i > 0) tcp[13] &= (unsigned char)~0x80;                 /* CWR on the first segment only */
    if (i < g->nseg - 1) tcp[13] &= (unsigned char)~0x09;       /* FIN and PSH on the last only */
    tcp[16] = tcp[17] = 0;
    uint32_t tcp_len = total - g->l4;
    uint32_t acc = sum16(ip + 12, 8, 0) + 6 + tcp_len;        /* pseudo header */
    uint16_t tsum = fold(sum16(tcp, tcp_len, acc));
    tcp[16] = (unsigned char)(tsum >> 8); tcp[17] = (unsigned char)tsum;
    return VNET + total;
}

static int enqueue(struct dir *d, const unsigned char *buf, uint32_t n, uint32_t segs, uint64_t wire_bytes,
                   uint64_t due) {
    if (d->count == RING) return 0;
    unsigned char *copy = malloc(n);
    if (!copy) return 0;
    memcpy(copy, buf, n);
    if (due < d->last_due_ns) due = d->last_due_ns; /* a delay change never reorders */
    d->last_due_ns = due;
    struct pkt *p = &d->ring[(d->head + d->count) % RING];
    p->due_ns = due;
    p->len = n;
    p->segs = segs;
    p->wire_bytes = wire_bytes;
    p->data = copy;
    d->count++;
    return 1;
}

/* Admit one wire segment of wire_bytes arriving at t: 1 and its departure time in *left, or 0. */
static int admit(struct dir *d, uint64_t t, uint32_t wire_bytes, uint64_t *left) {
    if (blackhole) { d->blackholed++; return 0; }
    if (loss_ppm > 0 && (double)random() / ((double)RAND_MAX + 1.0) * 1e6 < loss_ppm) { d->lost++; return 0; }
    if (d->free_ns > t && d->free_ns - t > queue_ns) { d->overflow++; return 0; }
    uint64_t start = d->free_ns > t ? d->free_ns : t;
    d->free_ns = start + (uint64_t)((double)wire_bytes * 8e9 / rate_bps);
    *left = d->free_ns;
    return 1;
}

static void arrive(struct dir *d, uint64_t t) {
    static unsigned char buf[MAX_PKT], seg[MAX_PKT];
    for (int burst = 0; burst < 64; burst++) {
        ssize_t n = read(d->in_fd, buf, sizeof buf);
        if (n <= VNET) return;
        const struct virtio_net_hdr *vh = (const struct virtio_net_hdr *)buf;
        struct gso g = layout(buf + VNET, n - VNET, vh);
        if (g.nseg == 0) { /* one wire packet */
            uint64_t left;
            if (d->count == RING) { d->overflow++; continue; }
            if (admit(d, t, (uint32_t)(n - VNET), &left)) enqueue(d, buf, (uint32_t)n, 1, (uint64_t)(n - VNET), left + delay_ns);
            continue;
        }
        uint64_t left[MAX_SEGS];
        int kept = 0;
        unsigned char ok[MAX_SEGS];
        for (int i = 0; i < g.nseg; i++) {
            uint32_t len = g.payload - (uint32_t)i * g.mss < g.mss ? g.payload - (uint32_t)i * g.mss : g.mss;
            if (d->count + kept >= RING) { d->overflow++; ok[i] = 0; continue; }
            ok[i] = (unsigned char)admit(d, t, g.hdrs + len, &left[i]);
            kept += ok[i];
        }
        if (kept == g.nseg) { /* all crossed: deliver it whole when its last segment has */
            uint64_t wire = (uint64_t)(n - VNET) + (uint64_t)(g.nseg - 1) * g.hdrs;
            d->whole += (uint64_t)enqueue(d, buf, (uint32_t)n, (uint32_t)g.nseg, wire, left[g.nseg - 1] + delay_ns);
            continue;
        }
        d->cut += kept > 0;
        for (int i = 0; i < g.nseg; i++) /* some lost: the survivors, one by one */
            if (ok[i]) {
                uint32_t len = cut(buf + VNET, &g, i, seg);
                enqueue(d, seg, len, 1, len - VNET, left[i] + delay_ns);
            }
    }
}

static void deliver(struct dir *d, uint64_t t) {
    while (d->count > 0 && d->ring[d->head].due_ns <= t) {
        struct pkt *p = &d->ring[d->head];
        if (write(d->out_fd, p->data, p->len) == (ssize_t)p->len) {
            d->sent_pkts += p->segs;
            d->sent_bytes += p->wire_bytes;
        }
        free(p->data);
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
        for (int i = 0; i < 2; i++)
            printf("%s\"%s\": {\"pkts\": %llu, \"bytes\": %llu, \"lost\": %llu, \"overflow\": %llu, "
                   "\"blackholed\": %llu, \"whole\": %llu, \"cut\": %llu}%s",
                   i ? ", " : "{", i ? "ba" : "ab", (unsigned long long)dirs[i].sent_pkts,
                   (unsigned long long)dirs[i].sent_bytes, (unsigned long long)dirs[i].lost,
                   (unsigned long long)dirs[i].overflow, (unsigned long long)dirs[i].blackholed,
                   (unsigned long long)dirs[i].whole, (unsigned long long)dirs[i].cut, i ? "}\n" : "");
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
