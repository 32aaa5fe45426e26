# Copyright: contributors to gpufleet.reclaim
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Tests of the simulated fleet (tests/fleet/up, tests/fleet/down) over real SSH.

Run from the repository root:  PATH=/tmp/venv/bin:$PATH python -m pytest tests/fleet/tests
Needs root, util-linux unshare and openssh-server (up installs it when missing).
"""

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FLEET = os.path.dirname(HERE)
UP = os.path.join(FLEET, 'up')
DOWN = os.path.join(FLEET, 'down')
REBOOT = os.path.join(FLEET, 'reboot')
BIN = os.path.dirname(sys.executable)
ANSIBLE = os.path.join(BIN, 'ansible') if os.path.exists(os.path.join(BIN, 'ansible')) else 'ansible'
NODES = 4

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which('unshare'),
    reason='the fleet needs root and util-linux unshare')


def run(cmd, check=True, timeout=120, env=None):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False,
                          universal_newlines=True)
    if check and proc.returncode != 0:
        raise AssertionError('%s failed (%d):\n%s' % (' '.join(cmd), proc.returncode, proc.stdout))
    return proc


def py_env(tmp):
    """Environment for the CLIs and ansible: the test's interpreter first on PATH, private ControlPath dir."""
    env = dict(os.environ)
    env['PATH'] = BIN + os.pathsep + env.get('PATH', '')
    # Own ControlMaster sockets: a master left by another run would skip host key checking.
    env['ANSIBLE_SSH_CONTROL_PATH_DIR'] = os.path.join(tmp, 'cp')
    env['ANSIBLE_HOST_KEY_CHECKING'] = 'True'
    env['ANSIBLE_NOCOLOR'] = '1'
    return env


def up(fleet_dir, nodes, *extra, env=None):
    return run([sys.executable, UP, '--nodes', str(nodes), '--dir', fleet_dir] + list(extra), env=env, timeout=300)


def down(fleet_dir, env=None):
    return run([sys.executable, DOWN, '--dir', fleet_dir], env=env)


def ssh(fleet_dir, node, command, check=True):
    return run(['ssh', '-F', os.path.join(fleet_dir, 'ssh_config'), node, command], check=check, timeout=60)


def ansible(inventory, pattern, args, env, check=True):
    return run([ANSIBLE, pattern, '-i', inventory, '-o'] + args, check=check, env=env, timeout=180)


def stat_of(pid):
    try:
        with open('/proc/%d/stat' % pid) as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rindex(')') + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def is_running(pid, starttime):
    stat = stat_of(pid)
    return stat is not None and stat[2] == starttime and stat[0] not in ('Z', 'X')


def live_pids():
    for name in os.listdir('/proc'):
        if name.isdigit():
            stat = stat_of(int(name))
            if stat is not None and stat[0] not in ('Z', 'X'):
                yield int(name), stat


def hold_namespaces(records):
    """fds on the nodes' PID namespaces: holding them keeps the inode numbers from being reused."""
    fds = []
    for record in records:
        if is_running(record['init_pid'], record['init_starttime']):
            fds.append(os.open('/proc/%d/ns/pid' % record['init_pid'], os.O_RDONLY))
    assert len(fds) == len(records), 'every node init runs'
    return fds


def pids_in_namespaces(fds):
    wanted = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds}
    found = []
    for pid, _start in live_pids():
        try:
            st = os.stat('/proc/%d/ns/pid' % pid)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found.append(pid)
    return found


def descendants(roots):
    """Live host pids whose PPid chain reaches one of `roots`."""
    parent = {pid: stat[1] for pid, stat in live_pids()}
    found = []
    for pid in parent:
        seen, cur = set(), pid
        while cur in parent and cur not in seen and cur > 1:
            if cur in roots:
                found.append(pid)
                break
            seen.add(cur)
            cur = parent[cur]
    return found


def pids_mentioning(text):
    """Live host pids whose command line mentions `text` (the fleet dir is in every node's command line)."""
    found = []
    for pid, _start in live_pids():
        if pid == os.getpid():
            continue
        try:
            with open('/proc/%d/cmdline' % pid, 'rb') as handle:
                if text.encode() in handle.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def load_nodes(fleet_dir):
    with open(os.path.join(fleet_dir, 'nodes.json')) as handle:
        return json.load(handle)['nodes']


