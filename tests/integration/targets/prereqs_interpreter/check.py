# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""check.py blind|sees NODES GPUS STDOUT STDERR [TEXT]: what README's ad-hoc gpu_facts printed.

blind: every node returned no device, its nvidia backend unavailable, and a warning names the fix.
sees: every node returned GPUS devices read through its nvidia backend, and no such warning.
TEXT: a string that must also appear in the warnings (stderr).
"""

from __future__ import annotations

import json
import re
import sys

HEAD = re.compile(r'^(node\d+) \| (\w+) => \{$')
FIX = 'Fix: install nvidia-ml-py (imported as pynvml) for '


def results(text):
    """{host: result} from the default callback's `host | STATUS => {json}` blocks."""
    found = {}
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = HEAD.match(lines[index])
        index += 1
        if not match:
            continue
        body = ['{']
        while index < len(lines) and lines[index] != '}':
            body.append(lines[index])
            index += 1
        body.append('}')
        index += 1
        found[match.group(1)] = dict(json.loads('\n'.join(body)), status=match.group(2))
    return found


def main(mode, nodes, gpus, stdout, stderr, text=None):
    with open(stdout) as handle:
        found = results(handle.read())
    with open(stderr) as handle:
        warnings = handle.read()
    assert sorted(found) == ['node%02d' % n for n in range(1, int(nodes) + 1)], sorted(found)
    for host, result in sorted(found.items()):
        assert result['status'] == 'SUCCESS', (host, result)
        gpu = result['ansible_facts']['gpu']
        nvidia = gpu['backends']['nvidia']
        if mode == 'blind':
            assert gpu['devices'] == [] and not nvidia['available'], (host, gpu['devices'], nvidia)
        else:
            assert nvidia['available'] and len(gpu['devices']) == int(gpus), (host, gpu['devices'], nvidia)
            assert all(device['uuid'].startswith('GPU-') for device in gpu['devices']), (host, gpu['devices'])
    assert (FIX in warnings) == (mode == 'blind'), warnings
    assert text is None or text in warnings, (text, warnings)
    print('check %s: %s' % (mode, ', '.join('%s %d devices' % (h, len(r['ansible_facts']['gpu']['devices'])) for h, r in sorted(found.items()))))


if __name__ == '__main__':
    main(*sys.argv[1:])
