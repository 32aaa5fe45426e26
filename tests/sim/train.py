# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A simulated training job run by a real Python interpreter (`gpusim spawn ... -- python3 train.py`).

gpusim spawn execs the interpreter with argv exactly the user's ARGV and its working directory here, so
/proc/PID/exe is the real python and the command line is `python3 train.py`.  The workload protocol is the
one of workload.c (tests/sim/README.md): the configuration arrives on fd 3 (NUL-separated key=value: dev,
children, lifetime, child_lifetime, ignore_term, user/uid/gid), the report `ok PID START [CHILD START]...`
goes back on fd 4, and gpusim registers the process (its memory counts while it or a recorded child lives).

The process drops to the user, keeps the GPU's device files open, forks K children that are detached (a
session of their own, so they outlive the parent and the parent's session, like a data loader a job forgot)
and share those files, then sleeps until killed or its lifetime ends.  Standard library only.
"""

import ctypes
import os
import signal
import sys
import time

CFG_FD = 3
REPORT_FD = 4
PR_SET_DUMPABLE = 4


def read_config():
    chunks = []
    while True:
        data = os.read(CFG_FD, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(CFG_FD)
    cfg = {'dev': []}
    for entry in b''.join(chunks).split(b'\0'):
        key, sep, value = os.fsdecode(entry).partition('=')
        if not sep:
            continue
        if key == 'dev':
            cfg['dev'].append(value)
        else:
            cfg[key] = value  # the last entry wins (the supervisor appends mode=work)
    return cfg


def report(text):
    data = text.encode()
    while data:
        data = data[os.write(REPORT_FD, data):]


def starttime(pid):
    with open('/proc/%d/stat' % pid, 'rb') as handle:
        raw = handle.read()
    return int(raw[raw.rindex(b')') + 2:].split()[19])


def drop_privileges(cfg):
    uid = int(cfg.get('uid', -1))
    if uid < 0 or os.geteuid() != 0 or os.geteuid() == uid:
        return
    gid = int(cfg['gid'])
    if cfg.get('user'):
        os.initgroups(cfg['user'], gid)
    else:
        os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    # a process started by its user is dumpable: /proc/PID stays the user's (as workload.c does)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def sleep_for(seconds):
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 3600.0))


def main():
    try:
        cfg = read_config()
        drop_privileges(cfg)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        if cfg.get('ignore_term') == '1':
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        held = []
        for path in cfg['dev']:
            try:
                held.append(os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK))
            except OSError:
                pass  # as workload.c: only the files that exist
        lifetime = float(cfg.get('lifetime', 3600.0))
        child_lifetime = float(cfg.get('child_lifetime', lifetime))
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
        kids = []
        for _index in range(int(cfg.get('children', 0))):
            pid = os.fork()
            if pid == 0:
                os.close(REPORT_FD)
                os.setsid()  # detached: it outlives the parent and its session
                sleep_for(child_lifetime)
                os._exit(0)  # pylint: disable=protected-access
            kids.append(pid)
        me = os.getpid()
        report('ok %d %d%s\n' % (me, starttime(me), ''.join(' %d %d' % (k, starttime(k)) for k in kids)))
        os.close(REPORT_FD)
    except Exception as exc:  # pylint: disable=broad-except
        try:
            report('err train.py: %s\n' % exc)
        except OSError:
            pass
        return 1
    sleep_for(lifetime)
    return 0


if __name__ == '__main__':
    sys.exit(main())
