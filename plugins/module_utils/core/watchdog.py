# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This file is part of the PRIVATE core of the gpufleet.reclaim collection. It can change at any time.
"""Driver reads under a deadline: a hung vendor library call cannot be interrupted in-process.

``run(func, timeout)`` forks a child that runs ``func()`` and sends back its (pickled) result through
a pipe; while it works the child reports which call it is in (``progress()``, called by the backends:
NVML calls are traced through ``traced()``).  When the deadline passes first, the parent sends SIGKILL
to that child, by the pid fork() returned (it is ours and not yet reaped, so the pid cannot have been
reused), reaps it if it dies (a process stuck in the kernel driver may only die when the driver lets
go: it is then left to init, and the error says so) and raises DriverHung naming the call.  A child
that dies without a result (the vendor library crashed) raises DriverCrashed.  The parent never loads
the vendor library, so a GPU reset afterwards has no session of ours to wait for.
"""

from __future__ import annotations

import os
import pickle  # nosec - only our own forked child writes to the pipe
import select
import signal
import struct
import time

from .errors import GpuFleetError

# Module option and guard setting defaults (seconds).
DEFAULT_MODULE_TIMEOUT = 30.0
DEFAULT_TICK_TIMEOUT = 20.0
MAX_TIMEOUT = 3600.0
# How long the parent waits for a killed child to be reaped (a child in D state does not die at once).
REAP_WAIT = 1.0

_HEADER = struct.Struct('!cI')
_child_fd = None          # in the child: the pipe's write end
_where = {}               # in the child: the GPU being read (vendor, gpu, pci_bus_id)


class DriverHung(GpuFleetError):
    """A driver read did not finish within ``timeout_s``; ``details`` is the ``driver_hung`` fact."""

    def __init__(self, call, timeout_s, vendor=None, gpu=None, pci_bus_id=None, reaped=True):
        self.details = {'call': call, 'vendor': vendor, 'gpu': gpu, 'pci_bus_id': pci_bus_id, 'timeout_s': timeout_s,
                        'message': None}
        where = ''
        if gpu is not None:
            where = ' on %s GPU %s%s' % (vendor or 'the', gpu, ' (%s)' % pci_bus_id if pci_bus_id else '')
        text = 'the GPU driver did not answer within %ss: %s hung%s; the read was stopped' % (
            _seconds(timeout_s), call or 'the read', where)
        if not reaped:
            text += ' (the reading process is stuck in the kernel driver and could not be reaped: reboot the node)'
        self.details['message'] = text
        super(DriverHung, self).__init__(text)


class DriverCrashed(GpuFleetError):
    """The child reading the driver died without a result (the vendor library crashed)."""

    def __init__(self, call, how):
        self.call = call
        super(DriverCrashed, self).__init__('the GPU driver library crashed (%s) in %s; nothing was read' % (how, call or 'the read'))


def _seconds(value):
    return ('%g' % value) if isinstance(value, (int, float)) else str(value)


def option():
    """The argument spec of the ``driver_timeout`` option of gpu_facts, gpu_audit, gpu_kill, gpu_reset and gpu_remediate: one
    definition (documented by the doc fragment gpufleet.reclaim._attributes.DRIVER_TIMEOUT)."""
    return dict(type='float', default=DEFAULT_MODULE_TIMEOUT)


def check_timeout(field, value):
    """``value`` as a float timeout in seconds (None: no watchdog); raises InvalidArgument naming ``field``."""
    from .errors import InvalidArgument  # pylint: disable=import-outside-toplevel
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT:
        raise InvalidArgument(field, value, 'expected a number of seconds above 0 and at most %d' % MAX_TIMEOUT)
    return float(value)


def active():
    """True in a watchdog child (where progress is reported)."""
    return _child_fd is not None


def _send(kind, data):
    payload = _HEADER.pack(kind, len(data)) + data
    view = memoryview(payload)
    while view:
        written = os.write(_child_fd, view)
        view = view[written:]


def where(vendor=None, gpu=None, pci_bus_id=None):
    """In a watchdog child: the GPU the following calls are about (no-op elsewhere)."""
    if _child_fd is not None:
        _where.clear()
        _where.update(vendor=vendor, gpu=gpu, pci_bus_id=pci_bus_id)


