"""Built-in task ``programs``: generated problems whose answer takes a small program (a loop, a search, an aggregate).

"What is the sum of all positive integers less than 46249 that are divisible by 10 or by 13 (or by both)?"
-> 180978039. 13 families (see ``programs_families.FAMILIES``: sums of multiples, digit sums, primes, Fibonacci
numbers, Collatz steps, divisors, the n-th prime, gcd/lcm, palindromes, happy numbers, coprime pairs, a recurrence,
smallest-n searches), each in 3 levels. Answers are nonzero integers from a reference solver; a submission must
equal it exactly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from replrl.answers import parse_number
from replrl.tasks.base import TaskError
from replrl.tasks.generated import LEVELS, MAX_CONSECUTIVE_REPEATS, TEST_SHARE, GeneratedTask, hashed_split
from replrl.tasks.programs_families import FAMILIES

PROGRAMS_HEADER = (
    "Solve the problem using the Python REPL below. Write Python code that computes the answer, "
    "then call submit(answer) with the final integer. For example, for the sum of the squares of 1 to 10:\n"
    ">>> total = sum(i * i for i in range(1, 11))\n>>> submit(total)\n\nProblem: {question}"
)
"""Default header; ``{question}`` (and any other row field) is filled in. Override with ``header_template=``. It says
nothing about how the REPL runs a block (a blank line closes it): whether shaping teaches that is the experiment."""


@dataclass
class ProgramsTask(GeneratedTask):
    """Generated programming problems. Rows: {"question", "answer" (the integer as a string), "family", "level",
    "params" (the problem's parameters as JSON)}. A problem's split is decided by the problem itself (``split_of``),
    so no test problem is ever a train problem, whatever the level and family options of either task. Levels: 1
    (easy), 2 (medium), 3 (hard: larger parameters or a two-stage problem)."""

    name: ClassVar[str] = "programs"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    rollout_defaults: ClassVar[dict[str, int]] = {
        "max_lines": 24,
        "max_line_tokens": 64,
        "max_total_tokens": 1536,
        "max_output_tokens": 64,
    }
    """Rollout limits that fit multi-line work (RolloutConfig field -> value): a loop with a body, a blank line to
    close it, a print or two and ``submit`` take 6-12 lines; 24 leaves room to recover from an error. A line of up to
    64 tokens holds a generator expression; 1536 tokens hold the header (~150 tokens), 24 such lines and their output.
    The trainer applies them where the user's config leaves the field at its default."""

    header_template: str = PROGRAMS_HEADER
    """Header text; ``{question}`` is replaced by the problem."""
    family_table: ClassVar[dict[str, Any]] = FAMILIES

    def _draw(self, rng: random.Random, family: str, level: int) -> tuple[dict[str, Any], Any] | None:
        params = FAMILIES[family][level].draw(rng)
        return None if params is None else ({"family": family, "level": level, "params": json.dumps(params)}, params)

    def _finish(self, row: dict[str, Any], params: Any) -> dict[str, Any] | None:
        problem = FAMILIES[row["family"]][row["level"]]
        answer = problem.solve(**params)
        if answer == 0:  # never 0: a guessed submit(0) is never right
            return None
        return {"question": problem.question(params), "answer": str(answer), **row}

    def answer_of(self, row: dict) -> int:
        try:
            return int(row["answer"])
        except (KeyError, ValueError) as e:
            raise TaskError(f"programs answer {row.get('answer')!r} is not an integer") from e

    def check(self, row: dict, submitted: Any) -> bool:
        """Exact, with no float tolerance: the integer itself, its string ("1377", "1,377") or a float exactly equal to
        it (1377.0) pass; 1378 and 1377.0000001 fail (a large answer computed in floats may be off by a few units)."""
        value = parse_number(submitted)
        return value is not None and value == self.answer_of(row)


def split_of(seed: int, row: dict) -> str:
    """The split a problem belongs to: a function of the problem alone (``generated.hashed_split``)."""
    return hashed_split(ProgramsTask.split_prefix, seed, row)


__all__ = ["LEVELS", "MAX_CONSECUTIVE_REPEATS", "PROGRAMS_HEADER", "TEST_SHARE", "ProgramsTask", "split_of"]
