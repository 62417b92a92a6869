"""The problem families of the ``programs`` task: how each draws its parameters, states its question, and solves it.

A family has three levels: 1 easy, 2 medium (larger parameters, a sum instead of a count, ...), 3 hard (a two-stage
problem: a property on top of a search, a second condition, a less obvious loop). Every answer is a nonzero integer
computed by a reference solver that is fast (formulas and cached sieves: a problem's answer takes well under 50 ms,
most far under 1 ms) and exact; tests check each solver against a second, independent implementation. Parameters
stay small enough that a plain loop the model writes finishes well under a second (a REPL line has a 5 s limit):
primes stay below about 10,000, so even trial division by every smaller number takes well under a second.
"""

from __future__ import annotations

import functools
import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

PRIME_LIMIT = 200_000
"""The prime sieve covers the integers below this (every prime a solver needs is below it)."""
PALINDROME_LIMIT = 200_000
"""Palindromes are listed (per base) up to this; ranges of palindrome problems stay below it."""


@dataclass(frozen=True)
class Problem:
    """One family at one level."""

    draw: Callable[[random.Random], dict[str, Any] | None]
    """Random parameters (ints, or a tuple of ints); None when the draw is unusable (the caller draws again)."""
    text: str | Callable[..., str]
    """The question: a ``str.format`` template over the parameters, or a function of them."""
    solve: Callable[..., int]
    """The exact answer, called with the parameters as keyword arguments."""

    def question(self, params: dict[str, Any]) -> str:
        return self.text.format(**params) if isinstance(self.text, str) else self.text(**params)


# ---------------------------------------------------------------- shared number theory (cached tables)