def progress(call):
    """In a watchdog child: tell the parent which call starts now (no-op elsewhere)."""
    if _child_fd is not None:
        _send(b'P', pickle.dumps((call, _where.get('vendor'), _where.get('gpu'), _where.get('pci_bus_id')), 2))


class _Traced(object):
    """A vendor module whose ``nvml*`` functions report progress() before they run."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if callable(value) and name.startswith(('nvml', 'amdsmi_')) and not isinstance(value, type):
            def call(*args, **kwargs):
                progress(name)
                return value(*args, **kwargs)
            call.__name__ = name
            return call
        return value


def traced(module):
    """``module`` with its calls reported (in a watchdog child), else ``module`` itself."""
    return _Traced(module) if _child_fd is not None and module is not None else module


def _frames(buffer):
    """Complete (kind, data) frames at the start of ``buffer`` and the rest."""
    frames = []
    while len(buffer) >= _HEADER.size:
        kind, size = _HEADER.unpack(bytes(buffer[:_HEADER.size]))
        if len(buffer) < _HEADER.size + size:
            break
        frames.append((kind, bytes(buffer[_HEADER.size:_HEADER.size + size])))
        del buffer[:_HEADER.size + size]
    return frames, buffer


def _reap(pid, wait):
    """waitpid(pid) for at most ``wait`` seconds; the status, or None when it did not end."""
    deadline = time.monotonic() + wait
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _close_inherited(keep):
    """Close every descriptor above stderr but ``keep``: a child that outlives its parent (stuck in the kernel
    driver) must not hold the parent's files open - the guard's tick lock above all."""
    try:
        fds = [int(name) for name in os.listdir('/proc/self/fd')]
    except OSError:
        fds = range(3, 1024)
    for fd in fds:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child(func, write_fd):
    global _child_fd  # pylint: disable=global-statement
    _child_fd = write_fd
    code = 0
    _close_inherited(write_fd)
    os.environ['_GPUFLEET_WATCHDOG'] = str(os.getppid())   # says "a watchdog child" (diagnostics, the simulator's fault knob)
    try:
        try:
            result = ('ok', func())
        except BaseException as exc:  # pylint: disable=broad-except
            result = ('error', exc)
        try:
            data = pickle.dumps(result, 2)
            pickle.loads(data)  # nosec - ours; an exception whose class cannot be rebuilt is passed as text
        except Exception as exc:  # pylint: disable=broad-except
            text = str(result[1]) if result[0] == 'error' else 'the driver read returned what cannot be passed back: %s' % exc
            data = pickle.dumps(('error', GpuFleetError(text)), 2)
        _send(b'R', data)
    except BaseException:  # pylint: disable=broad-except
        code = 70
    finally:
        os._exit(code)  # never return into the parent's code, never run its exit handlers


def run(func, timeout):
    """``func()`` in a forked child under a deadline of ``timeout`` seconds; its result, or its exception
    re-raised; DriverHung when the deadline passes, DriverCrashed when the child dies without a result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        _child(func, write_fd)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    buffer = bytearray()
    last = (None, None, None, None)
    result = None
    try:
        while result is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _w, _x = select.select([read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break  # the child ended (or closed the pipe) without a result
            buffer.extend(chunk)
            frames, buffer = _frames(buffer)
            for kind, data in frames:
                if kind == b'P':
                    last = pickle.loads(data)  # nosec - our own child
                elif kind == b'R':
                    result = pickle.loads(data)  # nosec - our own child
    finally:
        os.close(read_fd)
    if result is not None:
        if _reap(pid, REAP_WAIT) is None:   # it sent its result: it is on its way out
            os.kill(pid, signal.SIGKILL)
            _reap(pid, REAP_WAIT)
        status, value = result
        if status == 'ok':
            return value
        raise value
    status = _reap(pid, 0.2) if time.monotonic() < deadline else None
    if status is not None:   # it died on its own, without a result
        how = 'signal %d' % os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exit status %d' % os.WEXITSTATUS(status)
        raise DriverCrashed(last[0], how)
    os.kill(pid, signal.SIGKILL)    # our own child, by the pid fork() gave us; not reaped yet, so not reused
    reaped = _reap(pid, REAP_WAIT) is not None
    call, vendor, gpu, pci_bus_id = last
    raise DriverHung(call, timeout, vendor=vendor, gpu=gpu, pci_bus_id=pci_bus_id, reaped=reaped)
