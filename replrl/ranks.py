"""``Ranks``: this process's place among a run's processes (``accelerate launch``) and the collectives a step needs:
dealing items, gathering objects, and the few reductions of flags and figures that keep the ranks deciding alike.
With one process every one of them is the identity, so a caller needs no branch on the world size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def sole_owner(t: Any, patience: float) -> bool:
    """Wait, the GIL released, until nothing but ``t``'s own Python object holds the tensor (a collective's worker
    thread has dropped its reference), at most ``patience`` seconds. Whether it did."""
    import time

    count = getattr(t, "_use_count", None)  # the C++ reference count (private to torch: without it, a short wait)
    if count is None:
        time.sleep(min(patience, 0.1))
        return True
    deadline = time.monotonic() + patience
    while count() > 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of a run, and its collectives (identities with one process)."""

    rank: int = 0
    world: int = 1
    device: Any = None
    """Where the reductions run (the accelerator's device)."""

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share of ``items`` (every rank holds the same list): items rank, rank + world, ..."""
        return list(items[self.rank::self.world])

    def owns(self, j: int) -> bool:
        """Whether the ``j``-th item dealt round-robin is this rank's."""
        return j % self.world == self.rank

    def gather(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order (the list itself with one process)."""
        if self.world == 1:
            return items
        from accelerate.utils import gather_object

        return gather_object(items)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (so all stop together)."""
        if self.world == 1:
            return flag
        return bool(self._reduce([int(flag)], "MAX", "long")[0])

    def agree(self, error: Exception | None) -> None:
        """Raise on every process if any process has an ``error`` (a user error, such as a ``ConfigError``, that
        this process found and the others may not have): its own, else the lowest rank's, as the same class and
        message. So every rank stops with the same one line, instead of the others waiting for it at their next
        collective until gloo or NCCL drops the pair with a traceback."""
        if self.world > 1:
            import torch.distributed as dist

            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, None if error is None else (type(error), str(error)))
            found = [e for e in every if e is not None]
            if error is None and found:
                cls, message = found[0]
                error = cls(message)
        if error is not None:
            raise error

    def close(self, patience: float = 10.0) -> None:
        """The end of a run that finished on every process: wait for every rank, then tear the process group down
        while the interpreter is whole. A no-op with one process; not for a failing run (a rank that raised never
        arrives at the barrier).

        The barrier is an all-reduce of a tensor of this rank's device (NCCL's own barrier guesses a device), and
        ``close`` returns only once the backend's worker thread has let go of that tensor (``sole_owner``). A gloo
        worker drops a finished collective's tensors after the caller has been told it is done, and a tensor that
        Python made needs the GIL to be dropped; if the interpreter is already finalizing then, the worker thread is
        ended in a destructor and the process dies by SIGABRT ("terminate called without an active exception",
        after the run's work was all written): 11 in 40 two-process FSDP2 launches on a loaded 2-core machine
        when the last collective was an ``any``, 0 in 40 with ``close`` (bench/teardown.py)."""
        import torch
        import torch.distributed as dist

        if self.world > 1 and dist.is_available() and dist.is_initialized():
            token = torch.zeros(1, device=self.device)
            dist.all_reduce(token)
            sole_owner(token, patience)
            dist.destroy_process_group()

    def all(self, flags: list[bool]) -> list[bool]:
        """Whether each of ``flags`` holds on every process."""
        if self.world == 1:
            return list(flags)
        return [bool(v) for v in self._reduce([int(f) for f in flags], "MIN", "long")]

    def max(self, values: list[int]) -> list[int]:
        """The largest of each of ``values`` over the processes."""
        if self.world == 1:
            return list(values)
        return [int(v) for v in self._reduce(values, "MAX", "long")]

    def sum(self, value: float) -> float:
        """``value`` summed over the processes (in float64)."""
        if self.world == 1:
            return value
        return float(self._reduce([float(value)], "SUM", "float64")[0])

    def sum_and_max(self, value: float, count: int) -> tuple[float, int]:
        """(the sum of ``value``, the largest ``count``) over the processes, in one collective."""
        if self.world == 1:
            return value, count
        import torch

        mine = torch.tensor([float(value), float(count)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(every, mine)
        return float(sum(float(t[0]) for t in every)), int(max(float(t[1]) for t in every))

    def _reduce(self, values: list[Any], op: str, dtype: str) -> list[Any]:
        """An all-reduce of ``values`` as a tensor of ``dtype`` ("long", "float64"); ``op``: SUM, MAX or MIN."""
        import torch

        t = torch.tensor(values, dtype=getattr(torch, dtype), device=self.device)
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
        return t.tolist()
