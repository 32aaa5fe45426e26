/*
 * gpusim-workload: the simulated GPU workload started by `gpusim spawn`.
 *
 * GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
 *
 * gpusim execs this binary with argv exactly the user's ARGV, so nothing can be passed on the
 * command line.  The configuration arrives instead on the inherited fd 3 (read to EOF, then
 * closed) as NUL-terminated "key=value" entries; the report goes back on fd 4.  The process
 * environment is left exactly as gpusim built it.
 *
 * Keys: mode=work|supervise, exe=<this binary>, dev=<path> (repeated), ignore_term=0|1,
 * children=K, lifetime=S, child_lifetime=S, user=NAME uid=N gid=N, arg=<argv element>
 * (repeated, supervise mode), python=<interpreter>, gpusim=<script>, state=<state file>.
 *
 * mode=work (the workload):
 *   drop to uid/gid (when root), set comm to basename(argv[0]), open and keep open the device
 *   files that exist (create nothing, O_RDONLY), ignore SIGTERM if asked, fork K children that
 *   share those fds and sleep, report "ok PID START [CHILD START]...\n" on fd 4, then sleep
 *   (no CPU) until killed or the lifetime ends.  A dead child does not end the parent, and
 *   the children outlive a killed parent until killed or their own lifetime ends.
 *
 * mode=supervise (only when the state's release_delay_ms > 0):
 *   fork+exec the workload (mode=work, same argv and environment), wait for it, and then exec
 *   `python gpusim _record-exit` to write exited_at into the state under the lock.
 *
 * Errors before the report are sent as "err MESSAGE\n" on fd 4.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CFG_FD 3
#define REPORT_FD 4
#define MAX_DEVS 16
#define MAX_ARGS 4096
#define MAX_CHILDREN 256

struct config {
    int supervise;
    const char *exe;
    const char *devs[MAX_DEVS];
    int ndevs;
    int ignore_term;
    int children;
    double lifetime;
    double child_lifetime;
    const char *user;
    long uid;
    long gid;
    char *args[MAX_ARGS + 1];
    int nargs;
    const char *python;
    const char *gpusim;
    const char *state;
    char *raw;
    size_t rawlen;
};

static void report(const char *fmt, ...)
{
    char buf[4096];
    va_list ap;
    int n;
    size_t off = 0;

    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof(buf))
        n = (int)sizeof(buf) - 1;
    while (off < (size_t)n) {
        ssize_t w = write(REPORT_FD, buf + off, (size_t)n - off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        off += (size_t)w;
    }
}

static void fail(const char *fmt, ...)
{
    char buf[2048];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    report("err %s\n", buf);
    _exit(1);
}

static char *read_all(int fd, size_t *len)
{
    size_t cap = 4096, used = 0;
    char *buf = malloc(cap + 1);

    if (!buf)
        return NULL;
    for (;;) {
        ssize_t r;
        if (used == cap) {
            char *nb;
            cap *= 2;
            nb = realloc(buf, cap + 1);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
        }
        r = read(fd, buf + used, cap - used);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            free(buf);
            return NULL;
        }
        if (r == 0)
            break;
        used += (size_t)r;
    }
    buf[used] = '\0';
    *len = used;
    return buf;
}

static void parse_config(struct config *cfg)
{
    size_t pos = 0;

    memset(cfg, 0, sizeof(*cfg));
    cfg->lifetime = 3600.0;
    cfg->child_lifetime = -1.0;
    cfg->uid = -1;
    cfg->gid = -1;
    cfg->raw = read_all(CFG_FD, &cfg->rawlen);
    close(CFG_FD);
    if (!cfg->raw)
        fail("cannot read the configuration on fd %d: %s", CFG_FD, strerror(errno));
    while (pos < cfg->rawlen) {
        char *entry = cfg->raw + pos;
        size_t elen = strlen(entry);
        char *eq = strchr(entry, '=');
        const char *val;

        pos += elen + 1;
        if (!eq)
            continue;
        val = eq + 1;
        if (!strncmp(entry, "mode=", 5))
            cfg->supervise = !strcmp(val, "supervise");
        else if (!strncmp(entry, "exe=", 4))
            cfg->exe = val;
        else if (!strncmp(entry, "dev=", 4) && cfg->ndevs < MAX_DEVS)
            cfg->devs[cfg->ndevs++] = val;
        else if (!strncmp(entry, "ignore_term=", 12))
            cfg->ignore_term = atoi(val);
        else if (!strncmp(entry, "children=", 9))
            cfg->children = atoi(val);
        else if (!strncmp(entry, "lifetime=", 9))
            cfg->lifetime = strtod(val, NULL);
        else if (!strncmp(entry, "child_lifetime=", 15))
            cfg->child_lifetime = strtod(val, NULL);
        else if (!strncmp(entry, "user=", 5))
            cfg->user = val;
        else if (!strncmp(entry, "uid=", 4))
            cfg->uid = strtol(val, NULL, 10);
        else if (!strncmp(entry, "gid=", 4))
            cfg->gid = strtol(val, NULL, 10);
        else if (!strncmp(entry, "arg=", 4) && cfg->nargs < MAX_ARGS)
            cfg->args[cfg->nargs++] = (char *)val;
        else if (!strncmp(entry, "python=", 7))
            cfg->python = val;
        else if (!strncmp(entry, "gpusim=", 7))
            cfg->gpusim = val;
        else if (!strncmp(entry, "state=", 6))
            cfg->state = val;
    }
    cfg->args[cfg->nargs] = NULL;
    if (cfg->children < 0)
        cfg->children = 0;
    if (cfg->children > MAX_CHILDREN)
        cfg->children = MAX_CHILDREN;
    if (cfg->child_lifetime < 0)
        cfg->child_lifetime = cfg->lifetime;
}

static void reset_signals(void)
{
    static const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2, SIGCHLD};
    sigset_t none;
    size_t i;

    for (i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        signal(sigs[i], SIG_DFL);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

static double now_mono(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleep without burning CPU until the lifetime has passed (signals end it the usual way). */
static void sleep_for(double seconds)
{
    double deadline = now_mono() + seconds;

    for (;;) {
        double left = deadline - now_mono();
        struct timespec ts;

        if (left <= 0)
            return;
        if (left > 3600.0)
            left = 3600.0;
        ts.tv_sec = (time_t)left;
        ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
        nanosleep(&ts, NULL);
    }
}