def assert_fleet_gone(fleet_dir, records, ns_fds):
    """Nothing `up` started survives: recorded pids, their PID namespaces, descendants, command lines."""
    roots = {r['init_pid'] for r in records} | {r['unshare_pid'] for r in records}
    deadline = time.monotonic() + 10
    while True:
        left = [r['name'] for r in records if is_running(r['init_pid'], r['init_starttime'])
                or is_running(r['unshare_pid'], r['unshare_starttime'])]
        in_ns = pids_in_namespaces(ns_fds)
        kids = descendants(roots)
        named = pids_mentioning(fleet_dir + '/')
        if not (left or in_ns or kids or named) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, 'node processes still running: %s' % left
    assert not in_ns, 'processes left in the nodes\' PID namespaces: %s' % in_ns
    assert not kids, 'descendants of the nodes left: %s' % kids
    assert not named, 'processes mentioning %s left: %s' % (fleet_dir, named)
    for record in records:
        with socket.socket() as sock:
            sock.settimeout(2)
            assert sock.connect_ex(('127.0.0.1', record['port'])) != 0, '%s port still open' % record['name']


@pytest.fixture(scope='module', name='fleet')
def fleet_fixture(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp('fleet'))
    fleet_dir = os.path.join(tmp, 'f')
    env = py_env(tmp)
    state = {'dir': fleet_dir, 'env': env, 'tmp': tmp, 'inventory': os.path.join(fleet_dir, 'inventory.ini'), 'ns_fds': []}
    try:
        up(fleet_dir, NODES, env=env)
        state['records'] = load_nodes(fleet_dir)
        state['ns_fds'] = hold_namespaces(state['records'])
        yield state
    finally:
        if os.path.exists(os.path.join(fleet_dir, 'nodes.json')):
            down(fleet_dir, env=env)
        for fd in state['ns_fds']:
            os.close(fd)


def names():
    return ['node%02d' % i for i in range(1, NODES + 1)]


def test_files_written(fleet):
    fleet_dir = fleet['dir']
    with open(fleet['inventory']) as handle:
        inventory = handle.read()
    assert '[gpu_nodes]' in inventory
    ports = set()
    for name in names():
        line = [ln for ln in inventory.splitlines() if ln.startswith(name + ' ')]
        assert len(line) == 1, inventory
        assert 'ansible_host=127.0.0.1' in line[0] and 'ansible_user=root' in line[0]
        ports.add(int(line[0].split('ansible_port=')[1].split()[0]))
    assert len(ports) == NODES
    assert 'StrictHostKeyChecking=yes' in inventory and 'ansible_python_interpreter=' in inventory
    with open(os.path.join(fleet_dir, 'known_hosts')) as handle:
        known = handle.read().splitlines()
    assert sorted(int(k.split(']:')[1].split()[0]) for k in known) == sorted(ports)
    assert len({k.split()[2] for k in known}) == NODES, 'every node has its own host key'
    assert [r['name'] for r in fleet['records']] == names()
    for record in fleet['records']:
        assert record['init_pid'] != record['unshare_pid'] and record['pidns'].startswith('pid:[')
        assert is_running(record['init_pid'], record['init_starttime'])
    assert len({r['pidns'] for r in fleet['records']}) == NODES
    assert os.readlink('/proc/self/ns/pid') not in {r['pidns'] for r in fleet['records']}


def test_ansible_gpusim_show(fleet):
    out = ansible(fleet['inventory'], 'gpu_nodes', ['-m', 'ansible.builtin.command', '-a', 'gpusim show'], fleet['env']).stdout
    for name in names():
        assert '%s | CHANGED | rc=0' % name in out, out
    uuids = set()
    for name in names():
        show = json.loads(ssh(fleet['dir'], name, 'gpusim show').stdout)
        assert len(show['gpus']) == 4
        uuids.update(g['uuid'] for g in show['gpus'])
    assert len(uuids) == 4 * NODES, 'each node has its own GPUs'


