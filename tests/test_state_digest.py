"""The interpreter-state digest the kernel reports after a line (real sandboxed kernels), and its encoding."""

from __future__ import annotations

import re

from sandbox import Limits, SyncKernel, empty_state
from sandbox._kernel_digest import BUDGET, MAX_CHARS, state_digest

HEX16 = re.compile(r"[0-9a-f]{16}")


def digest_after(pool, lines):
    """The state digest after running ``lines`` one by one (REPL mode) in a fresh kernel."""
    with pool.acquire() as kernel:
        result = None
        for line in lines:
            result = kernel.execute(line, mode="single", digest=True)
            assert result.status == "ok", (line, result)
        return result.state


def test_equal_states_match_in_two_kernels_and_different_ones_differ(pool):
    a = digest_after(pool, ["x = [1, 2.5, 'three']", "d = {'k': (1, None), 'j': {3, 2, 1}}", "y = x[0] + 4174"])
    b = digest_after(pool, ["d = {'j': {1, 2, 3}, 'k': (1, None)}", "y = 4175", "x = [1, 2.5, 'three']"])
    assert a.named == b.named and a.values == b.values  # order of assignment, set order, dict order: irrelevant
    c = digest_after(pool, ["d = {'j': {1, 2, 3}, 'k': (1, None)}", "y = 4176", "x = [1, 2.5, 'three']"])
    assert c.named != a.named and c.values != a.values
    assert HEX16.fullmatch(a.named) and HEX16.fullmatch(a.values) and a.names == 3 and a.marked == 0


def test_values_digest_ignores_names(pool):
    a = digest_after(pool, ["a = 4175"])
    total = digest_after(pool, ["total = 4175"])
    assert a.values == total.values and a.named != total.named
    # a function is its code, not its name or its argument names
    f = digest_after(pool, ["def f(x): return x + 1\n"])
    g = digest_after(pool, ["def g(y): return y + 1\n"])
    h = digest_after(pool, ["def h(y): return y + 2\n"])
    assert f.values == g.values != h.values and f.named != g.named


def test_what_is_not_state(pool):
    fresh = empty_state(("submit",))
    # an expression's value (kept in builtins._), `_`, dunders, the tool, a failed line: the state is the fresh one
    after = digest_after(pool, ["1 + 1", "_ = 5", "__x__ = 3", "submit", "print('hi')"])
    assert (after.named, after.values, after.names) == (fresh.named, fresh.values, 0)
    # the host's digest of a fresh kernel is the kernel's own
    with pool.acquire() as kernel:
        assert kernel.execute("pass", mode="single", digest=True).state.named == fresh.named
    # a module counts, by its name
    math = digest_after(pool, ["import math"])
    m = digest_after(pool, ["import math as m"])
    assert math.values == m.values != fresh.values and math.named != m.named


def test_unrepresentable_and_huge_values_are_markers(pool):
    huge = digest_after(pool, [f"s = 'a' * {MAX_CHARS + 1}"])
    other = digest_after(pool, [f"s = 'b' * {MAX_CHARS + 1}"])
    assert huge.marked == 1 and huge.named == other.named  # past the bound only the type is seen
    obj = digest_after(pool, ["class A:\n    def __repr__(self): raise RuntimeError('never called')\n", "o = A()"])
    assert obj.marked == 1 and obj.names == 2  # the class is `class A`, the instance the marker <A>
    sub = digest_after(pool, ["class I(int):\n    def __eq__(s, o): return True\n", "i = I(3)"])
    assert sub.marked == 1
    many = digest_after(pool, ["big = list(range(10**6))", "gen = (i for i in big)", "n = 2 ** 100000"])
    assert many.marked == 3 and many.ms < 50
    small = digest_after(pool, ["x = list(range(100))"])
    assert small.marked == 0


def test_the_digest_time_is_reported_and_bounded(pool):
    with pool.acquire() as kernel:
        ms = []
        for line in ["a = 1", "b = [a] * 500", "c = {i: str(i) for i in range(900)}", "d = [c] * 900"]:
            state = kernel.execute(line, mode="single", digest=True).state
            assert state is not None and state.ms > 0
            ms.append(state.ms)
        assert max(ms) < 100  # BUDGET elements at most, whatever the namespace holds
        assert kernel.execute("e = 1", mode="single").state is None  # only when asked for


def test_only_hashes_leave_the_kernel(tmp_path):
    # the reply carries two hashes and counts: no value of the namespace, however it was computed
    secret = "the-answer-is-8350"
    with SyncKernel(Limits(wall_s=5.0), tools=["submit"]) as kernel:
        result = kernel.execute(f"s = {secret!r}", mode="single", digest=True)
        state = result.state
        assert secret not in repr(result) and set(vars(state)) == {"named", "values", "ms", "marked", "names"}
        assert HEX16.fullmatch(state.named) and HEX16.fullmatch(state.values)
        # code that replaces the kernel's digest function can forge the field: a malformed one is dropped
        kernel.execute("import __main__\n__main__._state_digest = lambda ns, hidden: {'named': 5, 'values': 'x' * 99}",
                       mode="exec")
        forged = kernel.execute("print('x')", mode="single", digest=True)
        assert forged.status == "ok" and forged.output == "x\n" and forged.state is None


def test_the_encoding_is_bounded_and_canonical():
    # pure function: the budget turns values past it into markers; -0.0 and 0.0, 1 and True, 1 and 1.0 differ
    big = {f"v{i}": list(range(900)) for i in range(40)}
    assert state_digest(big)["marked"] > 0 and 40 * 901 > BUDGET
    keys = [state_digest({"x": v})["values"] for v in (0.0, -0.0, 1, True, 1.0, "1", b"1", (1,), [1], {1}, None)]
    assert len(set(keys)) == len(keys)
    assert state_digest({"x": {1: 2, 3: 4}})["named"] == state_digest({"x": {3: 4, 1: 2}})["named"]