static unsigned long long proc_starttime(pid_t pid)
{
    char path[64], buf[4096];
    int fd;
    ssize_t n;
    char *p, *save = NULL, *tok;
    int field = 2;

    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    p = strrchr(buf, ')');
    if (!p)
        return 0;
    for (tok = strtok_r(p + 1, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        field++;
        if (field == 22)
            return strtoull(tok, NULL, 10);
    }
    return 0;
}

static void drop_privileges(const struct config *cfg)
{
    if (cfg->uid < 0 || geteuid() != 0 || (long)geteuid() == cfg->uid)
        return;
    if (cfg->user && initgroups(cfg->user, (gid_t)cfg->gid) != 0)
        fail("initgroups(%s): %s", cfg->user, strerror(errno));
    if (!cfg->user && setgroups(0, NULL) != 0)
        fail("setgroups: %s", strerror(errno));
    if (setgid((gid_t)cfg->gid) != 0)
        fail("setgid(%ld): %s", cfg->gid, strerror(errno));
    if (setuid((uid_t)cfg->uid) != 0)
        fail("setuid(%ld): %s", cfg->uid, strerror(errno));
    /* a process started by its user is dumpable: /proc/PID files stay owned by that user */
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
}

static void set_comm(const char *argv0)
{
    const char *base;
    char name[16];

    if (!argv0 || !*argv0)
        return;
    base = strrchr(argv0, '/');
    base = base ? base + 1 : argv0;
    if (!*base)
        return;
    snprintf(name, sizeof(name), "%s", base);
    prctl(PR_SET_NAME, name, 0, 0, 0);
}

static int run_workload(const struct config *cfg, char **argv)
{
    int fds[MAX_DEVS];
    pid_t kids[MAX_CHILDREN];
    unsigned long long kid_start[MAX_CHILDREN];
    int nkids = 0, i;

    drop_privileges(cfg);
    set_comm(argv[0]);
    reset_signals();
    if (cfg->ignore_term)
        signal(SIGTERM, SIG_IGN);

    for (i = 0; i < cfg->ndevs; i++) {
        fds[i] = open(cfg->devs[i], O_RDONLY | O_NOCTTY | O_NONBLOCK);
        (void)fds[i]; /* kept open (and shared with the children) until exit */
    }

    /* children are reaped automatically: the parent never waits for them nor exits with them */
    signal(SIGCHLD, SIG_IGN);
    for (i = 0; i < cfg->children; i++) {
        pid_t pid = fork();

        if (pid == 0) {
            close(REPORT_FD);
            sleep_for(cfg->child_lifetime);
            _exit(0);
        }
        if (pid < 0)
            fail("fork: %s", strerror(errno));
        kids[nkids] = pid;
        kid_start[nkids] = proc_starttime(pid);
        nkids++;
    }

    report("ok %d %llu", (int)getpid(), proc_starttime(getpid()));
    for (i = 0; i < nkids; i++)
        report(" %d %llu", (int)kids[i], kid_start[i]);
    report("\n");
    close(REPORT_FD);

    sleep_for(cfg->lifetime);
    return 0;
}

static int run_supervisor(struct config *cfg)
{
    int pipefd[2];
    pid_t pid;
    int status;
    struct timespec ts;
    char pidbuf[32], atbuf[64];
    static const char work_mode[] = "mode=work";
    size_t off;

    prctl(PR_SET_NAME, "gpusim-superv", 0, 0, 0);
    reset_signals();
    if (!cfg->exe || cfg->nargs == 0)
        fail("supervise mode needs exe= and arg= entries");
    if (pipe(pipefd) != 0)
        fail("pipe: %s", strerror(errno));
    pid = fork();
    if (pid < 0)
        fail("fork: %s", strerror(errno));
    if (pid == 0) {
        close(pipefd[1]);
        if (pipefd[0] != CFG_FD) {
            dup2(pipefd[0], CFG_FD);
            close(pipefd[0]);
        }
        execv(cfg->exe, cfg->args);
        fail("exec %s: %s", cfg->exe, strerror(errno));
    }
    close(pipefd[0]);
    /* the same configuration, switched to mode=work (the last entry wins) */
    for (off = 0; off < cfg->rawlen;) {
        ssize_t w = write(pipefd[1], cfg->raw + off, cfg->rawlen - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    if (write(pipefd[1], "\0", 1) < 0 || write(pipefd[1], work_mode, sizeof(work_mode)) < 0) {
        /* the workload reports its own failure */
    }
    close(pipefd[1]);
    close(REPORT_FD);

    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR)
            break;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    if (!cfg->python || !cfg->gpusim || !cfg->state)
        return 0;
    snprintf(pidbuf, sizeof(pidbuf), "%d", (int)pid);
    snprintf(atbuf, sizeof(atbuf), "%lld.%06ld", (long long)ts.tv_sec, ts.tv_nsec / 1000);
    execl(cfg->python, cfg->python, "-E", "-s", cfg->gpusim, "_record-exit", "--state", cfg->state,
          "--pid", pidbuf, "--exited-at", atbuf, (char *)NULL);
    return 1;
}

int main(int argc, char **argv)
{
    struct config cfg;

    (void)argc;
    if (fcntl(CFG_FD, F_GETFD) < 0 || fcntl(REPORT_FD, F_GETFD) < 0) {
        fprintf(stderr, "gpusim-workload: start me with `gpusim spawn` (no configuration on fd %d/%d)\n",
                CFG_FD, REPORT_FD);
        return 2;
    }
    parse_config(&cfg);
    if (cfg.supervise)
        return run_supervisor(&cfg);
    return run_workload(&cfg, argv);
}