def test_node_is_private(fleet):
    """Hostname, /dev, private dirs and env as promised, and nothing written reaches the host."""
    fleet_dir = fleet['dir']
    out = ansible(fleet['inventory'], 'gpu_nodes', ['-m', 'ansible.builtin.copy', '-a',
                                                    'content={{ inventory_hostname }} dest=/etc/gpufleet/fleet-test.marker'], fleet['env']).stdout
    assert out.count('CHANGED') == NODES, out
    assert not os.path.exists('/etc/gpufleet/fleet-test.marker')
    for name in names():
        with open(os.path.join(fleet_dir, 'nodes', name, 'fs', 'etc', 'gpufleet', 'fleet-test.marker')) as handle:
            assert handle.read() == name
    script = ('hostname; echo "$GPU_SIM_STATE"; command -v gpusim; ls /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia3; '
              'test -c /dev/null && test -L /dev/ptmx && cat /etc/gpufleet/fleet-test.marker && echo; '
              'touch /etc/systemd/system/x.service /opt/gpufleet/x /var/lib/node_exporter/x /run/x && echo written; '
              'touch %s/x 2>/dev/null || echo repo-read-only' % FLEET)
    out = ssh(fleet_dir, 'node02', script).stdout.split()
    assert out[0] == 'node02'
    assert out[1] == '/var/lib/gpusim/state.json'
    assert out[2].endswith('/tests/sim/gpusim')
    assert out[3:7] == ['/dev/nvidia0', '/dev/nvidia3', '/dev/nvidia-uvm', '/dev/nvidiactl'] or sorted(out[3:7]) == sorted(
        ['/dev/nvidia0', '/dev/nvidia3', '/dev/nvidia-uvm', '/dev/nvidiactl'])
    assert out[7:] == ['node02', 'written', 'repo-read-only']
    for path in ('/etc/systemd/system/x.service', '/opt/gpufleet/x', '/var/lib/node_exporter/x', '/run/x', os.path.join(FLEET, 'x')):
        assert not os.path.exists(path), path
    assert not os.path.exists('/dev/nvidia0') or os.path.exists('/proc/driver/nvidia'), 'the host /dev must stay untouched'
    # interactive session with a pty: login shell, gpusim on PATH
    proc = run(['ssh', '-tt', '-F', os.path.join(fleet_dir, 'ssh_config'), 'node03', 'bash -lc "tty; command -v gpusim"'])
    assert '/dev/pts/' in proc.stdout and 'tests/sim/gpusim' in proc.stdout, proc.stdout


def test_process_tables_differ(fleet):
    fleet_dir = fleet['dir']
    for i, name in enumerate(names()):
        ssh(fleet_dir, name, 'gpusim spawn --gpu %d --mib %d -- trainer-%s --epochs %d' % (i % 4, 1000 * (i + 1), name, i + 1))
    tables = {}
    for i, name in enumerate(names()):
        ps = ssh(fleet_dir, name, 'ps -eo pid=,args=').stdout
        tables[name] = ps
        assert 'trainer-%s --epochs %d' % (name, i + 1) in ps
        for other in names():
            if other != name:
                assert 'trainer-%s' % other not in ps, 'a node sees another node\'s process'
        show = json.loads(ssh(fleet_dir, name, 'gpusim show').stdout)
        procs = [p for p in show['processes'] if p['alive']]
        assert len(procs) == 1 and procs[0]['argv'][0] == 'trainer-' + name and procs[0]['gpu'] == i % 4
        assert procs[0]['pid'] < 1000, 'pids are the node namespace\'s own'
        # the workload holds the node's device files open (what the core's /proc/*/fd scan finds)
        fds = ssh(fleet_dir, name, 'ls -l /proc/%d/fd' % procs[0]['pid']).stdout
        assert '/dev/nvidia%d' % (i % 4) in fds and '/dev/nvidiactl' in fds
    assert len(set(tables.values())) == NODES
    # the host sees them in the nodes' PID namespaces, as descendants of the node inits
    in_ns = pids_in_namespaces(fleet['ns_fds'])
    assert len(in_ns) >= 3 * NODES
    assert set(descendants({r['init_pid'] for r in fleet['records']})) <= set(in_ns)


