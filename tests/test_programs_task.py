"""The ``programs`` task: every family's reference answers against a second, independent implementation written here
(brute force against the formulas, trial division against the sieve, loops against closed forms), disjoint seeded
splits, the answer check, and multi-line solutions typed line by line into the real sandboxed REPL."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from replrl.repl import ReplSession
from replrl.tasks import PROGRAMS_HEADER, ProgramsTask, Task, TaskError, load_task
from replrl.tasks.programs import split_of
from replrl.tasks.programs_families import FAMILIES
from sandbox import run_sync

SEEDS = 25
"""Problems drawn per family and level for the comparison with the second implementation."""


# ---------------------------------------------------------------- the second implementations


@functools.cache
def is_prime(n: int) -> bool:
    """Trial division (the task's solvers use a sieve)."""
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


@functools.cache
def primes_by_trial(limit: int = 20_000) -> list[int]:
    return [n for n in range(limit) if is_prime(n)]


def numbers(lo: int, hi: int) -> np.ndarray:
    """lo, lo + 1, ..., hi - 1 as int64: brute force over every number, vectorised."""
    return np.arange(lo, hi, dtype=np.int64)


def digit_sums(x: np.ndarray) -> np.ndarray:
    return sum((x // 10**j) % 10 for j in range(7))


def collatz_trajectory(n: int) -> list[int]:
    out = [n]
    while n != 1:
        n = 3 * n + 1 if n % 2 else n // 2
        out.append(n)
    return out


def fib_loop(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def trial_factor(n: int) -> Counter:
    f, d = Counter(), 2
    while d * d <= n:
        while n % d == 0:
            f[d] += 1
            n //= d
        d += 1
    if n > 1:
        f[n] += 1
    return f


def in_base(n: int, base: int) -> list[int]:
    out = []
    while n:
        n, r = divmod(n, base)
        out.append(r)
    return out


def is_palindrome(n: int, base: int = 10) -> bool:
    return str(n) == str(n)[::-1] if base == 10 else in_base(n, base) == in_base(n, base)[::-1]


def squares_of_digits(n: int) -> int:
    return sum(int(c) ** 2 for c in str(n))


@functools.cache
def is_happy(n: int) -> bool:
    """Follow the map until 1 or a value seen before (the task's solver stops at 1 or 4, with a table)."""
    seen = set()
    while n != 1 and n not in seen:
        seen.add(n)
        n = squares_of_digits(n)
    return n == 1


def lcg(s: int, a: int, c: int, m: int, n: int) -> list[int]:
    xs = [s]
    for _ in range(n - 1):
        xs.append((a * xs[-1] + c) % m)
    return xs


def first_repeat_brent(s: int, a: int, c: int, m: int) -> int:
    """Brent's cycle detection: the tail length mu and the cycle length lam; x(mu + lam) is the first repeat."""
    f = lambda x: (a * x + c) % m  # noqa: E731
    power = lam = 1
    tortoise, hare = s, f(s)
    while tortoise != hare:
        if power == lam:
            tortoise, power, lam = hare, power * 2, 0
        hare, lam = f(hare), lam + 1
    tortoise = hare = s
    for _ in range(lam):
        hare = f(hare)
    mu = 0
    while tortoise != hare:
        tortoise, hare, mu = f(tortoise), f(hare), mu + 1
    return mu + lam


def longest_rise(xs: list[int]) -> int:
    rises = [y > x for x, y in itertools.pairwise(xs)]
    return 1 + max((len(list(g)) for up, g in itertools.groupby(rises) if up), default=0)


def kempner_loop(k: int) -> int:
    n, f = 1, 1
    while f % k:
        n += 1
        f = f * n % k
    return n


def order_loop(b: int, m: int) -> int:
    n, x = 1, b % m
    while x != 1:
        n, x = n + 1, x * b % m
    return n


def _sm(N: int, *div: int, not_by: int = 0) -> int:
    x = numbers(1, N)
    keep = np.zeros(len(x), dtype=bool)
    for d in div:
        keep |= x % d == 0
    if not_by:
        keep &= x % not_by != 0
    return int(x[keep].sum())


ALT: dict[tuple[str, int], Any] = {
    ("sum_multiples", 1): lambda N, k: sum(i for i in range(1, N) if i % k == 0),
    ("sum_multiples", 2): lambda N, a, b: _sm(N, a, b),
    ("sum_multiples", 3): lambda N, a, b, c: _sm(N, a, b, not_by=c),
    ("digit_sum", 1): lambda N, s: sum(1 for i in range(1, N) if sum(map(int, str(i))) == s),
    ("digit_sum", 2): lambda N, s: int((digit_sums(numbers(1, N)) == s).sum()),
    ("digit_sum", 3): lambda N, s, k: int(((digit_sums(x := numbers(1, N)) == s) & (x % k == 0)).sum()),
    ("primes", 1): lambda N: sum(map(is_prime, range(N))),
    ("primes", 2): lambda N: sum(p for p in range(N) if is_prime(p)),
    ("primes", 3): lambda N, g: sum(1 for p in range(N) if is_prime(p) and is_prime(p + g)),
    ("fibonacci", 1): lambda n, m: fib_loop(n, m),
    ("fibonacci", 2): lambda n, m: fib_loop(n, m),
    ("fibonacci", 3): lambda n, k: sum(1 for _ in _fib_zeros(n, k)),
    ("collatz", 1): lambda n: len(collatz_trajectory(n)) - 1,
    ("collatz", 2): lambda n: max(collatz_trajectory(n)),
    ("collatz", 3): lambda a, b: min(range(a, b + 1), key=lambda x: (-len(collatz_trajectory(x)), x)),
    ("divisors", 1): lambda n: sum(1 for d in range(1, n + 1) if n % d == 0),
    ("divisors", 2): lambda n: sum(d for d in range(1, n + 1) if n % d == 0),
    ("divisors", 3): lambda N, d: _divisor_counts(N)[1:].count(d),
    ("nth_prime", 1): lambda n: primes_by_trial()[n - 1],
    ("nth_prime", 2): lambda n: sum(primes_by_trial()[:n]),
    ("nth_prime", 3): lambda n, d: [p for p in primes_by_trial() if str(p).endswith(str(d))][n - 1],
    ("gcd", 1): lambda a, b: next(d for d in range(min(a, b), 0, -1) if a % d == 0 and b % d == 0),
    ("gcd", 2): lambda nums: math.prod(p ** max(trial_factor(x)[p] for x in nums)
                                       for p in set().union(*map(trial_factor, nums))),
    ("gcd", 3): lambda N: sum(math.gcd(i, N) for i in range(1, N + 1)),
    ("palindromes", 1): lambda a, b: sum(map(is_palindrome, range(a, b + 1))),
    ("palindromes", 2): lambda a, b: sum(i for i in range(a, b + 1) if is_palindrome(i)),
    ("palindromes", 3): lambda a, b, B: sum(1 for i in range(a, b + 1) if is_palindrome(i, B)),
    ("happy", 1): lambda n, k: functools.reduce(lambda x, _: squares_of_digits(x), range(k), n),
    ("happy", 2): lambda N: sum(map(is_happy, range(1, N + 1))),
    ("happy", 3): lambda N: sum(1 for p in range(N + 1) if is_prime(p) and is_happy(p)),
    ("coprime_pairs", 1): lambda N: sum(1 for a in range(1, N) if math.gcd(a, N - a) == 1),
    ("coprime_pairs", 2): lambda N: int((np.gcd.outer(numbers(1, N + 1), numbers(1, N + 1)) == 1).sum()),
    ("coprime_pairs", 3): lambda N, M, g: int((np.gcd.outer(numbers(1, N + 1), numbers(1, M + 1)) == g).sum()),
    ("sequence", 1): lambda s, a, c, m, n: lcg(s, a, c, m, n + 1)[-1],
    ("sequence", 2): lambda s, a, c, m, n: longest_rise(lcg(s, a, c, m, n)),
    ("sequence", 3): first_repeat_brent,
    ("smallest", 1): lambda r1, m1, r2, m2: next(x for x in itertools.count(1) if x % m1 == r1 and x % m2 == r2),
    ("smallest", 2): kempner_loop,
    ("smallest", 3): order_loop,
}


def _fib_zeros(n: int, k: int):
    """The i in 1..n with F(i) % k == 0, walking the sequence mod k once."""
    a, b = 1, 1  # F(1), F(2)
    for i in range(1, n + 1):
        if a % k == 0:
            yield i
        a, b = b, (a + b) % k


@functools.cache
def _divisor_counts(N: int) -> list[int]:
    """A divisor sieve: every d adds one to each of its multiples (the task's solver factorises)."""
    counts = [0] * (N + 1)
    for d in range(1, N + 1):
        for m in range(d, N + 1, d):
            counts[m] += 1
    return counts


def drawn(family: str, level: int, n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng, out = random.Random(f"test-{family}-{level}-{seed}"), []
    while len(out) < n:
        params = FAMILIES[family][level].draw(rng)
        if params is not None:
            out.append(params)
    return out


# ---------------------------------------------------------------- reference answers


def test_every_family_has_three_levels_and_a_second_implementation() -> None:
    assert len(FAMILIES) >= 10
    assert all(sorted(levels) == [1, 2, 3] for levels in FAMILIES.values())
    assert set(ALT) == {(f, lv) for f in FAMILIES for lv in (1, 2, 3)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_answers_match_a_second_implementation(family: str) -> None:
    for level, problem in FAMILIES[family].items():
        for params in drawn(family, level, SEEDS):
            assert problem.solve(**params) == ALT[family, level](**params), (family, level, params)


def test_worked_examples() -> None:
    # Small cases worked out by hand, for the families whose second implementation shares a definition with them.
    solve = {(f, lv): p.solve for f, levels in FAMILIES.items() for lv, p in levels.items()}
    assert solve["sum_multiples", 1](N=10, k=3) == 3 + 6 + 9
    assert solve["sum_multiples", 3](N=16, a=2, b=3, c=4) == 2 + 3 + 6 + 9 + 10 + 14 + 15
    assert solve["digit_sum", 3](N=100, s=9, k=2) == 5  # 18, 36, 54, 72, 90
    assert solve["primes", 3](N=20, g=2) == 4  # 3, 5, 11, 17 (19 + 2 = 21 is not prime)
    assert solve["fibonacci", 1](n=10, m=7) == 55 % 7 and solve["fibonacci", 3](n=12, k=4) == 2  # F(6)=8, F(12)=144
    assert solve["collatz", 1](n=6) == 8  # 6 3 10 5 16 8 4 2 1
    assert solve["collatz", 3](a=5, b=7) == 7  # 5: 5 steps, 6: 8, 7: 16
    assert solve["divisors", 2](n=12) == 28 and solve["nth_prime", 3](n=3, d=3) == 23  # 3, 13, 23
    assert solve["gcd", 3](N=6) == 1 + 2 + 3 + 2 + 1 + 6 and solve["happy", 1](n=23, k=2) == 10  # 23 -> 13 -> 10
    assert solve["palindromes", 3](a=1, b=10, B=3) == 5  # 1, 2, 4 (11), 8 (22), 10 (101)
    assert solve["coprime_pairs", 3](N=4, M=4, g=2) == 3  # (2, 2), (2, 4), (4, 2); (4, 4) has gcd 4
    assert solve["sequence", 3](s=0, a=2, c=1, m=7) == 3  # 0 1 3 0
    assert solve["smallest", 1](r1=0, m1=3, r2=0, m2=5) == 15 and solve["smallest", 3](b=2, m=7) == 3


@pytest.mark.parametrize("family, level, params, expected", [
    # Bounds where the bound itself qualifies: "less than N" leaves N out, "from a to b inclusive" keeps both ends.
    ("sum_multiples", 1, {"N": 12, "k": 3}, 3 + 6 + 9),
    ("digit_sum", 3, {"N": 90, "s": 9, "k": 2}, 4),  # 18, 36, 54, 72
    ("digit_sum", 2, {"N": 10_000, "s": 1}, 4),  # 1, 10, 100, 1000
    ("primes", 1, {"N": 13}, 5),
    ("primes", 2, {"N": 11}, 2 + 3 + 5 + 7),
    ("collatz", 3, {"a": 7, "b": 9}, 9),  # 7: 16 steps, 8: 3, 9: 19
    ("collatz", 3, {"a": 9, "b": 10}, 9),
    ("divisors", 3, {"N": 9, "d": 3}, 2),  # 4 and 9
    ("palindromes", 1, {"a": 11, "b": 22}, 2),
    ("palindromes", 2, {"a": 9, "b": 11}, 20),
    ("palindromes", 3, {"a": 5, "b": 7, "B": 2}, 2),  # 101 and 111
    ("happy", 2, {"N": 10}, 3),  # 1, 7, 10
    ("coprime_pairs", 2, {"N": 2}, 3),  # (1, 1), (1, 2), (2, 1)
    ("fibonacci", 3, {"n": 6, "k": 8}, 1),  # F(6) = 8
    ("sequence", 2, {"s": 1, "a": 2, "c": 0, "m": 100, "n": 3}, 3),  # 1 2 4
])
def test_bounds_are_as_stated(family: str, level: int, params: dict, expected: int) -> None:
    assert FAMILIES[family][level].solve(**params) == ALT[family, level](**params) == expected


def test_reference_solvers_are_fast() -> None:
    for family, levels in FAMILIES.items():
        for level, problem in levels.items():
            params = drawn(family, level, 20, seed=1)
            problem.solve(**params[0])  # builds the family's cached tables once
            for p in params:
                start = time.process_time()
                problem.solve(**p)
                assert time.process_time() - start < 0.05, (family, level, p)


def test_questions_state_every_parameter_and_answers_are_nonzero_integers() -> None:
    task = ProgramsTask(n_train=0, n_test=1000)
    for row in task.rows("test"):
        assert int(row["answer"]) != 0 and row["answer"] == str(int(row["answer"]))
        params = json.loads(row["params"])
        assert FAMILIES[row["family"]][row["level"]].solve(**params) == task.answer_of(row)
        for value in params.values():
            for v in value if isinstance(value, list) else [value]:
                assert re.search(rf"(?<!\d){v}(?!\d)", row["question"]), (v, row["question"])


# ---------------------------------------------------------------- splits and options


def test_splits_are_seeded_balanced_and_disjoint() -> None:
    a, b = ProgramsTask(), ProgramsTask()
    train, test = a.rows("train"), a.rows("test")
    assert train == b.rows("train") and test == b.rows("test") and len(train) == 5000 and len(test) == 500
    assert ProgramsTask(seed=1, n_train=50, n_test=50).rows("test") != ProgramsTask(n_train=50, n_test=50).rows("test")
    key = lambda r: (r["family"], r["level"], r["params"])  # noqa: E731
    train_keys, test_keys = {key(r) for r in train}, {key(r) for r in test}
    assert len(train_keys) == len(train) and len(test_keys) == len(test)  # no repeats within a split either
    assert not train_keys & test_keys
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for rows in (train, test):  # every (family, level) in turn: shares differ by at most one
        counts = Counter((r["family"], r["level"]) for r in rows)
        assert len(counts) == 3 * len(FAMILIES) and max(counts.values()) - min(counts.values()) <= 1


def test_no_test_problem_is_a_train_problem_of_any_other_configuration() -> None:
    """Train on level 1, evaluate on every level (run.eval_task): the two tasks draw from different streams, so the
    split must be a property of the problem, not of the task's options (2 of the first 102 mixed test problems were
    level-1 train problems before)."""
    key = lambda r: (r["family"], r["level"], r["params"])  # noqa: E731
    tests = {key(r) for cfg in ({"level": 0}, {"level": 1}, {"level": [2, 3]}, {"families": ["primes", "collatz"]})
             for r in ProgramsTask(**cfg).rows("test")}
    for cfg in ({"level": 0}, {"level": 1}, {"level": 2}, {"level": 3}, {"level": [1, 2]},
                {"level": 1, "families": ["nth_prime", "coprime_pairs"], "n_train": 600}):
        assert not {key(r) for r in ProgramsTask(**cfg).rows("train")} & tests, cfg
    assert {split_of(0, r) for r in ProgramsTask().rows("test")} == {"test"}


def test_level_and_family_options() -> None:
    assert ProgramsTask().levels == ProgramsTask(level="mixed").levels == (1, 2, 3)
    two = ProgramsTask(level=2, n_train=30, n_test=30)
    assert {r["level"] for r in two.rows("train")} == {2} and two.levels == (2,)
    some = ProgramsTask(level=[1, 3], families=["primes", "collatz"], n_train=40, n_test=10)
    assert {(r["family"], r["level"]) for r in some.rows("train")} == {(f, lv) for f in ("primes", "collatz")
                                                                         for lv in (1, 3)}
    for bad in (4, -1, "hard", [1, 1], [], True):
        with pytest.raises(TaskError, match="programs level must be 1, 2, 3, 0 or 'mixed'"):
            ProgramsTask(level=bad)
    with pytest.raises(TaskError, match="unknown families 'primez'"):
        ProgramsTask(families=["primez"])
    with pytest.raises(TaskError, match="n_train and n_test must be >= 0"):
        ProgramsTask(n_test=-1)
    with pytest.raises(TaskError, match="unknown split 'validation'"):
        two.rows("validation")
    with pytest.raises(TaskError, match="family 'nth_prime' level 1 has too few distinct problems"):
        ProgramsTask(level=1, families=["nth_prime"], n_train=1000, n_test=0).rows("train")  # n is 5..1000


def test_load_task_and_rollout_defaults() -> None:
    task = load_task("programs", level=3, seed=2, n_train=10, n_test=10)
    assert isinstance(task, ProgramsTask) and isinstance(task, Task) and task.levels == (3,) and task.seed == 2
    assert task.name == "programs" and task.tools == ("submit",)
    assert ProgramsTask.rollout_defaults == {"max_lines": 24, "max_line_tokens": 64, "max_total_tokens": 1536,
                                             "max_output_tokens": 64}


def test_header_says_how_to_submit_and_nothing_about_blocks() -> None:
    task = ProgramsTask(n_train=0, n_test=5)
    row = task.rows("test")[0]
    header = task.header(row)
    assert header == PROGRAMS_HEADER.format(question=row["question"])
    assert header.endswith(f"Problem: {row['question']}")
    assert "submit(answer)" in header and ">>> submit(total)" in header and row["answer"] not in PROGRAMS_HEADER
    assert not re.search(r"blank|empty|indent|\.\.\.|block|newline", PROGRAMS_HEADER, re.IGNORECASE)
    custom = ProgramsTask(n_train=0, n_test=5, header_template="[{family}] {question}")
    assert custom.header(row) == f"[{row['family']}] {row['question']}"
    with pytest.raises(TaskError, match=r"must not contain \{answer\}"):
        ProgramsTask(header_template="{question} {answer}")


def test_check_wants_the_exact_integer() -> None:
    task = ProgramsTask()
    row = {"question": "...", "answer": "5000000000", "family": "sum_multiples", "level": 3, "params": "{}"}
    for ok in [5000000000, "5000000000", "5,000,000,000", 5e9, "5000000000.0", "np.int64(5000000000)"]:
        assert task.check(row, ok), ok
    for wrong in [5000000001, 4999999999.0, 5000000000.5, "5e9 apples", None, True, "", [5000000000]]:
        assert not task.check(row, wrong), wrong  # 4999999999.0 is within the 1e-9 float tolerance of arithmetic


# ---------------------------------------------------------------- solutions typed into the real REPL

SOLUTIONS = {
    ("sum_multiples", 3): [
        "total = 0",
        "for i in range(1, {N}):",
        "    if (i % {a} == 0 or i % {b} == 0) and i % {c} != 0:",
        "        total += i",
        "",
        "submit(total)",
    ],
    ("collatz", 3): [
        "def steps(n):",
        "    count = 0",
        "    while n != 1:",
        "        n = n // 2 if n % 2 == 0 else 3 * n + 1",
        "        count += 1",
        "    return count",
        "",
        "best = max(range({a}, {b} + 1), key=lambda x: (steps(x), -x))",
        "submit(best)",
    ],
    ("sequence", 3): [
        "x, seen, i = {s}, {{{s}}}, 0",
        "while True:",
        "    x = ({a} * x + {c}) % {m}",
        "    i += 1",
        "    if x in seen:",
        "        break",
        "    seen.add(x)",
        "",
        "submit(i)",
    ],
    ("palindromes", 3): [
        "def digits(n, base):",
        "    out = []",
        "    while n:",
        "        out.append(n % base)",
        "        n //= base",
        "    return out",
        "",
        "count = sum(1 for v in range({a}, {b} + 1) if digits(v, {B}) == digits(v, {B})[::-1])",
        "count",
        "submit(count)",
    ],
    ("smallest", 2): [
        "n, f = 1, 1",
        "while f % {k}:",
        "    n += 1",
        "    f = f * n % {k}",
        "",
        "submit(n)",
    ],
}


async def _typed(pool: Any, lines: list[str]) -> ReplSession:
    async with pool.acquire() as kernel:
        session = ReplSession(kernel)
        for line in lines:
            await session.feed(line)
        return session


def test_multi_line_solutions_in_the_real_repl_submit_the_right_answer(pool) -> None:
    task = ProgramsTask(n_train=0, n_test=len(FAMILIES) * 3)  # one problem of every (family, level)
    rows = {(r["family"], r["level"]): r for r in task.rows("test")}
    for combo, template in SOLUTIONS.items():
        row = rows[combo]
        lines = [line.format(**json.loads(row["params"])) for line in template]
        session = run_sync(_typed(pool.pool, lines))
        assert "Traceback" not in session.transcript and "... \n>>> " in session.transcript, session.transcript
        call = session.tool_calls[0]
        assert call.name == "submit" and task.check(row, call.args[0]), (combo, call, row["answer"])
        assert not task.check(row, call.args[0] + 1)
