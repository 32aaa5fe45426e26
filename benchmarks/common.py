# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Shared helpers of the benchmarks: timing, median and spread, ratios, RSS, the simulated node.

Everything here is stdlib only (Python >= 3.8), so any benchmark script can import it:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

* ``run_child(argv, ...)`` runs one command and returns its wall time, CPU time (user + system of
  the command and every descendant it waited for, from ``wait4``) and peak RSS.
* ``in_process(fn)`` times a call in this process (wall and CPU).
* ``stats(values)`` / ``fmt(stats)``: median with its spread (min-max) over the runs; ``percentile(values, 0.9)``;
  ``ratios(a, b)``: per-run ratios a[i] / b[i] (figures taken side by side in the same run).
* ``linear_fit(xs, ys)``: least-squares slope, intercept and R^2 (growth with the work).
* ``Sleepers(n)``: n cheap host processes (``pause()``) in one process group, torn down by us;
  ``resize(n, fds)`` gives the new ones ``fds`` descriptors each (a user's descriptor flood).
* ``run_isolated(script, argv)``: the benchmark again in a PID namespace of its own (root).
* ``SimNode``: a simulated GPU node (tests/sim) in a temp dir; ``spawn_many`` starts real workloads.
* ``Agent``: ``gpufleet-guard`` installed the way the guard role does it, in a temp dir.
* ``interleaved(commands, names, reps)``: repetitions in a rotating order; ``figures(entries)``.
* ``machine_info()``, ``dist_version()``, ``rewrite_section()`` (the docs/benchmarks.md markers).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, 'tests', 'sim')
GPUSIM = os.path.join(SIM, 'gpusim')
SIM_BUILD = os.environ.get('GPUFLEET_SIM_BUILD') or os.path.join(SIM, 'build')
SHIM = os.path.join(SIM_BUILD, 'libnvidia-ml.so.1')
MODULE_UTILS = os.path.join(ROOT, 'plugins', 'module_utils')
# Build outputs of the benchmarks (git-ignored with the rest of build/).
BENCH_BUILD = os.environ.get('GPUFLEET_BENCH_BUILD') or os.path.join(ROOT, 'build', 'bench')
DOCS = os.path.join(ROOT, 'docs', 'benchmarks.md')


# ---------------------------------------------------------------------------- statistics
def stats(values):
    """``{'median', 'min', 'max', 'n'}`` of a non-empty list of numbers."""
    values = sorted(values)
    count = len(values)
    if not count:
        raise ValueError('no values')
    mid = count // 2
    median = values[mid] if count % 2 else (values[mid - 1] + values[mid]) / 2.0
    return {'median': median, 'min': values[0], 'max': values[-1], 'n': count}


def percentile(values, fraction):
    """The value below which ``fraction`` (0-1) of a non-empty list lies (nearest rank: p90 of 10 runs is the 9th)."""
    values = sorted(values)
    if not values:
        raise ValueError('no values')
    if not 0 <= fraction <= 1:
        raise ValueError('fraction %r is not within 0-1' % (fraction,))
    rank = max(1, -(-int(round(fraction * 1000)) * len(values) // 1000))
    return values[min(rank, len(values)) - 1]


def ratios(numerators, denominators):
    """Per-run ratios ``a[i] / b[i]`` (same run, same conditions); runs with a zero denominator are left out."""
    return [a / b for a, b in zip(numerators, denominators) if b]


def fmt(stat, scale=1.0, digits=0, unit=''):
    """``'123 (118-131)'``: the median and the spread (min-max) over the runs, scaled."""
    if stat is None:
        return '-'
    pattern = '%%.%df' % digits
    median = pattern % (stat['median'] * scale)
    if stat.get('n', 1) <= 1 or stat['min'] == stat['max']:
        return median + unit
    return '%s%s (%s-%s)' % (median, unit, pattern % (stat['min'] * scale), pattern % (stat['max'] * scale))


def linear_fit(xs, ys):
    """Least squares ``y = slope * x + intercept``: ``{'slope', 'intercept', 'r2', 'n'}`` (r2 None under 3 points)."""
    count = len(xs)
    if count < 2:
        return {'slope': None, 'intercept': None, 'r2': None, 'n': count}
    mean_x = sum(xs) / float(count)
    mean_y = sum(ys) / float(count)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    if not sxx:
        return {'slope': None, 'intercept': None, 'r2': None, 'n': count}
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    syy = sum((y - mean_y) ** 2 for y in ys)
    r2 = 1.0 - sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys)) / syy if syy else None
    return {'slope': slope, 'intercept': intercept, 'r2': r2 if count > 2 else None, 'n': count}


