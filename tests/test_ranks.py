"""``Ranks`` (replrl/ranks.py): with one process every collective is the identity; with two gloo processes on the CPU
each gives what the trainer's hand-written collectives gave (any, all, max, sum in float64, sum and max in one;
``gather`` is accelerate's ``gather_object``, which needs an accelerator: tests/test_multiprocess.py runs it);
``close`` waits for the late rank and leaves no process group; ``sole_owner`` waits until nothing else holds a
tensor."""

from __future__ import annotations

import os
import socket

import pytest

from replrl.ranks import Ranks

pytestmark = pytest.mark.timeout(120)


def test_one_process_needs_no_branch():
    one = Ranks()
    assert one.main and one.share([1, 2, 3]) == [1, 2, 3] and one.owns(5) and one.gather(["a"]) == ["a"]
    assert one.any(True) is True and one.all([True, False]) == [True, False] and one.max([3, 1]) == [3, 1]
    assert one.sum(2) == 2 and one.sum_and_max(1.5, 4) == (1.5, 4)
    assert Ranks(1, 2).share([0, 1, 2, 3, 4]) == [1, 3] and Ranks(1, 2).owns(3) and not Ranks(1, 2).main


def test_closing_one_process_is_a_no_op():
    import torch.distributed as dist

    Ranks().close()
    assert not dist.is_initialized()


def test_sole_owner_waits_until_no_other_reference_holds_the_tensor():
    """What ``close`` waits for after its barrier: the collective's worker thread letting go of the tensor (here,
    a saved tensor of an autograd graph that another thread drops 0.3 s later: a C++ reference, as the worker's)."""
    import threading
    import time

    import torch

    from replrl.ranks import sole_owner

    t = torch.zeros(2, requires_grad=True)
    held = {"graph": t * t}  # the graph saves t: C++ references beside t's Python object
    assert t._use_count() > 1
    assert sole_owner(t, patience=0.05) is False  # still held: it gives up after its patience
    threading.Timer(0.3, held.clear).start()
    start = time.monotonic()
    assert sole_owner(t, patience=10) is True
    assert time.monotonic() - start >= 0.25 and t._use_count() == 1


def _two_ranks(rank: int, port: int, out: str) -> None:
    import json
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = Ranks(rank, 2, "cpu")
    got = {"any": ranks.any(rank == 1), "none": ranks.any(False), "all": ranks.all([True, rank == 0]),
           "max": ranks.max([rank, 5 - rank]), "sum": ranks.sum(0.1 + rank),
           "sum_and_max": list(ranks.sum_and_max(1.0 + rank, 3 * rank + 1))}
    if rank == 1:  # the late rank: it marks its arrival at the end of the run, after rank 0 is already there
        time.sleep(1.0)
        open(f"{out}.arrived", "w").close()
    ranks.close()
    got["waited_for_the_late_rank"] = os.path.exists(f"{out}.arrived")
    got["group_left"] = dist.is_initialized()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def test_two_gloo_ranks_agree(tmp_path):
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "got")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_two_ranks, args=(port, out), nprocs=2)
    for rank in (0, 1):
        got = json.loads(open(f"{out}.{rank}").read())
        assert got == {"any": True, "none": False, "all": [True, False], "max": [1, 5], "sum": pytest.approx(1.2),
                       "sum_and_max": [3.0, 4], "waited_for_the_late_rank": True, "group_left": False}
