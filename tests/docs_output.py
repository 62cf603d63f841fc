"""How a documentation example's printed output is compared with the output its page shows.

One rule for every page (README and ``docs/``), so that a page passes on any CPU:

* The comparison is doctest's, with ``ELLIPSIS`` (``...`` matches anything) and
  ``NORMALIZE_WHITESPACE`` (a run of whitespace equals any other run).
* A **decimal number** on the page (one with a decimal point or an exponent, such as ``1.40``,
  ``-0.0312`` or ``2.5e-03``) matches a printed number that differs from it by at most **one unit in
  its last printed digit** (``1.40`` matches ``1.39`` to ``1.41``). The last bits of a float move
  with the CPU's kernels (``ATEN_CPU_CAPABILITY``); this tolerance absorbs a figure printed exactly
  at a rounding boundary, and nothing more.
* Integers (counts, shapes, sizes) and all other text match exactly.

A figure that comes out of many random steps (a training curve, a Monte Carlo estimate) can move
by far more than its last digit when one early bit flips a sample; such a page prints it at a
precision its spread cannot reach, or prints a comparison (``True``) instead.
"""

from __future__ import annotations

import doctest
import re
from decimal import Decimal

_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# A decimal number: digits with a decimal point, or with an exponent. Not part of a longer word or
# number (``v1.2.3`` or ``x1.5`` are left as text).
_DECIMAL = r"[-+]?(?:\d+\.\d+|\.\d+|\d+(?=[eE]))(?:[eE][-+]?\d+)?"
_DECIMAL_TOKEN = re.compile(rf"(?<![\w.]){_DECIMAL}(?![\w.]*\d)")
_PRINTED_DECIMAL = f"({_DECIMAL})"


def last_digit_unit(number: str) -> Decimal:
    """One unit in the last printed digit of a decimal number.

    Example:
        >>> [str(last_digit_unit(s)) for s in ["1.40", "-0.5", "2.5e-03", "7e2"]]
        ['0.01', '0.1', '0.0001', '1E+2']
    """
    return Decimal(1).scaleb(Decimal(number.lstrip("+-")).as_tuple().exponent)


def _pattern(expected: str) -> tuple[re.Pattern[str], list[str]]:
    """A regular expression for the printed output, with a group per decimal number of the page."""
    numbers: list[str] = []
    parts = []
    for piece_index, piece in enumerate(expected.strip().split("...")):
        if piece_index:
            parts.append(r"[\s\S]*?")
        position = 0
        for match in _DECIMAL_TOKEN.finditer(piece):
            parts.append(_literal(piece[position : match.start()]))
            parts.append(r"\s*" + _PRINTED_DECIMAL)  # torch pads a column for a sign that appears
            numbers.append(match.group())
            position = match.end()
        parts.append(_literal(piece[position:]))
    return re.compile(r"\s*" + "".join(parts) + r"\s*\Z"), numbers


def _literal(text: str) -> str:
    """``text`` as a regular expression in which every run of whitespace matches any other."""
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text))


def outputs_agree(expected: str, printed: str) -> bool:
    """Whether ``printed`` is the output ``expected`` shows, by the rule in this module's docstring.

    Example:
        >>> outputs_agree("after 1.40\\n", "after 1.41\\n"), outputs_agree("after 1.40", "after 1.42")
        (True, False)
        >>> outputs_agree("(1000, 3) 0.5", "(999, 3) 0.5"), outputs_agree("loss ... done", "loss 3.2 done")
        (False, True)
        >>> outputs_agree("tensor([0.0000, 0.5000])", "tensor([-0.0001,  0.5000])")
        True
    """
    if _CHECKER.check_output(expected, printed, _FLAGS):
        return True
    pattern, numbers = _pattern(expected)
    match = pattern.match(printed)
    if match is None:
        return False
    return all(
        abs(Decimal(got) - Decimal(shown)) <= last_digit_unit(shown)
        for shown, got in zip(numbers, match.groups())
    )