# ---------------------------------------------------------------------------- measuring
class Measurement(object):
    """One command: wall and CPU seconds (the command and its waited-for descendants), peak RSS in KiB."""

    def __init__(self, argv, wall_s, user_s, sys_s, maxrss_kib, returncode, output):
        self.argv = argv
        self.wall_s = wall_s
        self.user_s = user_s
        self.sys_s = sys_s
        self.cpu_s = user_s + sys_s
        self.maxrss_kib = maxrss_kib
        self.returncode = returncode
        self.output = output  # stdout and stderr together (bytes), when captured

    def text(self):
        return (self.output or b'').decode('utf-8', 'replace')

    def to_dict(self):
        return {'wall_s': self.wall_s, 'cpu_s': self.cpu_s, 'user_s': self.user_s, 'sys_s': self.sys_s,
                'maxrss_kib': self.maxrss_kib, 'rc': self.returncode}


def session_pss_kib(sid, proc_root='/proc'):
    """The summed proportional set size (KiB, /proc/PID/smaps_rollup) of every process in session
    ``sid``: the memory a command and all its forks hold together, shared pages counted once."""
    total = 0
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        try:
            with open('%s/%s/stat' % (proc_root, entry), 'rb') as handle:
                fields = handle.read().rsplit(b')', 1)[1].split()
            if int(fields[3]) != sid:   # field 6 (session) is the 4th after the comm
                continue
            with open('%s/%s/smaps_rollup' % (proc_root, entry), 'rb') as handle:
                for line in handle.read().split(b'\n'):
                    if line.startswith(b'Pss:'):
                        total += int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
    return total


class _PssSampler(threading.Thread):
    """The peak of session_pss_kib(sid), sampled every ``interval`` seconds until stopped."""

    def __init__(self, sid, interval=1.0):
        threading.Thread.__init__(self)
        self.daemon = True
        self.sid, self.interval, self.peak_kib, self.done = sid, interval, 0, threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak_kib = max(self.peak_kib, session_pss_kib(self.sid))
            self.done.wait(self.interval)


def run_child(argv, env=None, cwd=None, timeout=600.0, capture=True, stdin=None, sample_pss=False):
    """Run ``argv`` once and measure it with ``wait4``.

    The child gets its own process group; on ``timeout`` that group (only) is killed and the
    Measurement has returncode -9.  ``ru_maxrss`` from wait4 is the largest peak RSS among the
    child and the descendants it waited for (Linux), i.e. the peak of the biggest process.
    ``sample_pss``: also sample the summed PSS of the child's whole session once a second (the
    Measurement's ``peak_pss_kib``: a controller with its forks, shared pages counted once).
    """
    out = tempfile.TemporaryFile() if capture else subprocess.DEVNULL
    try:
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, _kill_group, (proc.pid,))
        timer.daemon = True
        timer.start()
        sampler = _PssSampler(proc.pid) if sample_pss else None
        if sampler is not None:
            sampler.start()
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            if sampler is not None:
                sampler.done.set()
                sampler.join()
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, 'waitstatus_to_exitcode') else _exit_code(status)
        output = None
        if capture:
            out.seek(0)
            output = out.read()
        meas = Measurement(argv, wall, usage.ru_utime, usage.ru_stime, usage.ru_maxrss, proc.returncode, output)
        meas.peak_pss_kib = sampler.peak_kib if sampler is not None else None
        return meas
    finally:
        if capture:
            out.close()


def _exit_code(status):
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)  # the group run_child created for this child
    except OSError:
        pass


