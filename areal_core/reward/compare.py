"""Comparing a program's answers with the expected ones: exact, except where the expected value is a float.

* Integers are compared exactly, at any size (``10**20 + 1`` is not ``10**20``; a relative tolerance would
  say it is), and never through a float (``10**400`` does not fit one: the comparison is False, never an
  ``OverflowError`` out of the grader).
* Only an expected float allows a difference, a relative one of 1e-6 (no absolute floor: ``0`` is not an
  answer of ``1e-9``); a non-finite number equals only itself (NaN nothing).
* In printed output, an integer token is compared as text (``101`` is not ``00000101``, ``+7`` not ``7``),
  and a decimal token must have the expected token's form (as many digits after the point, an exponent
  where it has one: ``2.5`` is not ``2.50``), then be within the relative tolerance of it.
* Booleans are not numbers here (``true`` is not ``1``), strings and ``null`` are compared as they are, lists
  item by item, objects key by key.

Neither comparison recurses (a deeply nested answer is walked with a stack of its own) or raises on any JSON
value or text a program can produce.
"""

from __future__ import annotations

import decimal
import math
import re

REL_TOL = 1e-6
_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# decimal arithmetic wide enough for any exponent a token can have, never trapping (an overflow is an infinity)
_CONTEXT = decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def _number(x) -> bool:
    return type(x) in (int, float)


def _close_float(got: int | float, want: float) -> bool:
    """``got`` within the tolerance of the expected float ``want``."""
    if got == want:
        return True
    if not math.isfinite(want):
        return False
    try:
        g = float(got)  # an int too large for a float is far from any finite float
    except OverflowError:
        return False
    if not math.isfinite(g):
        return False
    return abs(g - want) <= REL_TOL * max(abs(g), abs(want))


def _scalar_equal(got, want) -> bool:
    if type(want) is bool or type(got) is bool:
        return type(got) is type(want) and got == want
    if type(want) is float:
        return _number(got) and _close_float(got, want)
    if type(want) is int:
        return _number(got) and got == want  # exact, also against a float (Python compares them exactly)
    return type(got) is type(want) and got == want


def values_equal(got, want) -> bool:
    """Whether the JSON value ``got`` (a program's answer) equals the expected JSON value ``want``."""
    stack = [(got, want)]
    while stack:
        g, w = stack.pop()
        if type(w) is list:
            if type(g) is not list or len(g) != len(w):
                return False
            stack.extend(zip(g, w))
        elif type(w) is dict:
            if type(g) is not dict or g.keys() != w.keys():
                return False
            stack.extend((g[k], w[k]) for k in w)
        elif not _scalar_equal(g, w):
            return False
    return True


def _form(token: str) -> tuple[int, bool]:
    """A decimal token's form: its digits after the point, and whether it has an exponent."""
    mantissa, _, exponent = token.lower().partition("e")
    return len(mantissa.partition(".")[2]), bool(exponent)


def _token_equal(got: str, want: str) -> bool:
    """One output token against the expected one: an integer as text, a decimal of the expected one's form
    within the relative tolerance of it, anything else as text."""
    if got == want:
        return True
    if _INT.fullmatch(want) or not (_NUMBER.fullmatch(want) and _NUMBER.fullmatch(got)):
        return False
    if _form(got) != _form(want):
        return False
    g, w = _CONTEXT.create_decimal(got), _CONTEXT.create_decimal(want)  # 60 digits; an exponent out of range: NaN
    if not (g.is_finite() and w.is_finite()):
        return False
    diff = _CONTEXT.subtract(g, w).copy_abs()
    largest = _CONTEXT.max(g.copy_abs(), w.copy_abs())
    bound = _CONTEXT.multiply(largest, decimal.Decimal(REL_TOL))
    return diff.is_finite() and _CONTEXT.compare(diff, bound) <= 0


def stdout_matches(got: str, want: str) -> bool:
    """A program's output against the expected one: the same lines (trailing whitespace ignored), or the same
    tokens, numbers compared as :func:`_token_equal` says."""
    got_lines = [ln.rstrip() for ln in got.strip().splitlines()]
    want_lines = [ln.rstrip() for ln in want.strip().splitlines()]
    if got_lines == want_lines:
        return True
    got_tok, want_tok = got.split(), want.split()
    return len(got_tok) == len(want_tok) and all(_token_equal(g, w) for g, w in zip(got_tok, want_tok))
