# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""Bounded matching of user regexes against hostile text: the selectors, the redaction of command
lines and the rogue rules use these.  A leaf: the standard library and errors.py only.

``compile_regex`` rejects over-long patterns and nested quantifiers; ``bounded_search``,
``bounded_sub`` and ``bounded_subs`` cut the text to MAX_MATCH_TEXT and stop a match that runs past
MATCH_TIMEOUT_S.
"""

from __future__ import annotations

import re
import signal
import threading
import time

from .errors import InvalidArgument

# Longest regex we accept, and the longest command line text a regex is matched against.  Both
# bound the work one hostile pattern or one hostile process can cause.
MAX_PATTERN = 512
MAX_MATCH_TEXT = 32768
# Seconds one regex may spend on one process's text.  Even patterns without nested quantifiers
# (``.*.*x``, ``(a|a)*x``) take polynomial or exponential time on hostile command lines; a match
# that runs past this is stopped (SIGALRM, main thread only) and reported as InvalidArgument.
MATCH_TIMEOUT_S = 2.0
_NESTED_QUANTIFIER = re.compile(r'\((?:[^()\\]|\\.)*[+*}](?:[^()\\]|\\.)*\)[+*{]')


def compile_regex(field, pattern):
    """Compile a user regex, rejecting over-long patterns and nested quantifiers like ``(a+)+``."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgument(field, pattern, 'expected a non-empty regular expression')
    if len(pattern) > MAX_PATTERN:
        raise InvalidArgument(field, pattern[:40] + '...', 'patterns are limited to %d characters' % MAX_PATTERN)
    if _NESTED_QUANTIFIER.search(pattern):
        raise InvalidArgument(field, pattern, 'nested quantifiers such as (a+)+ can take exponential time; rewrite the pattern')
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InvalidArgument(field, pattern, 'not a valid regular expression: %s' % exc)
    except (RecursionError, OverflowError) as exc:
        raise InvalidArgument(field, pattern, 'not a usable regular expression: %s' % type(exc).__name__)
    if _nested_repeat(_parse_tree(pattern)):
        raise InvalidArgument(field, pattern, 'nested quantifiers such as (a+)+ can take exponential time; rewrite the pattern')
    return compiled


try:
    from re import _parser as _sre_parse  # Python 3.11+  pylint: disable=ungrouped-imports
except ImportError:  # Python 3.8 - 3.10
    import sre_parse as _sre_parse  # pylint: disable=deprecated-module

_REPEATS = tuple(getattr(_sre_parse, name) for name in ('MAX_REPEAT', 'MIN_REPEAT', 'POSSESSIVE_REPEAT') if hasattr(_sre_parse, name))


def _parse_tree(pattern):
    try:
        return _sre_parse.parse(pattern)
    except Exception:  # pylint: disable=broad-except
        return None


def _is_repeat(items):
    return len(items) == 2 and any(items[0] is op for op in _REPEATS) and isinstance(items[1], tuple) and len(items[1]) == 3


def _repeats_inside(node, depth=0):
    """True when ``node`` (a parsed pattern or part of one) holds a quantifier that repeats more than once."""
    if depth > 200:
        return True
    if isinstance(node, (list, tuple)) or isinstance(node, _sre_parse.SubPattern):
        items = list(node)
        if _is_repeat(items):
            if items[1][1] > 1:
                return True
        return any(_repeats_inside(item, depth + 1) for item in items)
    return False


def _nested_repeat(node, depth=0):
    """True when a quantifier that repeats more than once holds another one, at any depth (``((a+))+``)."""
    if node is None or depth > 200:
        return node is not None
    if isinstance(node, (list, tuple)) or isinstance(node, _sre_parse.SubPattern):
        items = list(node)
        if _is_repeat(items):
            low_high_body = items[1]
            if low_high_body[1] > 1 and _repeats_inside(low_high_body[2]):
                return True
        return any(_nested_repeat(item, depth + 1) for item in items)
    return False


class _MatchTimeout(Exception):
    pass


def _on_alarm(signum, frame):  # pylint: disable=unused-argument
    raise _MatchTimeout()


def bounded_search(regex, text, field, timeout=None):
    """``regex.search(text)``, stopped after ``timeout`` seconds with InvalidArgument naming ``field``.

    The time bound needs SIGALRM and the main thread (modules and the guard agent run there);
    elsewhere only the text bound (MAX_MATCH_TEXT) applies.  A timer already set is restored.
    """
    text = text[:MAX_MATCH_TEXT]

    def work(arm):
        arm(regex, len(text))
        return regex.search(text)
    return _bounded(field, timeout, work)


def bounded_sub(regex, repl, text, field, timeout=None):
    """``regex.sub(repl, text)`` under the same bounds as bounded_search (text cut to MAX_MATCH_TEXT)."""
    return bounded_subs((regex,), repl, text, field, timeout)


def bounded_subs(regexes, repl, text, field, timeout=None):
    """``text`` through ``regex.sub(repl, ...)`` of each of ``regexes`` in turn, each step bounded as
    bounded_sub is (its text cut to MAX_MATCH_TEXT, ``timeout`` seconds for the one regex).  The alarm's
    handler is set once for the whole sequence (setting it for each regex was most of the cost of
    redacting a command line with a dozen patterns)."""
    return _bounded(field, timeout, lambda arm: _subs(regexes, repl, text, arm))


def bounded_subs_each(regexes, repl, texts, field, timeout=None):
    """bounded_subs of each of ``texts`` (a list of results), the alarm's handler set once for them all; a
    text on which a regex ran out of time gives None (where bounded_subs raises InvalidArgument)."""
    def work(arm):
        results = []
        for text in texts:
            try:
                results.append(_subs(regexes, repl, text, arm))
            except _MatchTimeout:
                results.append(None)
        return results
    return _bounded(field, timeout, work)


def _subs(regexes, repl, text, arm):
    for regex in regexes:
        text = text[:MAX_MATCH_TEXT]
        arm(regex, len(text))
        text = regex.sub(repl, text)
    return text


def _bounded(field, timeout, work):
    """``work(arm)``, where ``work`` calls ``arm(regex, length)`` before each regex call: every call is
    stopped after ``timeout`` seconds (SIGALRM, main thread only) with InvalidArgument naming ``field``
    and that regex.  The handler is set once for all of ``work``; a timer already set is restored."""
    timeout = MATCH_TIMEOUT_S if timeout is None else timeout
    if not hasattr(signal, 'setitimer') or threading.current_thread() is not threading.main_thread():
        return work(lambda regex, length: None)
    current = [None, 0]

    def arm(regex, length):
        current[:] = [regex, length]
        signal.setitimer(signal.ITIMER_REAL, timeout)

    started = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    timed_out = False
    try:
        try:
            return work(arm)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _MatchTimeout:
        timed_out = True
    finally:
        signal.signal(signal.SIGALRM, old_handler if old_handler is not None else signal.SIG_DFL)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - started), 0.001), old_interval)
    if timed_out:
        raise InvalidArgument(field, current[0].pattern, 'matching took longer than %ss on a %d-character text; '
                              'simplify the pattern (avoid several .* or overlapping alternatives)' % (timeout, current[1]))
    return None