def interleaved(commands, names, reps, inspect=None, ok=None, timeout=300):
    """``reps`` rounds; each runs every command of ``names`` once, the order rotated by one per round.

    ``commands``: name -> (argv or None to leave it out, env).  ``inspect(name, measurement)`` returns
    a dict merged into the round's entry (e.g. what the output shows); ``ok(name, measurement)`` says
    whether the exit status is fine (default: 0).  Returns (runs: name -> [entry], notes: name -> [text]).
    """
    names = list(names)
    runs = dict((name, []) for name in names)
    notes = dict((name, []) for name in names)
    for rep in range(reps):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            argv, env = commands[name]
            if argv is None:
                continue
            meas = run_child(argv, env=env, timeout=timeout)
            entry = meas.to_dict()
            if inspect is not None:
                entry.update(inspect(name, meas))
            if not (ok(name, meas) if ok is not None else meas.returncode == 0):
                notes[name].append('exit %s: %s' % (meas.returncode, meas.text().strip()[-300:]))
            runs[name].append(entry)
    return runs, notes


def figures(entries, notes=(), keys=('wall_s', 'cpu_s', 'maxrss_kib')):
    """Median and spread of ``keys`` over a command's entries, its notes, and the least it ever saw (``seen``)."""
    fig = {'runs': entries, 'notes': sorted(set(notes))}
    for key in keys:
        fig[key] = stats([e[key] for e in entries])
    seen = [e['seen'] for e in entries if e.get('seen') is not None]
    fig['seen'] = min(seen) if seen else None
    return fig


def in_process(fn, *args, **kwargs):
    """Call ``fn`` here; returns (result, wall seconds, CPU seconds of this process)."""
    wall0, cpu0 = time.monotonic(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - wall0, time.process_time() - cpu0


def peak_rss_kib():
    """Peak RSS of this process so far (KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def private_collections(root=ROOT):
    """A private ANSIBLE_COLLECTIONS_PATH that links to this tree (or to the checkout ``root``; never
    build/collections: others use it); the caller removes it (shutil.rmtree)."""
    base = tempfile.mkdtemp(prefix='gpufleet-bench-coll-')
    os.makedirs(os.path.join(base, 'ansible_collections', 'gpufleet'))
    os.symlink(root, os.path.join(base, 'ansible_collections', 'gpufleet', 'reclaim'))
    return base


ISOLATED = 'GPUFLEET_BENCH_ISOLATED'


def isolated():
    """True inside the PID namespace that ``run_isolated`` made."""
    return os.environ.get(ISOLATED) == '1'


def run_isolated(script, argv):
    """Run ``script`` with ``argv`` again in a PID (and mount) namespace of its own, when root and util-linux
    ``unshare`` allow it and we are not in it yet: /proc then shows the processes the benchmark starts and
    nothing else, and whatever is left in it ends with it.  Returns the exit status, or None when the caller
    should measure here (not root, no unshare, or isolated already)."""
    if isolated() or os.geteuid() != 0 or not shutil.which('unshare'):
        return None
    env = dict(os.environ, **{ISOLATED: '1'})
    command = ['unshare', '--pid', '--fork', '--mount', '--mount-proc', '--kill-child=SIGKILL', '--',
               sys.executable, os.path.abspath(script)] + list(argv)
    return subprocess.run(command, env=env, check=False).returncode


def ansible_bin():
    """The ``ansible`` command next to this interpreter, else the one on PATH (None: none)."""
    here = os.path.join(os.path.dirname(sys.executable), 'ansible')
    return here if os.access(here, os.X_OK) else shutil.which('ansible')


def parse_trees(specs):
    """``--tree LABEL=PATH`` values as [(label, path)]; exits with a clear message on a bad one."""
    trees = []
    for spec in specs:
        label, sep, path = spec.partition('=')
        if not sep or not label or not os.path.isdir(os.path.join(path, 'ansible_collections', 'gpufleet', 'reclaim')):
            sys.exit('--tree: invalid value %r: expected LABEL=PATH, PATH holding ansible_collections/gpufleet/reclaim' % spec)
        trees.append((label, path))
    return trees


def machine_busy_s(stat_path='/proc/stat'):
    """CPU-seconds the whole machine has spent busy since boot (user, nice, system, irq, softirq of every CPU).

    The difference over a run, minus the controller's own CPU, is what the simulated nodes (and anything else
    running) spent: on a machine doing nothing else, the nodes' CPU."""
    with open(stat_path) as handle:
        fields = handle.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / float(os.sysconf('SC_CLK_TCK'))


def process_count(proc_root='/proc'):
    """Processes (not threads) visible in ``proc_root`` now."""
    return sum(1 for name in os.listdir(proc_root) if name.isdigit())