def test_wrong_known_hosts_fails(fleet):
    fleet_dir, tmp = fleet['dir'], fleet['tmp']
    with open(os.path.join(fleet_dir, 'known_hosts')) as handle:
        known = handle.read().splitlines()
    # node01's port paired with node02's host key
    wrong = [known[0].split()[0] + ' ' + ' '.join(known[1].split()[1:])] + known[1:]
    wrong_file = os.path.join(tmp, 'wrong_known_hosts')
    with open(wrong_file, 'w') as handle:
        handle.write('\n'.join(wrong) + '\n')
    with open(fleet['inventory']) as handle:
        inventory = handle.read().replace(os.path.join(fleet_dir, 'known_hosts'), wrong_file)
    with open(os.path.join(fleet_dir, 'ssh_config')) as handle:
        ssh_config = handle.read().replace(os.path.join(fleet_dir, 'known_hosts'), wrong_file)
    wrong_cfg = os.path.join(tmp, 'wrong_ssh_config')
    with open(wrong_cfg, 'w') as handle:
        handle.write(ssh_config)
    inventory = inventory.replace(os.path.join(fleet_dir, 'ssh_config'), wrong_cfg)
    wrong_inv = os.path.join(tmp, 'wrong_inventory.ini')
    with open(wrong_inv, 'w') as handle:
        handle.write(inventory)
    env = dict(fleet['env'], ANSIBLE_SSH_CONTROL_PATH_DIR=os.path.join(tmp, 'cp-wrong'))
    proc = ansible(wrong_inv, 'node01:node02', ['-m', 'ansible.builtin.command', '-a', 'true'], env, check=False)
    assert proc.returncode != 0
    assert 'node01 | UNREACHABLE' in proc.stdout, proc.stdout
    assert 'node02 | CHANGED' in proc.stdout, proc.stdout
    assert 'host key' in proc.stdout.lower() or 'IDENTIFICATION HAS CHANGED' in proc.stdout, proc.stdout
    proc = run(['ssh', '-F', wrong_cfg, 'node01', 'true'], check=False)
    assert proc.returncode == 255
    # and an unknown host is refused too (StrictHostKeyChecking=yes), never added
    empty = os.path.join(tmp, 'empty_known_hosts')
    open(empty, 'w').close()
    proc = run(['ssh', '-F', os.path.join(fleet_dir, 'ssh_config'), '-o', 'UserKnownHostsFile=' + empty, 'node03', 'true'], check=False)
    assert proc.returncode == 255 and os.path.getsize(empty) == 0


def test_down_leaves_nothing(fleet):
    fleet_dir, env = fleet['dir'], fleet['env']
    records = load_nodes(fleet_dir)
    assert pids_in_namespaces(fleet['ns_fds']), 'the fleet runs before down'
    down(fleet_dir, env=env)
    assert_fleet_gone(fleet_dir, records, fleet['ns_fds'])
    assert not os.path.exists(os.path.join(fleet_dir, 'nodes.json'))
    out = down(fleet_dir, env=env).stdout
    assert 'nothing to do' in out


def test_up_twice_down_twice(tmp_path):
    fleet_dir = str(tmp_path / 'g')
    env = py_env(str(tmp_path))
    first_ns, second_ns = [], []
    try:
        up(fleet_dir, 2, '--gpus', '2', env=env)
        first = load_nodes(fleet_dir)
        first_ns = hold_namespaces(first)
        up(fleet_dir, 3, '--gpus', '1', env=env)
        second = load_nodes(fleet_dir)
        second_ns = hold_namespaces(second)
        for record in first:
            assert not is_running(record['init_pid'], record['init_starttime'])
        assert not pids_in_namespaces(first_ns), 'the first fleet was brought down by the second up'
        assert [r['name'] for r in second] == ['node01', 'node02', 'node03']
        show = json.loads(ssh(fleet_dir, 'node03', 'gpusim show').stdout)
        assert len(show['gpus']) == 1
        down(fleet_dir, env=env)
        down(fleet_dir, env=env)
        assert_fleet_gone(fleet_dir, first + second, first_ns + second_ns)
    finally:
        if os.path.exists(os.path.join(fleet_dir, 'nodes.json')):
            down(fleet_dir, env=env)  # a failed assertion must not leave a fleet running
        for fd in first_ns + second_ns:
            os.close(fd)


def test_down_never_signals_a_reused_pid(tmp_path):
    """A recorded pid whose start time differs (pid reused) is left alone."""
    fleet_dir = str(tmp_path / 'h')
    os.makedirs(fleet_dir)
    bystander = subprocess.Popen(['sleep', '60'])
    try:
        start = stat_of(bystander.pid)[2]
        record = {'name': 'node01', 'port': 1, 'unshare_pid': bystander.pid, 'unshare_starttime': start + 1,
                  'init_pid': bystander.pid, 'init_starttime': start + 1, 'pidns': None}
        with open(os.path.join(fleet_dir, 'nodes.json'), 'w') as handle:
            json.dump({'schema': 1, 'nodes': [record]}, handle)
        down(fleet_dir)
        assert bystander.poll() is None, 'down signalled a process it did not start'
    finally:
        bystander.kill()
        bystander.wait()


