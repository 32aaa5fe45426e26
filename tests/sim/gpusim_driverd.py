# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpusim's driver daemon: lets users who cannot write the state register their own workloads (root runs it).

A real driver learns from the kernel which process allocates GPU memory; users cannot write its books.  The
simulated state is a root-owned file, so a non-root `gpusim spawn` (a Slurm job as alice) forks its workload
and then asks this daemon, over a Unix socket next to the state (`<state dir>/driver.sock`, mode 0666), to
record it.  The daemon trusts only what the kernel vouches for: the peer's pid and uid (SO_PEERCRED) and /proc.
It records a workload only when

* the workload (and each child, and the supervisor with a release delay) is alive with the start time given;
* it is the requesting process's child (the supervisor's child, the supervisor the requester's), and each
  child is the workload's child;
* every one of them runs as the requester's real uid;
* the GPU exists and is not lost.

The entry's `user` is the requester's account.  `record-exit` is accepted only from the entry's own
supervisor (pid and start time).  One request per connection, a JSON line each way; 5 s per connection.

  python gpusim_driverd.py --state PATH [--socket PATH]
"""

import argparse
import json
import os
import pwd
import socket
import struct
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gpusim_state as gs  # noqa: E402  pylint: disable=wrong-import-position

SOCKET_NAME = 'driver.sock'
MAX_REQUEST = 1 << 20


def socket_path(state_path):
    return os.path.join(os.path.dirname(os.path.abspath(state_path)), SOCKET_NAME)


class Refused(Exception):
    """The answer {"ok": false, "error": MESSAGE}."""


def _status(pid):
    """(ppid, real uid, starttime) of a live, non-zombie pid, else None."""
    try:
        with open('/proc/%d/stat' % pid, 'rb') as handle:
            raw = handle.read()
        with open('/proc/%d/status' % pid) as handle:
            uid = next(int(line.split()[1]) for line in handle if line.startswith('Uid:'))
    except (OSError, ValueError, StopIteration):
        return None
    fields = raw[raw.rindex(b')') + 2:].split()
    if fields[0] in (b'Z', b'X'):
        return None
    return int(fields[1]), uid, int(fields[19])


def _check(pid, start, parent, uid, what):
    status = _status(int(pid))
    if status is None or status[2] != int(start):
        raise Refused('%s %s is not alive with start time %s' % (what, pid, start))
    if status[0] != parent:
        raise Refused('%s %s is not the child of %d' % (what, pid, parent))
    if status[1] != uid:
        raise Refused('%s %s does not run as uid %d' % (what, pid, uid))


def register(state_path, entry, peer_pid, peer_uid):
    if not isinstance(entry, dict):
        raise Refused('entry must be an object')
    parent = peer_pid
    if entry.get('supervisor_pid') is not None:
        _check(entry['supervisor_pid'], entry.get('supervisor_starttime'), peer_pid, peer_uid, 'supervisor')
        parent = int(entry['supervisor_pid'])
    _check(entry.get('pid'), entry.get('starttime'), parent, peer_uid, 'workload')
    kids, starts = entry.get('children') or [], entry.get('children_starttime') or []
    if len(kids) != len(starts):
        raise Refused('children and children_starttime differ in length')
    for kid, start in zip(kids, starts):
        _check(kid, start, int(entry['pid']), peer_uid, 'child')
    entry = dict(entry, user=pwd.getpwuid(peer_uid).pw_name, exited_at=None)
    with gs.locked(state_path) as state:
        gpus = state.get('gpus', [])
        if not isinstance(entry.get('gpu'), int) or not 0 <= entry['gpu'] < len(gpus):
            raise Refused('no GPU %r' % (entry.get('gpu'),))
        if gpus[entry['gpu']].get('lost'):
            raise Refused('GPU %d is lost' % entry['gpu'])
        state.setdefault('processes', []).append(entry)


def record_exit(state_path, pid, exited_at, peer_pid):
    status = _status(peer_pid)
    with gs.locked(state_path) as state:
        for entry in state.get('processes', []):
            if entry.get('pid') == pid and entry.get('supervisor_pid') == peer_pid:
                if status is None or entry.get('supervisor_starttime') != status[2]:
                    raise Refused('the supervisor of %d is not the requester' % pid)
                if entry.get('exited_at') is None:
                    entry['exited_at'] = float(exited_at)
                return
    raise Refused('no workload %s supervised by %d' % (pid, peer_pid))


def handle(conn, state_path):
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize('3i'))
    peer_pid, peer_uid, _peer_gid = struct.unpack('3i', creds)
    data = b''
    while b'\n' not in data and len(data) < MAX_REQUEST:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    try:
        request = json.loads(data.decode('utf-8'))
        if request.get('op') == 'register':
            register(state_path, request.get('entry'), peer_pid, peer_uid)
        elif request.get('op') == 'record-exit':
            record_exit(state_path, int(request['pid']), request['exited_at'], peer_pid)
        else:
            raise Refused('unknown op %r' % (request.get('op'),))
        answer = {'ok': True}
    except (Refused, gs.StateError, ValueError, KeyError, TypeError) as exc:
        answer = {'ok': False, 'error': str(exc)}
    conn.sendall((json.dumps(answer) + '\n').encode())


def request(state_path, message, timeout=10.0):
    """Client side (gpusim spawn, _record-exit): send one request, raise gs.StateError with the refusal."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path(state_path))
        sock.sendall((json.dumps(message) + '\n').encode())
        data = b''
        while b'\n' not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise gs.StateError('the gpusim driver daemon at %s did not answer: %s' % (socket_path(state_path), exc))
    finally:
        sock.close()
    try:
        answer = json.loads(data.decode('utf-8'))
    except ValueError:
        raise gs.StateError('the gpusim driver daemon sent no answer')
    if not answer.get('ok'):
        raise gs.StateError('the gpusim driver daemon refused: %s' % answer.get('error'))


def serve(state_path, path):
    if os.path.lexists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen(64)
    while True:
        conn, _addr = server.accept()
        conn.settimeout(5.0)
        try:
            handle(conn, state_path)
        except OSError as exc:
            sys.stderr.write('gpusim driverd: %s\n' % exc)
        finally:
            conn.close()


def main(argv=None):
    parser = argparse.ArgumentParser(prog='gpusim_driverd.py', description=__doc__.split('\n', maxsplit=1)[0])
    parser.add_argument('--state', help='the state file (default: $GPU_SIM_STATE)')
    parser.add_argument('--socket')
    args = parser.parse_args(argv)
    state_path = gs.state_path(args.state)
    if os.geteuid() != 0:
        parser.error('runs as root (it writes the root-owned state)')
    serve(state_path, args.socket or socket_path(state_path))
    return 0


if __name__ == '__main__':
    sys.exit(main())