# ---------------------------------------------------------------------------- host sleepers
SLEEPERS_C = r'''
/* gpufleet benchmark: children that pause() until we go.  Each line "N [F]" on stdin sets how many
 * there are (fork more, or SIGKILL and reap the newest) and answers "ok N"; the children it forks then
 * hold F more descriptors each (dup2 of /dev/null onto fds 3..F+2, RLIMIT_NOFILE raised for them as far
 * as the hard limit, which root may raise to fs.nr_open).  EOF (our benchmark closed the pipe or died)
 * kills and reaps them all, so nothing is left for init to reap. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t *kids;
static long made, cap;

static void shrink(long n) {
    long i;
    for (i = n; i < made; i++) kill(kids[i], SIGKILL);
    for (i = n; i < made; i++) while (waitpid(kids[i], NULL, 0) < 0 && errno == EINTR) {}
    made = n;
}

static void hold(long fds) {
    struct rlimit lim;
    long fd, null;
    if (fds <= 0) return;
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
        rlim_t want = (rlim_t)fds + 3;
        lim.rlim_cur = lim.rlim_max;
        if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < want) {
            struct rlimit more = {want, want};
            if (setrlimit(RLIMIT_NOFILE, &more) == 0) lim = more;  /* root, with CAP_SYS_RESOURCE */
        }
        setrlimit(RLIMIT_NOFILE, &lim);
    }
    null = open("/dev/null", O_RDONLY);
    if (null < 0) return;
    for (fd = 3; fd < fds + 3; fd++)
        if (fd != null && dup2((int)null, (int)fd) < 0) break;
}

static int grow(long n, long fds, pid_t parent) {
    if (n > cap) {
        pid_t *more = realloc(kids, n * sizeof(pid_t));
        if (!more) return -1;
        kids = more; cap = n;
    }
    while (made < n) {
        pid_t pid = fork();
        if (pid < 0) return -1;
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(0);
            hold(fds);
            for (;;) pause();
        }
        kids[made++] = pid;
    }
    return 0;
}

int main(void) {
    char line[64];
    pid_t parent = getpid();
    signal(SIGPIPE, SIG_IGN);
    while (fgets(line, sizeof line, stdin)) {
        char *rest;
        long n = strtol(line, &rest, 10), fds = strtol(rest, NULL, 10);
        if (n < 0) n = 0;
        if (n < made) shrink(n); else grow(n, fds, parent);
        printf("ok %ld\n", made);
        fflush(stdout);
    }
    shrink(0);
    return 0;
}
'''


def build_sleepers():
    """Compile the sleeper forker (gcc) into BENCH_BUILD once; returns its path."""
    exe = os.path.join(BENCH_BUILD, 'sleepers')
    src = exe + '.c'
    if os.path.exists(src) and os.path.exists(exe):
        with open(src) as handle:
            if handle.read() == SLEEPERS_C:
                return exe
    os.makedirs(BENCH_BUILD, exist_ok=True)
    with open(src, 'w') as handle:
        handle.write(SLEEPERS_C)
    subprocess.run([os.environ.get('CC', 'gcc'), '-O2', '-o', exe + '.tmp', src], check=True)
    os.rename(exe + '.tmp', exe)
    return exe