@functools.cache
def primes() -> tuple[bytearray, list[int], list[int]]:
    """(sieve, the primes below PRIME_LIMIT, their prefix sums with a leading 0)."""
    sieve = bytearray([1]) * PRIME_LIMIT
    sieve[0:2] = b"\0\0"
    for i in range(2, math.isqrt(PRIME_LIMIT - 1) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytes(len(range(i * i, PRIME_LIMIT, i)))
    plist = [i for i in range(PRIME_LIMIT) if sieve[i]]
    return sieve, plist, [0, *accumulate(plist)]


def factorize(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1, by trial division with the sieve's primes."""
    factors: dict[int, int] = {}
    for p in primes()[1]:
        if p * p > n:
            break
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def divisors(n: int) -> list[int]:
    divs = [1]
    for p, e in factorize(n).items():
        divs = [d * p**k for d in divs for k in range(e + 1)]
    return sorted(divs)


def phi(n: int) -> int:
    return math.prod(p ** (e - 1) * (p - 1) for p, e in factorize(n).items())


def mobius(n: int) -> int:
    f = factorize(n)
    return 0 if any(e > 1 for e in f.values()) else (-1) ** len(f)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _lcm(*xs: int) -> int:
    return math.lcm(*xs)


# ---------------------------------------------------------------- sum_multiples


def _sum_div(n: int, k: int) -> int:
    """Sum of the positive multiples of k below n: k * (1 + 2 + ... + m), m = (n - 1) // k."""
    m = (n - 1) // k
    return k * m * (m + 1) // 2


def _sum_a_or_b(N: int, a: int, b: int) -> int:
    return _sum_div(N, a) + _sum_div(N, b) - _sum_div(N, _lcm(a, b))


def _draw_ab(r: random.Random, hi: int) -> tuple[int, int] | None:
    a, b = sorted(r.sample(range(2, hi + 1), 2))
    return None if b % a == 0 else (a, b)


def _sm2(r: random.Random) -> dict | None:
    ab = _draw_ab(r, 20)
    return ab and {"N": r.randint(1000, 50_000), "a": ab[0], "b": ab[1]}


def _sm3(r: random.Random) -> dict | None:
    ab, c = _draw_ab(r, 30), r.randint(2, 30)
    if ab is None or c in ab or ab[0] % c == 0 or ab[1] % c == 0:
        return None
    return {"N": r.randint(10_000, 100_000), "a": ab[0], "b": ab[1], "c": c}


SUM_MULTIPLES = {
    1: Problem(lambda r: {"N": r.randint(20, 2000), "k": r.randint(2, 12)},
               "What is the sum of all positive integers less than {N} that are divisible by {k}?",
               lambda N, k: _sum_div(N, k)),
    2: Problem(_sm2, "What is the sum of all positive integers less than {N} that are divisible by {a} or by {b} "
                     "(or by both)?", _sum_a_or_b),
    3: Problem(_sm3, "What is the sum of all positive integers less than {N} that are divisible by {a} or by {b} "
                     "(or by both) but not divisible by {c}?",
               lambda N, a, b, c: _sum_a_or_b(N, a, b) - _sum_a_or_b(N, _lcm(a, c), _lcm(b, c))),
}

# ---------------------------------------------------------------- digit_sum


@functools.cache
def _digit_table(k: int) -> list[list[list[int]]]:
    """t[L][s][r]: strings of L digits (leading zeros allowed) with digit sum s and value % k == r, for L <= 6."""
    t = [[[0] * k for _ in range(55)]]
    t[0][0][0] = 1
    for length in range(1, 7):
        row, p = [[0] * k for _ in range(55)], pow(10, length - 1, k)
        for d in range(10):
            for s in range(55 - d):
                for r, count in enumerate(t[length - 1][s]):
                    if count:
                        row[s + d][(d * p + r) % k] += count
        t.append(row)
    return t


def count_digit_sum(N: int, s: int, k: int = 1) -> int:
    """How many integers 1 <= x < N (N <= 10**6) have digit sum s and x % k == 0 (s >= 1): a digit-by-digit count."""
    table, digits = _digit_table(k), [int(c) for c in str(N)]
    total, prefix_sum, prefix_mod = 0, 0, 0
    for i, top in enumerate(digits):
        rest = len(digits) - i - 1
        for d in range(top):  # x agrees with N before position i and has a smaller digit d here: the rest is free
            need = s - prefix_sum - d
            if 0 <= need <= 9 * rest:
                head = (prefix_mod * 10 + d) * pow(10, rest, k) % k
                total += table[rest][need][-head % k]
        prefix_sum, prefix_mod = prefix_sum + top, (prefix_mod * 10 + top) % k
    return total


DIGIT_SUM = {
    1: Problem(lambda r: {"N": r.randint(100, 2000), "s": r.randint(2, 20)},
               "How many positive integers less than {N} have digits that add up to {s}?",
               lambda N, s: count_digit_sum(N, s)),
    2: Problem(lambda r: {"N": r.randint(10_000, 100_000), "s": r.randint(5, 40)},
               "How many positive integers less than {N} have digits that add up to {s}?",
               lambda N, s: count_digit_sum(N, s)),
    3: Problem(lambda r: {"N": r.randint(10_000, 100_000), "s": r.randint(5, 35), "k": r.randint(3, 13)},
               "How many positive integers less than {N} are divisible by {k} and have digits that add up to {s}?",
               count_digit_sum),
}

# ---------------------------------------------------------------- primes


def _twin_like(N: int, g: int) -> int:
    sieve, plist, _ = primes()
    return sum(1 for p in plist[:bisect_left(plist, N)] if sieve[p + g])


PRIMES = {
    1: Problem(lambda r: {"N": r.randint(30, 3000)}, "How many prime numbers are less than {N}?",
               lambda N: bisect_left(primes()[1], N)),
    2: Problem(lambda r: {"N": r.randint(1000, 10_000)}, "What is the sum of all prime numbers less than {N}?",
               lambda N: primes()[2][bisect_left(primes()[1], N)]),
    3: Problem(lambda r: {"N": r.randint(1000, 10_000), "g": r.choice((2, 4, 6))},
               "How many prime numbers p less than {N} are such that p + {g} is also a prime number? (p + {g} itself "
               "may be {N} or more.)", _twin_like),
}

# ---------------------------------------------------------------- fibonacci

FIB_DEF = "Let F(0) = 0, F(1) = 1 and F(i) = F(i-1) + F(i-2) for i >= 2 (the Fibonacci numbers). "


def fib_mod(n: int, m: int) -> int:
    """F(n) % m by fast doubling: F(2j) = F(j)(2F(j+1) - F(j)), F(2j+1) = F(j)^2 + F(j+1)^2."""
    a, b = 0, 1  # F(j), F(j+1) for j = the bits of n read so far
    for bit in bin(n)[2:]:
        a, b = a * (2 * b - a) % m, (a * a + b * b) % m
        if bit == "1":
            a, b = b, (a + b) % m
    return a


def _fib_rank(k: int) -> int:
    """The smallest i >= 1 with F(i) % k == 0; F(i) is divisible by k exactly when i is a multiple of it."""
    a, b, i = 1, 1, 1
    while a % k:
        a, b, i = b, (a + b) % k, i + 1
    return i


FIBONACCI = {
    1: Problem(lambda r: {"n": r.randint(20, 300), "m": r.randint(7, 1000)},
               FIB_DEF + "What is F({n}) % {m}, the remainder of F({n}) divided by {m}?", fib_mod),
    2: Problem(lambda r: {"n": r.randint(1000, 100_000), "m": r.randint(1000, 10**6)},
               FIB_DEF + "What is F({n}) % {m}, the remainder of F({n}) divided by {m}?", fib_mod),
    3: Problem(lambda r: {"n": r.randint(1000, 100_000), "k": r.randint(2, 500)},
               FIB_DEF + "How many of the numbers F(1), F(2), ..., F({n}) are divisible by {k}?",
               lambda n, k: n // _fib_rank(k)),
}

# ---------------------------------------------------------------- collatz

COLLATZ_RULE = ("Collatz rule: if a number is even, halve it; if it is odd, multiply it by 3 and add 1. "
                "Repeating the rule from any starting number eventually reaches 1. ")
_collatz_cache: dict[int, int] = {1: 0}


def collatz_steps(n: int) -> int:
    """Steps from n to 1, remembered for every number passed on the way."""
    path = []
    while n not in _collatz_cache:
        path.append(n)
        n = n // 2 if n % 2 == 0 else 3 * n + 1
    steps = _collatz_cache[n]
    for x in reversed(path):
        steps += 1
        _collatz_cache[x] = steps
    if len(_collatz_cache) > 2_000_000:  # bounded memory in a long-lived process
        _collatz_cache.clear()
        _collatz_cache[1] = 0
    return steps


def _collatz_peak(n: int) -> int:
    peak = n
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        peak = max(peak, n)
    return peak


def _collatz_longest(a: int, b: int) -> int:
    return max(range(a, b + 1), key=lambda x: (collatz_steps(x), -x))


def _range_draw(lo: int, hi: int, width: tuple[int, int]) -> Callable[[random.Random], dict[str, int]]:
    def draw(r: random.Random) -> dict[str, int]:
        a = r.randint(lo, hi)
        return {"a": a, "b": a + r.randint(*width)}
    return draw


COLLATZ = {
    1: Problem(lambda r: {"n": r.randint(2, 5000)},
               COLLATZ_RULE + "How many times must the rule be applied, starting from {n}, to reach 1?",
               collatz_steps),
    2: Problem(lambda r: {"n": r.randint(2, 100_000)},
               COLLATZ_RULE + "Starting from {n} and applying the rule until 1 is reached, what is the largest number "
               "seen (the starting number included)?", _collatz_peak),
    3: Problem(_range_draw(2, 18_000, (50, 2000)),
               COLLATZ_RULE + "Which starting number from {a} to {b} inclusive needs the most applications of the "
               "rule to reach 1? If several tie, give the smallest of them.", _collatz_longest),
}

# ---------------------------------------------------------------- divisors


@functools.cache
def _tau_table(limit: int = 5000) -> list[int]:
    return [0] + [math.prod(e + 1 for e in factorize(n).values()) for n in range(1, limit + 1)]


DIVISORS = {
    1: Problem(lambda r: {"n": r.randint(2, 5000)}, "How many positive divisors does {n} have (1 and {n} included)?",
               lambda n: _tau_table()[n]),
    2: Problem(lambda r: {"n": r.randint(1000, 200_000)},
               "What is the sum of all positive divisors of {n} (1 and {n} included)?",
               lambda n: sum(divisors(n))),
    3: Problem(lambda r: {"N": r.randint(100, 5000), "d": r.randint(2, 16)},
               "How many integers from 1 to {N} inclusive have exactly {d} positive divisors?",
               lambda N, d: _tau_table()[1:N + 1].count(d)),
}

# ---------------------------------------------------------------- nth_prime


@functools.cache
def _primes_ending(d: int) -> list[int]:
    return [p for p in primes()[1] if p % 10 == d]


NTH_PRIME = {
    1: Problem(lambda r: {"n": r.randint(5, 1000)},
               lambda n: f"In increasing order the prime numbers are 2, 3, 5, 7, 11, ... (2 is the 1st). "
                         f"What is the {ordinal(n)} prime number?",
               lambda n: primes()[1][n - 1]),
    2: Problem(lambda r: {"n": r.randint(100, 1200)},
               "What is the sum of the first {n} prime numbers (2 + 3 + 5 + 7 + ... , {n} terms)?",
               lambda n: primes()[2][n]),
    3: Problem(lambda r: {"n": r.randint(5, 300), "d": r.choice((1, 3, 7, 9))},
               lambda n, d: f"Consider the prime numbers whose last digit is {d}, in increasing order. "
                            f"What is the {ordinal(n)} of them?",
               lambda n, d: _primes_ending(d)[n - 1]),
}

# ---------------------------------------------------------------- gcd


def _gcd_draw(r: random.Random) -> dict[str, int] | None:
    g, x, y = r.randint(2, 400), r.randint(2, 250), r.randint(2, 250)
    return None if x == y else {"a": g * x, "b": g * y}


def _lcm_text(nums: tuple[int, ...]) -> str:
    listed = ", ".join(map(str, nums[:-1])) + f" and {nums[-1]}"
    return f"What is the least common multiple of {listed} (the smallest positive integer divisible by each of them)?"


GCD = {
    1: Problem(_gcd_draw, "What is the greatest common divisor of {a} and {b}?", lambda a, b: math.gcd(a, b)),
    2: Problem(lambda r: {"nums": tuple(r.sample(range(2, 61), r.randint(3, 5)))}, _lcm_text,
               lambda nums: math.lcm(*nums)),
    3: Problem(lambda r: {"N": r.randint(100, 50_000)},
               "What is the sum of gcd(i, {N}) over all integers i from 1 to {N} inclusive, where gcd is the greatest "
               "common divisor?", lambda N: sum(d * phi(N // d) for d in divisors(N))),
}

# ---------------------------------------------------------------- palindromes

PALINDROME = "A palindrome reads the same forwards and backwards (like 7, 44 or 1331). "


@functools.cache
def _palindromes(base: int) -> tuple[list[int], list[int]]:
    """The palindromes in ``base`` from 1 to PALINDROME_LIMIT, mirrored from their first halves, and prefix sums."""
    out, length = [], 1
    while base ** (length - 1) <= PALINDROME_LIMIT:
        half = (length + 1) // 2
        for x in range(base ** (half - 1), base**half):
            digits = []
            while x:
                x, r = divmod(x, base)
                digits.append(r)
            digits.reverse()  # most significant first
            value = 0
            for d in digits + digits[:length - half][::-1]:
                value = value * base + d
            out.append(value)
        length += 1
    out = sorted(v for v in out if v <= PALINDROME_LIMIT)
    return out, [0, *accumulate(out)]


def _pal_count(a: int, b: int, B: int = 10) -> int:  # noqa: N803 (B: the base, as the question names it)
    pal = _palindromes(B)[0]
    return bisect_right(pal, b) - bisect_left(pal, a)


def _pal_sum(a: int, b: int) -> int:
    pal, prefix = _palindromes(10)
    return prefix[bisect_right(pal, b)] - prefix[bisect_left(pal, a)]


def _base_draw(r: random.Random) -> dict[str, int]:
    a = r.randint(1, 80_000)
    return {"a": a, "b": a + r.randint(1000, 20_000), "B": r.randint(2, 9)}


PALINDROMES = {
    1: Problem(_range_draw(1, 9000, (100, 3000)),
               PALINDROME + "How many of the integers from {a} to {b} inclusive are palindromes?", _pal_count),
    2: Problem(_range_draw(10, 50_000, (1000, 50_000)),
               PALINDROME + "What is the sum of the integers from {a} to {b} inclusive that are palindromes?",
               _pal_sum),
    3: Problem(_base_draw,
               PALINDROME + "How many of the integers from {a} to {b} inclusive are palindromes when written in base "
               "{B} (without leading zeros)? For example 10 is 101 in base 3, a palindrome.", _pal_count),
}

# ---------------------------------------------------------------- happy

HAPPY_DEF = ("Replace a number by the sum of the squares of its digits (23 becomes 2*2 + 3*3 = 13). A number is "
             "happy if repeating this eventually reaches 1 (7 -> 49 -> 97 -> 130 -> 10 -> 1), otherwise it loops "
             "forever without reaching 1. ")
HAPPY_LIMIT = 20_000


def digit_squares(n: int) -> int:
    total = 0
    while n:
        n, d = divmod(n, 10)
        total += d * d
    return total


def _iterate_squares(n: int, k: int) -> int:
    for _ in range(k):
        n = digit_squares(n)
    return n


@functools.cache
def _happy_table() -> list[bool]:
    """happy[n] for n <= HAPPY_LIMIT: a number that is not happy falls into the cycle through 4."""
    small = [False] * 1000  # the digit squares of n < 10**5 are at most 5 * 81 = 405
    for n in range(1, 1000):
        x = n
        while x not in (1, 4):
            x = digit_squares(x)
        small[n] = x == 1
    return [False] + [small[n] if n < 1000 else small[digit_squares(n)] for n in range(1, HAPPY_LIMIT + 1)]


HAPPY = {
    1: Problem(lambda r: {"n": r.randint(10, 9999), "k": r.randint(2, 8)},
               "Start with {n} and replace the number by the sum of the squares of its digits (23 becomes "
               "2*2 + 3*3 = 13). Do this {k} times in total. What number do you end with?", _iterate_squares),
    2: Problem(lambda r: {"N": r.randint(100, HAPPY_LIMIT)},
               HAPPY_DEF + "How many happy numbers are there from 1 to {N} inclusive?",
               lambda N: sum(_happy_table()[1:N + 1])),
    3: Problem(lambda r: {"N": r.randint(1000, 10_000)},
               HAPPY_DEF + "How many prime numbers from 1 to {N} inclusive are happy?",
               lambda N: sum(_happy_table()[p] for p in primes()[1][:bisect_right(primes()[1], N)])),
}

# ---------------------------------------------------------------- coprime_pairs


@functools.cache
def _phi_prefix(limit: int = 1000) -> list[int]:
    return [0, *accumulate(phi(n) for n in range(1, limit + 1))]


def _pairs_with_gcd(N: int, M: int, g: int) -> int:
    """Pairs a <= N, b <= M with gcd g: pairs a' <= N // g, b' <= M // g that are coprime, by Moebius inversion."""
    n, m = N // g, M // g
    return sum(mobius(d) * (n // d) * (m // d) for d in range(1, min(n, m) + 1))


def _nm_draw(r: random.Random) -> dict[str, int]:
    return {"N": r.randint(20, 600), "M": r.randint(20, 600), "g": r.randint(1, 5)}


COPRIME_PAIRS = {
    1: Problem(lambda r: {"N": r.randint(10, 5000)},
               "How many ordered pairs (a, b) of positive integers with a + b = {N} have greatest common divisor 1? "
               "((1, 2) and (2, 1) are different pairs.)", lambda N: phi(N)),
    2: Problem(lambda r: {"N": r.randint(20, 1000)},
               "How many ordered pairs (a, b) of integers, with a and b each from 1 to {N} inclusive, have greatest "
               "common divisor 1? ((1, 2) and (2, 1) are different pairs.)",
               lambda N: 2 * _phi_prefix()[N] - 1),
    3: Problem(_nm_draw,
               "How many ordered pairs (a, b) of integers, with a from 1 to {N} inclusive and b from 1 to {M} "
               "inclusive, have greatest common divisor exactly {g}?", _pairs_with_gcd),
}

# ---------------------------------------------------------------- sequence (a linear congruential generator)


def lcg_term(s: int, a: int, c: int, m: int, n: int) -> int:
    """x(n) of x(0) = s, x(i+1) = (a x(i) + c) % m, by composing the affine map x -> A x + C with itself."""
    A, C, x = a % m, c % m, s % m  # (A, C): the map applied 2**j times
    while n:
        if n & 1:
            x = (A * x + C) % m
        A, C = A * A % m, (A * C + C) % m
        n >>= 1
    return x


def _lcg_longest_rise(s: int, a: int, c: int, m: int, n: int) -> int:
    best = run = 1
    x = s
    for _ in range(n - 1):
        y = (a * x + c) % m
        run = run + 1 if y > x else 1
        best, x = max(best, run), y
    return best


def _lcg_first_repeat(s: int, a: int, c: int, m: int) -> int:
    seen, x, i = {s: 0}, s, 0
    while True:
        x, i = (a * x + c) % m, i + 1
        if x in seen:
            return i
        seen[x] = i


def _lcg_draw(m_range: tuple[int, int], n_range: tuple[int, int] | None) -> Callable[[random.Random], dict]:
    def draw(r: random.Random) -> dict[str, int]:
        m = r.randint(*m_range)
        params = {"s": r.randint(0, m - 1), "a": r.randint(2, m - 1), "c": r.randint(1, m - 1), "m": m}
        return params | ({"n": r.randint(*n_range)} if n_range else {})
    return draw


LCG_DEF = "A sequence starts with x(0) = {s} and continues with x(i+1) = ({a} * x(i) + {c}) % {m}, where % is the " \
          "remainder. "

SEQUENCE = {
    1: Problem(_lcg_draw((100, 10_000), (10, 5000)), LCG_DEF + "What is x({n})?", lcg_term),
    2: Problem(_lcg_draw((100, 10_000), (50, 3000)),
               lambda n, **p: LCG_DEF.format(**p) + f"Among its first {n} terms x(0), x(1), ..., x({n - 1}), what is "
               "the length of the longest run of consecutive terms that is strictly increasing? (A single term is a "
               "run of length 1.)",
               _lcg_longest_rise),
    3: Problem(_lcg_draw((100, 5000), None),
               LCG_DEF + "What is the smallest i > 0 such that x(i) is equal to one of the earlier terms x(0), ..., "
               "x(i-1)?", _lcg_first_repeat),
}

# ---------------------------------------------------------------- smallest (searches)


def _crt_draw(r: random.Random) -> dict[str, int] | None:
    m1, m2 = r.sample(range(3, 61), 2)
    return None if math.gcd(m1, m2) != 1 else {"r1": r.randint(0, m1 - 1), "m1": m1, "r2": r.randint(0, m2 - 1),
                                                  "m2": m2}


def _crt(r1: int, m1: int, r2: int, m2: int) -> int:
    x = r1 + m1 * ((r2 - r1) * pow(m1, -1, m2) % m2)
    return x or m1 * m2


def _kempner(k: int) -> int:
    """The smallest n with k | n!: for each prime power p**e of k, the first multiple of p whose factorial holds e
    factors p (Legendre: n // p + n // p**2 + ...)."""
    best = 1
    for p, e in factorize(k).items():
        n = p
        while sum(n // p**j for j in range(1, e + 1)) < e:
            n += p
        best = max(best, n)
    return best


def _order_draw(r: random.Random) -> dict[str, int] | None:
    b, m = r.randint(2, 10), r.randint(3, 30_000)
    return None if math.gcd(b, m) != 1 else {"b": b, "m": m}


def _order(b: int, m: int) -> int:
    """The multiplicative order of b mod m: it divides phi(m); strip prime factors while b**t stays 1."""
    t = phi(m)
    for p in factorize(t):
        while t % p == 0 and pow(b, t // p, m) == 1:
            t //= p
    return t


SMALLEST = {
    1: Problem(_crt_draw, "What is the smallest positive integer that leaves remainder {r1} when divided by {m1} and "
                          "remainder {r2} when divided by {m2}?", _crt),
    2: Problem(lambda r: {"k": r.randint(10, 5000)},
               "What is the smallest positive integer n such that n! = 1 * 2 * ... * n is divisible by {k}?",
               _kempner),
    3: Problem(_order_draw, "What is the smallest positive integer n such that {b}**n leaves remainder 1 when divided "
                            "by {m}?", _order),
}

FAMILIES: dict[str, dict[int, Problem]] = {
    "sum_multiples": SUM_MULTIPLES,
    "digit_sum": DIGIT_SUM,
    "primes": PRIMES,
    "fibonacci": FIBONACCI,
    "collatz": COLLATZ,
    "divisors": DIVISORS,
    "nth_prime": NTH_PRIME,
    "gcd": GCD,
    "palindromes": PALINDROMES,
    "happy": HAPPY,
    "coprime_pairs": COPRIME_PAIRS,
    "sequence": SEQUENCE,
    "smallest": SMALLEST,
}
"""Family name -> level (1, 2, 3) -> Problem."""
