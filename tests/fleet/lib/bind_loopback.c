/*
 * bind_loopback.so: LD_PRELOADed into the test Slurm's daemons by tests/fleet/up --slurm.
 *
 * GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
 *
 * slurmctld, slurmd and srun listen on the wildcard address (Slurm 22.05 has no setting for the
 * address its daemons bind), and the simulated fleet listens on loopback only.  This library
 * turns every bind() of an IPv4 wildcard address into a bind() of 127.0.0.1 (same port) and
 * refuses an IPv6 wildcard bind with EADDRNOTAVAIL (Slurm then falls back to IPv4).  Anything
 * else is passed through unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len)
{
    static bind_fn real_bind;
    struct sockaddr_in lo;

    if (!real_bind)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (!real_bind) {
        errno = ENOSYS;
        return -1;
    }
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        memcpy(&lo, addr, sizeof(lo));
        if (lo.sin_addr.s_addr == htonl(INADDR_ANY)) {
            lo.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&lo, sizeof(lo));
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *six = (const struct sockaddr_in6 *)addr;
        if (!memcmp(&six->sin6_addr, &in6addr_any, sizeof(in6addr_any))) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
    }
    return real_bind(fd, addr, len);
}