class Sleepers(object):
    """Host processes that do nothing (``pause()``): children of one forker we started.

    ``resize(n)`` forks more or SIGKILLs (and reaps) the newest; ``stop()`` closes the forker's
    stdin, which ends and reaps every child.  If this Python process dies the pipe closes the same
    way (and the children have PDEATHSIG).  Each child keeps its three stdio fds (a pipe, /dev/null),
    and the children forked by ``resize(n, fds)`` hold ``fds`` more each (descriptors of /dev/null, as
    far as RLIMIT_NOFILE lets them: see ``descriptors()``).
    """

    def __init__(self, count=0):
        self.count = 0
        self.proc = subprocess.Popen([build_sleepers()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.resize(count)

    def pids(self, proc_root='/proc'):
        """The pids of the forker's children now (their parent is the forker we started)."""
        found = []
        for name in os.listdir(proc_root):
            if name.isdigit():
                try:
                    with open('%s/%s/stat' % (proc_root, name), 'rb') as handle:
                        ppid = int(handle.read().rsplit(b')', 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == self.proc.pid:
                    found.append(int(name))
        return sorted(found)

    def descriptors(self, proc_root='/proc'):
        """How many descriptors the children hold in all (the size of each fd directory: Linux 6.2+; else listed)."""
        total = 0
        for pid in self.pids(proc_root):
            path = '%s/%d/fd' % (proc_root, pid)
            try:
                size = os.stat(path).st_size
                total += size if size else len(os.listdir(path))
            except OSError:
                continue
        return total

    def resize(self, count, fds=0):
        count = max(0, int(count))
        self.proc.stdin.write(b'%d %d\n' % (count, max(0, int(fds))))
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().decode()
        made = int(line.split()[1]) if line.startswith('ok ') else -1
        self.count = max(made, 0)
        if made != count:
            raise RuntimeError('the sleeper forker has %d of %d processes (ulimit -u? pid_max?)' % (made, count))
        return self.count

    def to_total(self, total, proc_root='/proc'):
        """Resize so that ``total`` processes are visible in ``proc_root`` now (within the sleepers' reach)."""
        return self.resize(self.count + total - process_count(proc_root))

    def stop(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our forker's own group
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None
        self.count = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------- the simulated node
# argv: GPUSIM STATE GPUS MIB WORKLOAD-ARGV... -- INDEX...; prints one pid a line (gpusim's own output).
_BATCH_SPAWN = r'''
import contextlib, importlib.machinery, importlib.util, sys
gpusim, state, gpus, mib, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5].split()
cut = sys.argv.index('--', 6)
workload, indexes = sys.argv[6:cut], sys.argv[cut + 1:]
loader = importlib.machinery.SourceFileLoader('gpusim_cli', gpusim)
spec = importlib.util.spec_from_loader('gpusim_cli', loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
real_locked, pending = module.gs.locked, []


@contextlib.contextmanager
def collect(path=None, create=None):
    # spawn's one state change is appending its entry: keep it, register the batch once at the end
    view = {'processes': []}
    yield view
    pending.extend(view['processes'])


module.gs.locked = collect
code = 0
try:
    for index in indexes:
        code = module.main(['spawn', '--state', state, '--gpu', str(int(index) % gpus), '--mib', mib] + options + ['--']
                           + workload + [index])
        sys.stdout.flush()
        if code:
            break
finally:
    module.gs.locked = real_locked
    with real_locked(state) as current:
        current.setdefault('processes', []).extend(pending)
sys.exit(code)
'''


class SimNode(object):
    """A simulated NVIDIA node in a temp dir: ``state.json`` and fake device files in ``dev/``."""

    def __init__(self, gpus=8, release_delay_ms=0, python=None, prefix='gpufleet-bench-'):
        self.python = python or sys.executable
        self.root = tempfile.mkdtemp(prefix=prefix)
        os.chmod(self.root, 0o755)
        self.state = os.path.join(self.root, 'state.json')
        self.dev = os.path.join(self.root, 'dev')
        self.gpus = gpus
        self.pids = []
        self.gpusim('init', '--gpus', gpus, '--dev-dir', self.dev, '--create-dev-files',
                    '--release-delay-ms', release_delay_ms)

    def env(self, base=None):
        """``base`` (default os.environ) plus what ``gpusim env`` exports for this node."""
        env = dict(os.environ if base is None else base)
        env['GPU_SIM_STATE'] = self.state
        env['LD_LIBRARY_PATH'] = SIM_BUILD + (':' + env['LD_LIBRARY_PATH'] if env.get('LD_LIBRARY_PATH') else '')
        env['PATH'] = '%s:%s:%s' % (os.path.join(SIM, 'bin'), SIM, env.get('PATH', '/usr/bin:/bin'))
        return env

    def gpusim(self, *args):
        env = dict(os.environ, GPU_SIM_STATE=self.state)
        proc = subprocess.run([self.python, GPUSIM] + [str(a) for a in args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError('gpusim %s: %s' % (' '.join(map(str, args)), proc.stderr.decode('utf-8', 'replace')))
        return proc.stdout.decode()

    def spawn_many(self, count, mib=256, argv=('python', 'train.py'), workers=2, options=()):
        """``count`` more workloads, round robin over the GPUs; returns their pids.  ``options``: more
        ``gpusim spawn`` options (``--ignore-term``).  Workload N runs ``ARGV N`` on GPU N % gpus.

        gpusim has no batch spawn, and ``gpusim spawn`` costs an interpreter start plus a rewrite of
        the whole state (pretty-printed JSON) per workload: O(n^2), minutes for 1,000.  So
        ``workers`` helper interpreters each load the gpusim script once and call its
        ``main(['spawn', ...])`` in a loop (gpusim's own fork, exec, report and entry), collect
        the entries it would append, and register them in one ``gpusim_state.locked()`` update.
        """
        first = len(self.pids)
        workers = max(1, min(workers, count))
        shares = [list(range(first + w, first + count, workers)) for w in range(workers)]
        procs = []
        for share in shares:
            args = [self.python, '-c', _BATCH_SPAWN, GPUSIM, self.state, str(self.gpus), str(mib), ' '.join(options)] + list(argv)
            procs.append(subprocess.Popen(args + ['--'] + [str(i) for i in share], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, env=dict(os.environ, GPU_SIM_STATE=self.state)))
        failures = []
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            self.pids.extend(int(line) for line in out.decode().split())
            if proc.returncode != 0:
                failures.append(err.decode('utf-8', 'replace').strip())
        if failures:
            raise RuntimeError('gpusim spawn failed: %s' % '; '.join(failures))
        return self.pids[first:]

    def show(self):
        return json.loads(self.gpusim('show'))

    def kill_all(self):
        """SIGKILL this node's workloads (gpusim signals only pids its state recorded, identity-checked)."""
        env = dict(os.environ, GPU_SIM_STATE=self.state)
        subprocess.run([self.python, GPUSIM, 'kill-all', '--prune'], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=300, check=False)
        self.pids = []

    def close(self):
        self.kill_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------- the agent as deployed
class Agent(object):
    """``gpufleet-guard`` as the guard role installs it: a launcher and a copy of the core as ``gpufleet_core``.

    The copy is byte-compiled once (as the first root run of a deployed agent leaves it), so every
    run uses the same code and none pays for compiling sources that changed meanwhile.  ``policy``
    (text) goes to ``<root>/etc/gpufleet/policy.yaml``; pass ``--root agent.root`` to the agent.
    """

    def __init__(self, base, policy=None, core=None, fast_exit=True):
        """``core``: the core directory to install (default: this checkout's; another checkout's for a before/after
        run).  ``fast_exit``: a ``list`` ends with os._exit, as the guard role's launcher does since issue #21."""
        self.root = os.path.join(base, 'agent-root')
        self.lib = os.path.join(base, 'lib')
        os.makedirs(self.lib)
        shutil.copytree(core or os.path.join(MODULE_UTILS, 'core'), os.path.join(self.lib, 'gpufleet_core'),
                        ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        subprocess.run([sys.executable, '-m', 'compileall', '-q', os.path.join(self.lib, 'gpufleet_core')],
                       stdout=subprocess.DEVNULL, check=True)
        self.launcher = os.path.join(base, 'gpufleet-guard')
        with open(self.launcher, 'w') as handle:
            # as roles/guard/templates/gpufleet-guard.j2 writes it (the collector off for one-shot runs)
            handle.write('#!%s\nimport gc\nimport os\nimport sys\n\ngc.disable()\nsys.path.insert(0, %r)\n'
                         'from gpufleet_core.cli import main  # noqa: E402\n\ncode = main()\n' % (sys.executable, self.lib))
            if fast_exit:
                handle.write('if sys.argv[1:2] == [\'list\']:\n    try:\n        sys.stdout.flush()\n    except OSError:\n'
                             '        code = 120\n    os._exit(code or 0)\n')
            handle.write('sys.exit(code)\n')
        os.chmod(self.launcher, 0o755)
        if policy is not None:
            path = os.path.join(self.root, 'etc', 'gpufleet', 'policy.yaml')
            os.makedirs(os.path.dirname(path))
            with open(path, 'w') as handle:
                handle.write(policy)

    def command(self, *args):
        """argv of ``gpufleet-guard ARGS...`` (the launcher, run by this interpreter)."""
        return [sys.executable, self.launcher] + [str(a) for a in args]

    def code(self, code, *args):
        """argv of ``python -c CODE LIB ARGS...``: code that imports ``gpufleet_core`` from ``sys.argv[1]``."""
        return [sys.executable, '-c', code, self.lib] + [str(a) for a in args]


def cleanup(sleepers=None, node=None, base=None):
    """Tear down what a benchmark made: its sleepers, its simulated node (and workloads), its temp dir."""
    try:
        if sleepers is not None:
            sleepers.stop()
    finally:
        try:
            if node is not None:
                node.close()
        finally:
            if base:
                shutil.rmtree(base, ignore_errors=True)


def write_json(path, data):
    """Write ``data`` (figures) to ``path`` when a path is given."""
    if path:
        with open(path, 'w') as handle:
            json.dump(data, handle, indent=1, default=str)


# ---------------------------------------------------------------------------- context
def dist_version(name, python=None):
    """Installed version of distribution ``name`` (in this interpreter, or in ``python``'s), or None."""
    if python is None:
        try:
            from importlib.metadata import version  # pylint: disable=import-outside-toplevel
            return version(name)
        except Exception:  # pylint: disable=broad-except
            return None
    code = 'import importlib.metadata as m, sys\ntry:\n print(m.version(sys.argv[1]))\nexcept Exception:\n print("")'
    proc = subprocess.run([python, '-c', code, name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    return proc.stdout.decode().strip() or None


def tool_version(argv):
    """First line a ``--version``-like command prints, or None."""
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30, check=False)
    except OSError:
        return None
    lines = proc.stdout.decode('utf-8', 'replace').strip().splitlines()
    return lines[0].strip() if lines else None


def machine_info():
    """Date, CPU, cores, kernel, Python, load average: the header of every result."""
    cpu = None
    try:
        with open('/proc/cpuinfo') as handle:
            cpu = next((line.split(':', 1)[1].strip() for line in handle if line.startswith('model name')), None)
    except OSError:
        pass
    mem_gib = None
    try:
        with open('/proc/meminfo') as handle:
            for line in handle:
                if line.startswith('MemTotal:'):
                    mem_gib = round(int(line.split()[1]) / 1024.0 / 1024.0, 1)
    except (OSError, ValueError):
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
        'cpu': cpu, 'cores': cores, 'mem_gib': mem_gib, 'kernel': platform.release(),
        'os': _os_name(), 'python': platform.python_version(), 'loadavg': os.getloadavg(),
    }


def _os_name():
    try:
        with open('/etc/os-release') as handle:
            for line in handle:
                if line.startswith('PRETTY_NAME='):
                    return line.split('=', 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.system()


# ---------------------------------------------------------------------------- docs
def md_table(head, rows):
    """A markdown table of ``head`` and ``rows`` (cells as text)."""
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    lines.extend('| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows)
    return '\n'.join(lines)


def begin_marker(name):
    return '<!-- BEGIN %s (generated: edit outside the markers) -->' % name


def _find_begin(text, name):
    """(start, end) of the BEGIN marker of ``name`` in ``text`` (any comment after the name), or None."""
    match = re.search(r'<!-- BEGIN %s(?: \([^)\n]*\))? -->' % re.escape(name), text)
    return (match.start(), match.end()) if match else None


def end_marker(name):
    return '<!-- END %s -->' % name


def rewrite_section(body, name, path=DOCS, title=None):
    """Replace the text between the ``name`` markers of ``path`` with ``body``; other sections stay as they are.

    Without the markers the section is appended (after ``title`` when given).  The file is
    re-read under an flock and replaced atomically, so helpers appending to it meanwhile lose nothing.
    """
    end = end_marker(name)
    block = '%s\n%s\n%s' % (begin_marker(name), body.rstrip('\n'), end)
    lock_fd = os.open(os.path.join(tempfile.gettempdir(), 'gpufleet-benchmarks-md.lock'), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        text = ''
        if os.path.exists(path):
            with open(path) as handle:
                text = handle.read()
        found = _find_begin(text, name)
        stop = text.find(end, found[1]) if found else -1
        if found and stop >= 0:
            text = text[:found[0]] + block + text[stop + len(end):]
        else:
            if text and not text.endswith('\n'):
                text += '\n'
            text += ('\n' if text else '') + ('%s\n\n' % title if title else '') + block + '\n'
        tmp = '%s.tmp.%d' % (path, os.getpid())
        with open(tmp, 'w') as handle:
            handle.write(text)
        os.rename(tmp, path)
    finally:
        os.close(lock_fd)
