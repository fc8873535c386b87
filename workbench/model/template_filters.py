"""Jinja's filters in a chat template's sandbox, bounded (:mod:`workbench.model.chat_template`).

Every Jinja filter is classified: :data:`GROWING_FILTERS` can build more than a constant factor of
their input and are bounded before they run (``_FILTER_BOUNDS``: an upper bound on the result) or
replaced by versions that stop at the limit (``_filter_replacements``: ``join``, ``tojson``,
``pprint``, ``sum``); :data:`LINEAR_FILTERS` cannot grow, and their results are measured and counted
after.  ``_bounded_filter`` wraps each filter of the sandbox with these checks.  A new Jinja filter
fails tests/fuzz/test_fuzz_chat_template.py until it is classified here.
"""

from __future__ import annotations

import functools
import itertools
import json
import pprint

from workbench.model.template_budget import (
    _ACTIVE,
    _UNMETERED,
    MAX_OUTPUT_CHARS,
    _check_args,
    _int,
    _meter,
    _need,
    _percent_bound,
    _text_len,
    _too_big,
)

# ---- what grows, and what cannot ---------------------------------------------------------------
# Jinja's filters (jinja2.defaults.DEFAULT_FILTERS) that can build more than a constant factor of
# their input - by an argument (center's width, join's separator once per item, indent's width
# once per line, tojson's indent once per line and level, batch's fill_with once per missing item,
# format's field widths, wordwrap's wrapstring and urlize's target once per line or link) or in
# time (sum of lists is quadratic): each is bounded before it runs (an upper bound on its result,
# _FILTER_BOUNDS) or replaced by a version that stops at the limit (tojson, pprint, sum).
GROWING_FILTERS = frozenset({"batch", "center", "format", "indent", "join", "pprint", "replace", "slice", "sum",
                             "tojson", "urlize", "wordwrap"})
# The others build at most a constant factor of their input: a value of it (first, last, random,
# min, max, attr, default, select*, reject*), a number (abs, count, length, float, int, round,
# wordcount, filesizeformat), the same items in another order or grouping (dictsort, groupby, items,
# list, reverse, sort, unique, map: each item through another filter, itself bounded), the text
# changed character by character (capitalize, lower, upper, title, trim, striptags; a case change
# makes at most 3 characters of one, 'ﬃ' -> 'FFI'), escaped (escape, e, forceescape, safe,
# xmlattr: 5 characters for one; urlencode: 12 for one, %XX per UTF-8 byte), printed (string: the
# text of a bounded value) or cut (truncate: the text up to ``length`` plus ``end``).
LINEAR_FILTERS = frozenset({"abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape",
                            "filesizeformat", "first", "float", "forceescape", "groupby", "int", "items", "last",
                            "length", "list", "lower", "map", "max", "min", "random", "reject", "rejectattr",
                            "reverse", "round", "safe", "select", "selectattr", "sort", "string", "striptags",
                            "title", "trim", "truncate", "unique", "upper", "urlencode", "wordcount", "xmlattr"})


# ---- the growing filters, bounded ------------------------------------------------------------------------
# Each returns an upper bound on the size of the filter's result (and the arguments to call it
# with: an iterator it had to read is passed on as the list it read).

def _lines(s: str) -> int:
    return len(s.splitlines()) + 1


def _b_center(env, value, width=80, *_, **__):
    return max(_text_len(value), _int(width))


def _b_format(env, value, *args, **kwargs):
    return _percent_bound(value if isinstance(value, str) else str(value), kwargs or args, "filter 'format'")


def _b_indent(env, s, width=4, first=False, blank=False, *_, **__):
    if not isinstance(s, str):
        return 0
    ind = len(width) if isinstance(width, str) else max(_int(width), 0)
    return len(s) + 1 + (_lines(s) + 1) * ind                # the width once per line (and the first)


def _b_replace(env, s, old, new, count=None, *_, **__):
    s, old, new = (x if isinstance(x, str) else str(x) for x in (s, old, new))   # autoescape is off: str.replace
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _b_wordwrap(env, s, width=79, break_long_words=True, wrapstring=None, *_, **__):
    if not isinstance(s, str):
        return 0
    wrap = env.newline_sequence if wrapstring is None else wrapstring
    # greedy wrapping: two lines together hold more than ``width`` characters of the paragraph
    lines = 2 * len(s) // max(_int(width, 1), 1) + _lines(s)
    return len(s) + lines * _text_len(wrap)


def _b_urlize(env, value, trim_url_limit=None, nofollow=False, target=None, rel=None, *_, **__):
    text = value if isinstance(value, str) else str(value)
    links = len(text.split()) + 1
    return 10 * len(text) + links * (5 * (_text_len(rel or "") + _text_len(target or "")) + 96)


def _b_batch(env, value, linecount, fill_with=None, *_, **__):
    return 0 if fill_with is None else _int(linecount) * (_meter().size(fill_with, nested=True) + 2)


def _b_slice(env, value, slices, fill_with=None, *_, **__):
    return _int(slices) * (2 + (0 if fill_with is None else _meter().size(fill_with, nested=True) + 2))


_FILTER_BOUNDS = {"batch": _b_batch, "center": _b_center, "format": _b_format, "indent": _b_indent,
                  "replace": _b_replace, "slice": _b_slice, "urlize": _b_urlize, "wordwrap": _b_wordwrap}


