/*
 * prfaas-sglang bind shim (LD_PRELOAD): a wildcard bind() to a port in PRFAAS_BIND_PORTS becomes a
 * bind to PRFAAS_BIND_HOST.
 *
 * Why: Mooncake's transfer engine (0.3.x) binds its handshake listener to 0.0.0.0 and its TCP data
 * listener to [::] with no option to choose the interface (Mooncake issue #1938). The launcher
 * preloads this into an engine whose node names a host, so those listeners take the node's
 * address like every other listener of the deployment.
 *
 * How: only binds to 0.0.0.0 or :: whose port lies in one of the ranges "LO-HI[,LO-HI...]" are
 * rewritten (Mooncake draws its ports from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT); every other bind,
 * SGLang's and torch's included, is left exactly as asked. An IPv4 host on a dual-stack IPv6
 * socket binds the v4-mapped address. If the rewritten bind fails (a v6-only socket, an address
 * not on this host), the original bind is made and a line goes to stderr: the service keeps
 * running, the NetworkPolicy still closes the port.
 *
 * Removal: when Mooncake can bind a configured interface (issue #1938).
 * Tests: tests/unit/test_bind_shim.py, tests/router/test_security_e2e.py.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int port_listed(long port) {
    const char *spec = getenv("PRFAAS_BIND_PORTS");
    while (spec && *spec) {
        char *end;
        long lo = strtol(spec, &end, 10), hi = lo;
        if (end == spec) return 0;
        if (*end == '-') {
            const char *next = end + 1;
            hi = strtol(next, &end, 10);
            if (end == next) return 0;
        }
        if (port >= lo && port <= hi) return 1;
        if (*end != ',') return 0;
        spec = end + 1;
    }
    return 0;
}

static int retry(bind_fn real, int fd, const struct sockaddr *rewritten, socklen_t rlen,
                 const struct sockaddr *addr, socklen_t len, const char *host) {
    if (real(fd, rewritten, rlen) == 0) return 0;
    fprintf(stderr, "prfaas bind shim: could not bind %s, binding the address asked for\n", host);
    return real(fd, addr, len);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("PRFAAS_BIND_HOST");
    if (!host || !*host || !addr) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && port_listed(ntohs(a.sin_port)) &&
            inet_pton(AF_INET, host, &a.sin_addr) == 1)
            return retry(real_bind, fd, (const struct sockaddr *)&a, sizeof a, addr, len, host);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        struct in_addr v4;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && port_listed(ntohs(a.sin6_port))) {
            if (inet_pton(AF_INET6, host, &a.sin6_addr) == 1)
                return retry(real_bind, fd, (const struct sockaddr *)&a, sizeof a, addr, len, host);
            if (inet_pton(AF_INET, host, &v4) == 1) { /* v4-mapped ::ffff:a.b.c.d */
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
                return retry(real_bind, fd, (const struct sockaddr *)&a, sizeof a, addr, len, host);
            }
        }
    }
    return real_bind(fd, addr, len);
}
