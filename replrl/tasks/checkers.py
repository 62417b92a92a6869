"""Answer checkers by name, for the dataset task (``task.checker``): whether a submitted value answers a row.

A checker is called as ``check(submitted, reference, row) -> bool``: ``submitted`` is the plain value the episode
passed to ``submit()`` (int, float, str, bool or None), ``reference`` the row's answer (after the task's
``answer_after`` marker, if any), ``row`` the whole dataset row.

- ``exact``: the same text (``str`` of both, surrounding whitespace ignored): "Paris" for "Paris".
- ``number``: the same number (``replrl.answers.exact_match``, gsm8k's check): 18, "18", "$18", "36/2" for 18; a
  float-like submission may differ by float rounding (``rel_tol``).
- ``numbers``: the same set of numbers: "3, 1, 2", "[1, 2, 3]" or "1 2 3" for [1, 2, 3] or "1, 2, 3" (order and
  repeats ignored; commas separate numbers, so "1,000" is two numbers here).
- ``math``: math-verify (``pip install 'replrl[math]'``): LaTeX and symbolic answers, "\\frac{1}{2}" for "0.5".
- ``module:function`` (or ``path/to/file.py:function``): the user's function; it declares the arguments it wants
  among ``submitted``, ``reference`` and ``row`` (other names: called as ``fn(submitted, reference)``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from replrl.answers import exact_match, parse_number
from replrl.tasks.base import TaskError

CHECKERS = ("exact", "number", "numbers", "math")
"""The built-in checkers' names."""
CHECKER_ARGS = ("submitted", "reference", "row")
"""The arguments a user's checker may declare (by these names)."""

Checker = Callable[[Any, Any, Any], bool]


def exact(submitted: Any, reference: Any, row: Any = None) -> bool:
    """The same text, surrounding whitespace ignored; nothing submitted is never right."""
    return submitted is not None and str(submitted).strip() == str(reference).strip()


def number_set(value: Any) -> frozenset[Fraction] | None:
    """The set of numbers a value holds: a list, a number, or text such as "[3, 1, 2]" or "1 2 3"; None when any
    item is not a number (or there is none)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif isinstance(value, str):
        items = [x for x in re.split(r"[,;\s]+", value.strip().strip("[](){}")) if x]
    else:
        items = [value]
    parsed = [parse_number(x) for x in items]
    if not parsed or any(x is None for x in parsed):
        return None
    return frozenset(parsed)  # type: ignore[arg-type]


def numbers(submitted: Any, reference: Any, row: Any = None) -> bool:
    """The same set of numbers (``number_set``)."""
    got, want = number_set(submitted), number_set(reference)
    return got is not None and got == want


def math_checker() -> Checker:
    """math-verify's ``verify(parse(reference), parse(submitted))``, or a one-line TaskError when it is not
    installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise TaskError("task.checker = math needs math-verify, which is not installed: pip install 'replrl[math]' "
                        "(or pip install math-verify)") from None

    def check(submitted: Any, reference: Any, row: Any = None) -> bool:
        if submitted is None:
            return False
        gold, answer = parse(_as_math(reference)), parse(_as_math(submitted))
        return bool(gold) and bool(answer) and bool(verify(gold, answer))

    return check


def _as_math(value: Any) -> str:
    """math-verify finds answers in LaTeX delimiters or plain numbers; a bare expression ("x^2+1", "\\frac12")
    is wrapped in $...$ so it is read as one."""
    text = str(value).strip()
    return text if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text else f"${text}$"


def make_checker(name: str, rel_tol: float = 1e-9) -> Checker:
    """The checker a name stands for (see the module docstring); a bad name or a function that does not import is
    a one-line TaskError."""
    if name == "exact":
        return exact
    if name == "number":
        return lambda submitted, reference, row=None: exact_match(submitted, reference, float_rel_tol=rel_tol)
    if name == "numbers":
        return numbers
    if name == "math":
        return math_checker()
    if ":" not in name:
        raise TaskError(f"task.checker must be one of {', '.join(CHECKERS)} or an import path module:function; "
                        f"got {name!r}")
    from replrl.rewards import resolve

    try:
        fn = resolve(name)
    except ValueError as err:
        raise TaskError(str(err).replace("reward term", "checker", 1)) from None
    return user_checker(fn, name)


def user_checker(fn: Callable[..., Any], name: str = "") -> Checker:
    """A user's function as a checker: called with the arguments it declares among CHECKER_ARGS, else as
    ``fn(submitted, reference)``; its result is taken as a bool."""
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = ()
    declared = bool(params) and all(p in CHECKER_ARGS for p in params)

    def check(submitted: Any, reference: Any, row: Any = None) -> bool:
        given = {"submitted": submitted, "reference": reference, "row": row}
        try:
            return bool(fn(**{p: given[p] for p in params}) if declared else fn(submitted, reference))
        except Exception as err:  # the user's function: its error in one line, with its name
            raise TaskError(f"checker {name or getattr(fn, '__name__', fn)!r} raised {type(err).__name__}: "
                            f"{err}") from err

    return check