def _bounded_join(eval_ctx, value, d="", attribute=None):  # pass_eval_context, below
    """Jinja's ``join`` with the joined text's size bounded before it is built: each item's text and
    the separator once per item (an iterator is read once, into a list)."""
    # lazy: jinja2 (~75 ms, with markupsafe) only once a chat template is compiled
    from jinja2.filters import make_attrgetter, sync_do_join

    items = list(value)
    if attribute is not None:
        get = make_attrgetter(eval_ctx.environment, attribute)
        items = [get(x) for x in items]
    m = _meter()
    total = max(len(items) - 1, 0) * _text_len(d)
    for x in items:
        total += m.size(x)
        if total > MAX_OUTPUT_CHARS:
            break
    _need(total, "filter 'join': the joined text")
    return sync_do_join(eval_ctx, items, d)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` (``json.dumps`` with these keywords), written piece by piece and
    stopped at the limit: an indent is written once per line and level, a separator once per item."""
    if indent is not None:
        per_level = len(indent) if isinstance(indent, str) else max(_int(indent), 0)
        deepest = _depth(x, MAX_OUTPUT_CHARS // max(per_level, 1) + 1)
        _need(per_level * deepest, f"filter 'tojson': an indent of {per_level:,} characters at depth {deepest:,},")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    out, n = [], 0
    for piece in encoder.iterencode(x):
        n += len(piece)
        if n > MAX_OUTPUT_CHARS:
            raise _too_big("filter 'tojson': a result", n)
        out.append(piece)
    return "".join(out)


def _depth(x, cap: int) -> int:
    """How deep lists and dicts nest in ``x`` (stops past ``cap``, or after 2**20 of them)."""
    deepest, stack, seen = 0, [(x, 0)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            d += 1
            deepest = max(deepest, d)
            seen += 1
            if deepest > cap or seen > 2**20:
                return max(deepest, cap + 1)
            stack.extend((c, d) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


class _Written:
    """A stream that refuses to hold more than the limit (for pprint)."""

    def __init__(self, what: str) -> None:
        self.parts, self.n, self.what = [], 0, what

    def write(self, s: str) -> None:
        self.n += len(s)
        if self.n > MAX_OUTPUT_CHARS + 1:                 # + its final newline
            raise _too_big(self.what, self.n)
        self.parts.append(s)


def _pprint(value):
    """Jinja's ``pprint`` (``pprint.pformat``) written to a stream that stops at the limit.  pformat
    indents nested values and prints each one again at every level it tries: a value is refused
    when its items times its depth pass the limit (the output's, and the work's, bound)."""
    size = _meter().size(value, nested=True)
    deepest = _depth(value, MAX_OUTPUT_CHARS)
    _need(size * (deepest + 1), "filter 'pprint': a value of its size and depth printed")
    out = _Written("filter 'pprint': a result")
    pprint.PrettyPrinter(stream=out).pprint(value)
    return "".join(out.parts)[:-1]                        # pprint ends with a newline, pformat does not


def _sum(environment, iterable, attribute=None, start=0):
    """Jinja's ``sum``, in linear time: lists (or tuples) are chained, not added one by one (which
    copies the growing list once per item); the result's size is bounded before it is built."""
    from jinja2.filters import make_attrgetter

    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    if isinstance(start, (list, tuple)):
        for x in items:
            if type(x) is not type(start):
                return start[:0] + x                      # the TypeError sum() gives
        m = _meter()
        total = m.size(start)
        for x in items:
            total += m.size(x)
            if total > MAX_OUTPUT_CHARS:
                break
        _need(total, "filter 'sum': a result")
        return type(start)(itertools.chain(start, *items))
    return sum(items, start)


def _filter_replacements() -> dict:
    from jinja2.utils import pass_environment, pass_eval_context

    return {"join": pass_eval_context(_bounded_join), "pprint": _pprint, "sum": pass_environment(_sum),
            "tojson": _tojson}


# Filters whose items are values that exist already (the input's, or a filter's that counted them):
# their items are measured, not counted again.
_PASSING_ON = frozenset({"map", "reject", "rejectattr", "reverse", "select", "selectattr", "unique"})


def _bounded_filter(name: str, f):
    """``f`` called with its usual first argument (context, eval context or environment), its
    integer arguments and, for a growing filter, its result's size bound checked before it runs,
    its result measured after.  Marked ``pass_context``: Jinja then never calls it while parsing
    (constant folding), where no render's limits apply."""
    from jinja2.utils import _PassArg, pass_context

    kind = _PassArg.from_obj(f)
    bound = _FILTER_BOUNDS.get(name)
    what, result, count = f"filter '{name}'", f"filter '{name}': a result", name not in _PASSING_ON
    by_context, by_eval, by_env = (kind is _PassArg.context, kind is _PassArg.eval_context,
                                   kind is _PassArg.environment)

    @functools.wraps(f)
    def bounded(context, *args, **kwargs):
        for v in args[1:]:                               # center(10**9); the value itself may be any number
            if type(v) is int and abs(v) > MAX_OUTPUT_CHARS:
                _check_args(args[1:], kwargs, what)
        if kwargs:
            _check_args((), kwargs, what)
        if bound is not None and args:
            try:
                est = bound(context.environment, *args, **kwargs)
            except (TypeError, ValueError, AttributeError):
                est = 0                                  # arguments the filter itself refuses, below
            _need(est, result)
        if by_context:
            value = f(context, *args, **kwargs)
        elif by_eval:
            value = f(context.eval_ctx, *args, **kwargs)
        elif by_env:
            value = f(context.environment, *args, **kwargs)
        else:
            value = f(*args, **kwargs)
        return (getattr(_ACTIVE, "meter", None) or _UNMETERED).checked(value, result, args, count)

    bounded.__dict__.pop("jinja_pass_arg", None)
    return pass_context(bounded)
