"""Reading numbers out of submitted answers, and comparing them.

A value passed to ``submit()`` reaches the host as plain data, made inside the kernel with the base types' own methods:
int / finite float / str / bool / None as is (a subclass as its base value), ``Fraction`` and ``Decimal`` as their
``str`` ("3/4", "2.50"), numpy scalars as their Python value; anything else (a list, an object with a lying ``__eq__``
or ``__repr__``, NaN, infinity, an int over 1000 digits, a str over 1000 characters) as ``{"rejected": why, "repr":
...}``, which is never a correct answer (see ``checkable``). ``parse_number`` turns a submitted value into an exact
``Fraction`` (or None), so checks compare numbers, never strings.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

MAX_TEXT_LEN = 200
"""Longer strings are not numbers (keeps hostile submissions cheap to reject)."""
MAX_EXPONENT = 1000
"""Decimal exponents beyond this are rejected: "1e99999999" would otherwise build a huge integer."""

# ASCII digits only (re.ASCII): "４２" (full-width) or "٤٢" (Arabic-Indic) is text, not the number 42
_WRAPPED = re.compile(r"(?:np|numpy)\.\w+\((.*)\)|Decimal\('(.*)'\)", re.ASCII)  # np.int64(5), Decimal('2.5')
_FRACTION_REPR = re.compile(r"Fraction\(\s*([+-]?\d+)\s*,\s*([+-]?\d+)\s*\)", re.ASCII)  # Fraction(3, 4)
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:_\d+)*\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?", re.ASCII)
_THOUSANDS = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+)(\.\d*)?", re.ASCII)  # 1,234,567.89


def checkable(value: Any) -> bool:
    """Whether a submitted value is plain data a task's ``check`` may judge: None, bool, int, float or str. The kernel
    records everything else as ``{"rejected": why, "repr": ...}``; the rollout counts such a submission as wrong
    without calling ``check``."""
    return value is None or type(value) in (bool, int, float, str)


def parse_number(value: Any) -> Fraction | None:
    """The exact number a submitted value stands for, or None when it is not one number.

    Accepts int, float (finite), Fraction, Decimal, and strings: "42", "-2.5", "1e3", "3/4", "1.5/2", "1,234.50",
    "$18", "-$5", "50%" (the percent sign is dropped: GSM8K answers "50" for 50%), surrounding whitespace, a unicode
    minus, and the reprs "np.int64(5)", "np.float64(2.5)", "Fraction(3, 4)", "Decimal('2.5')". bool, None, NaN,
    infinities, containers and free text ("18 dollars") give None.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value)) if math.isfinite(value) else None  # repr: 0.1 -> 1/10, not the binary double
    if isinstance(value, Decimal):
        return Fraction(value) if value.is_finite() else None
    if isinstance(value, str):
        return _parse_text(value)
    if hasattr(value, "__index__"):  # numpy / torch integer scalars handed over directly
        return Fraction(value.__index__())
    if hasattr(value, "__float__") and not isinstance(value, complex):  # numpy floating scalars and the like
        try:
            return parse_number(float(value))
        except (TypeError, ValueError):
            return None
    return None


def _parse_text(text: str) -> Fraction | None:
    s = _clean_text(text)
    if s is None:
        return None
    m = _FRACTION_REPR.fullmatch(s)
    if m:
        return Fraction(int(m[1]), int(m[2])) if int(m[2]) != 0 else None
    if s.count("/") == 1:
        num, den = (_parse_decimal(part.strip()) for part in s.split("/"))
        return num / den if num is not None and den else None
    return _parse_decimal(s)


def _clean_text(text: str) -> str | None:
    """Strip the decorations around a number: whitespace, wrappers, $, %, thousands separators. None if too long."""
    if len(text) > MAX_TEXT_LEN:
        return None
    s = text.strip().replace("\u2212", "-")
    m = _WRAPPED.fullmatch(s)
    if m:
        s = (m[1] if m[1] is not None else m[2]).strip()
    if _FRACTION_REPR.fullmatch(s):
        return s
    s = s.removesuffix("%").strip()
    if s.count("$") == 1:
        s = s.replace("$", "").strip()
    if "," in s:
        m = _THOUSANDS.fullmatch(s)
        if not m:
            return None
        s = m[1] + m[2].replace(",", "") + (m[3] or "")
    return s


def _parse_decimal(s: str) -> Fraction | None:
    m = _DECIMAL.fullmatch(s)
    if not m or (m[1] is not None and abs(int(m[1])) > MAX_EXPONENT):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError, InvalidOperation):
        return None


def numbers_equal(a: Any, b: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Whether two values (anything ``parse_number`` reads) are the same number, within tolerance.

    Exact arithmetic on Fractions: |a - b| <= max(rel_tol * max(|a|, |b|), abs_tol). Either side unreadable: False.
    E.g. numbers_equal("1,000", 1000.0) and numbers_equal(0.3333333, "1/3") are True; numbers_equal(18, "18.1") False.
    """
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    return abs(x - y) <= max(Fraction(rel_tol) * max(abs(x), abs(y)), Fraction(abs_tol))


def is_float_like(value: Any) -> bool:
    """Whether a submitted value may carry float rounding: a float, or a number written with a decimal point or an
    exponent ("0.75", "np.float64(2.5)", "1e3"). Integers, "3/4" and "Fraction(3, 4)" are exact: they get no tolerance.
    """
    if isinstance(value, float) and not isinstance(value, bool):
        return True
    if isinstance(value, Decimal):
        return True
    if isinstance(value, str):
        s = _clean_text(value)
        return s is not None and _FRACTION_REPR.fullmatch(s) is None and re.search(r"[.eE]", s) is not None
    return hasattr(value, "__float__") and not hasattr(value, "__index__") and not isinstance(value, Fraction | int)


def exact_match(submitted: Any, answer: Any, float_rel_tol: float = 1e-9, float_abs_tol: float = 1e-12) -> bool:
    """Whether a submitted value is exactly the answer; a float-like submission (see ``is_float_like``) may differ by
    float rounding, within float_rel_tol relative (float_abs_tol near zero).

    For answer 3/4: 0.75, "0.75", "3/4", "Fraction(3, 4)" and 0.7500000000001 match; "0.76" and 1 do not.
    For answer 8877: 8877, "8,877", 8877.0, "np.int64(8877)" match; 8878 does not, however large the answer.
    """
    x, y = parse_number(submitted), parse_number(answer)
    if x is None or y is None:
        return False
    if x == y:
        return True
    return is_float_like(submitted) and numbers_equal(x, y, rel_tol=float_rel_tol, abs_tol=float_abs_tol)