def test_down_after_crashed_up(tmp_path):
    """up killed mid-start (before it wrote the inventory): down still stops everything it started."""
    fleet_dir = str(tmp_path / 'c')
    env = py_env(str(tmp_path))
    proc = subprocess.Popen([sys.executable, UP, '--nodes', '3', '--dir', fleet_dir], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    nodes_json = os.path.join(fleet_dir, 'nodes.json')
    while not os.path.exists(nodes_json) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        assert os.path.exists(nodes_json)
        records = load_nodes(fleet_dir)
    finally:
        down(fleet_dir, env=env)
    deadline = time.monotonic() + 10
    while pids_mentioning(fleet_dir + '/') and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_mentioning(fleet_dir + '/')
    assert not any(is_running(r['unshare_pid'], r['unshare_starttime']) for r in records)


def import_fleet_lib():
    sys.path.insert(0, os.path.join(FLEET, 'lib'))
    try:
        import fleet as fleet_lib  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    return fleet_lib


def test_port_taken_meanwhile_is_retried(tmp_path, monkeypatch):
    """A port that another process grabs between the bind test and sshd's bind: the node moves."""
    fleet_lib = import_fleet_lib()
    blocker = socket.socket()
    blocker.bind(('127.0.0.1', 0))
    blocker.listen(1)
    busy = blocker.getsockname()[1]
    real_pick = fleet_lib.PortPicker.pick
    calls = []

    def pick(self):
        calls.append(1)
        if len(calls) == 1:
            self.used.add(busy)
            return busy
        return real_pick(self)

    monkeypatch.setattr(fleet_lib.PortPicker, 'pick', pick)
    monkeypatch.setenv('PATH', BIN + os.pathsep + os.environ.get('PATH', ''))
    fleet_dir = str(tmp_path / 'p')
    try:
        started = fleet_lib.up(fleet_dir, 2, gpus=1, quiet=True)
        node01 = started.nodes[0]
        assert node01.attempts == 2 and node01.port != busy
        assert ssh(fleet_dir, 'node01', 'hostname').stdout.strip() == 'node01'
    finally:
        blocker.close()
        fleet_lib.down(fleet_dir, quiet=True)
    for node in started.nodes:
        node.proc.wait(timeout=10)  # this test process is their parent: reap them


UNREACHABLE_PLAYBOOK = '''
- name: Read every node first
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: GPU facts
      gpufleet.reclaim.gpu_facts:
- name: Wait while the test takes a node down
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Wait for the flag file
      ansible.builtin.wait_for:
        path: "{{ flag }}"
        timeout: 120
- name: Reclaim bob's GPUs
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Kill bob's GPU processes
      gpufleet.reclaim.gpu_kill:
        users: [bob]
        force: true
        timeout: 5
        release_timeout: 5
        audit_log: ""
'''


def test_a_node_that_dies_mid_playbook_is_unreachable_and_the_others_finish(tmp_path):
    """The collection's playbook flow when a node goes away between two plays: the node is reported
    unreachable, the other nodes finish the work, nothing else is touched.  The node is one of this
    test's own fleet (its PID namespace is ended through the recorded init pid, start time checked)."""
    try:
        pwd.getpwnam('bob')
    except KeyError:
        pytest.skip('user bob does not exist')
    fleet_dir = str(tmp_path / 'u')
    env = py_env(str(tmp_path))
    collections = tmp_path / 'collections' / 'ansible_collections' / 'gpufleet'
    collections.mkdir(parents=True)
    os.symlink(os.path.dirname(os.path.dirname(FLEET)), str(collections / 'reclaim'))
    env['ANSIBLE_COLLECTIONS_PATH'] = str(tmp_path / 'collections')
    playbook, flag, log = tmp_path / 'play.yml', tmp_path / 'go', tmp_path / 'play.out'
    playbook.write_text(UNREACHABLE_PLAYBOOK)
    try:
        up(fleet_dir, 3, '--gpus', '2', env=env)
        records = dict((r['name'], r) for r in load_nodes(fleet_dir))
        bob = {}
        for name in records:
            bob[name] = int(ssh(fleet_dir, name, 'gpusim spawn --gpu 0 --mib 1024 --user bob -- python train.py').stdout)
        with open(str(log), 'w') as out:
            play = subprocess.Popen(['ansible-playbook', '-i', os.path.join(fleet_dir, 'inventory.ini'), str(playbook),
                                     '-e', 'flag=%s' % flag], stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                deadline = time.monotonic() + 120
                while 'PLAY [Wait while the test' not in log.read_text() and play.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert play.poll() is None and 'PLAY [Wait while the test' in log.read_text(), log.read_text()
                gone = records['node02']
                assert is_running(gone['init_pid'], gone['init_starttime'])
                os.kill(gone['init_pid'], signal.SIGKILL)                       # the node dies (its whole PID namespace)
                deadline = time.monotonic() + 30
                while is_running(gone['init_pid'], gone['init_starttime']) and time.monotonic() < deadline:
                    time.sleep(0.05)
                flag.write_text('go')
                rc = play.wait(timeout=300)
            finally:
                if play.poll() is None:
                    play.kill()
                    play.wait()
        text = log.read_text()
        assert rc == 4, text                                                  # ansible-playbook: some host unreachable
        recap = dict((m.group(1), m.group(2)) for m in re.finditer(r'^(node\d+)\s+: (ok=.*)$', text, re.M))
        assert 'unreachable=1' in recap['node02'] and 'failed=0' in recap['node02'], recap
        for name in ('node01', 'node03'):
            assert 'changed=1' in recap[name] and 'unreachable=0' in recap[name] and 'failed=0' in recap[name], recap
            show = json.loads(ssh(fleet_dir, name, 'gpusim show').stdout)
            (entry,) = [p for p in show['processes'] if p['pid'] == bob[name]]
            assert not entry['alive']                                          # the work was done there
    finally:
        if os.path.exists(os.path.join(fleet_dir, 'nodes.json')):
            down(fleet_dir, env=env)


def test_systemd_nodes_boot_reboot_and_go(tmp_path):
    """up --systemd: systemd is pid 1 of each node and runs sshd and the simulated driver; services get
    the node's environment; Ansible reaches the nodes as usual; reboot restarts one node (same port,
    a fresh driver state) by its host pids; down leaves no process, no namespace and no cgroup."""
    tmp = str(tmp_path)
    fleet_dir = os.path.join(tmp, 'f')
    env = py_env(tmp)
    fds, records = [], []
    try:
        up(fleet_dir, 2, '--systemd', '--gpus', '2', env=env)
        before = {r['name']: r for r in load_nodes(fleet_dir)}
        records = list(before.values())
        assert all(r['systemd'] and r['cgroups'] and r['init_pid'] != r['unshare_pid'] for r in records)
        assert all(os.path.basename(os.readlink('/proc/%d/exe' % r['unshare_pid'])) == 'systemd-nspawn' for r in records)
        fds = hold_namespaces(records)
        out = ssh(fleet_dir, 'node01', 'cat /proc/1/comm; hostname; systemctl is-system-running --wait; '
                  'systemd-run --quiet --wait --pipe --collect printenv GPU_SIM_STATE; ls /dev/nvidia1; '
                  'gpusim spawn --gpu 1 --mib 1024 -- python job.py >/dev/null').stdout.split()
        assert out == ['systemd', 'node01', 'running', '/var/lib/gpusim/state.json', '/dev/nvidia1']
        shown = ansible(os.path.join(fleet_dir, 'inventory.ini'), 'gpu_nodes', ['-m', 'ansible.builtin.command', '-a', 'gpusim show'], env)
        assert shown.stdout.count('CHANGED') == 2, shown.stdout
        run([sys.executable, REBOOT, '--dir', fleet_dir, 'node01'], env=env, timeout=120)
        after = {r['name']: r for r in load_nodes(fleet_dir)}
        assert after['node02'] == before['node02']
        assert after['node01']['port'] == before['node01']['port'] and after['node01']['init_pid'] != before['node01']['init_pid']
        assert not is_running(before['node01']['init_pid'], before['node01']['init_starttime'])
        assert json.loads(ssh(fleet_dir, 'node01', 'gpusim show').stdout)['processes'] == []  # no process survives a reboot
        fds += hold_namespaces([after['node01']])
        records.append(after['node01'])
        refused = run([sys.executable, REBOOT, '--dir', fleet_dir, 'node07'], env=env, check=False)
        assert refused.returncode == 1 and 'unknown node(s) node07' in refused.stdout
    finally:
        if os.path.exists(os.path.join(fleet_dir, 'nodes.json')):
            down(fleet_dir, env=env)
        try:
            assert_fleet_gone(fleet_dir, records, fds)
            assert [path for r in records for path in r['cgroups'] if os.path.exists(path)] == []
        finally:
            for fd in fds:
                os.close(fd)


def test_systemd_needs_systemd_nspawn(tmp_path, monkeypatch):
    """Without systemd-nspawn, up --systemd names the package to install."""
    fleet_lib = import_fleet_lib()
    monkeypatch.setenv('PATH', str(tmp_path))
    with pytest.raises(fleet_lib.FleetError, match='install the Debian package systemd-container'):
        fleet_lib.check_systemd_host(str(tmp_path))
