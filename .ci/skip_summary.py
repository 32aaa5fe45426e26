#!/usr/bin/env python
"""Say how many tests a run skipped, and why: one line per reason, over every JUnit XML file given.

``ansible-test units`` runs the unit tests in several contexts (module_utils, controller), each
with its own pytest summary; this adds the total, so a skip that only holds on some machines (a
missing tool, no root) shows up in the suite's last lines instead of passing silently.
Usage: skip_summary.py LABEL FILE.xml...   (always exits 0: the tests' own exit code decides)
"""

import collections
import sys
import xml.etree.ElementTree as ET


def main(argv):
    label, paths = argv[0], argv[1:]
    total = 0
    reasons = collections.Counter()
    for path in paths:
        for case in ET.parse(path).getroot().iter('testcase'):
            total += 1
            skipped = case.find('skipped')
            if skipped is not None:
                reasons[skipped.get('message') or 'no reason given'] += 1
    print('%s: %d test(s) in %d file(s) of results, %d skipped%s' % (
        label, total, len(paths), sum(reasons.values()), ':' if reasons else ''))
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        print('  skipped %d: %s' % (count, reason))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
