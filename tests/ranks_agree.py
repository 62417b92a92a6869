"""Two ranks decide alike at start: they claim run directories at once (``checkpoint.claim_run_dir``), as every rank
of ``replrl train`` does, and stop together on an error one of them found (``Ranks.agree``);
tests/test_multiprocess.py launches it with ``accelerate launch --multi_gpu --num_processes 2`` (gloo, CPU).

    accelerate launch --multi_gpu --num_processes 2 -m tests.ranks_agree ROOT

Each rank writes ROOT/outcome.rank<k>.json: for each case, "ok" or the error's class and message.

- "race": a new run directory, the main process's write slowed down and made visible half-way (half the config,
  1.5 s, the rest), rank 1 looking 0.5 s after rank 0 began. A rank that looked while the other wrote would read half
  a config and refuse the run alone (the failure CI met once, in a dynamic-sampling run: rank 1 exited, rank 0 waited
  at the next barrier until gloo dropped the pair). Both ranks must accept it.
- "other": the directory holds a different run's config: both ranks refuse it, with the same message.
- "nothing": resuming a directory without a checkpoint: both ranks refuse it.
- "agree_0", "agree_1": only rank 0 (then only rank 1) has a ConfigError: both ranks raise it, with its message.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from replrl import checkpoint
from replrl.configlib import ConfigError
from replrl.ranks import Ranks

CONFIG = "[run]\nseed = 0\n" + "".join(f"# line {i} of a config long enough to be written in two parts\n"
                                         for i in range(50))


def slow_visible_write(path: Path, text: str) -> None:
    """A write that another process can catch half-way (unlike the atomic one)."""
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
        f.flush()
        time.sleep(1.5)
        f.write(text[len(text) // 2:])


def claim(ranks: Ranks, run_dir: Path, resume: bool = False) -> str:
    try:
        checkpoint.claim_run_dir(run_dir, CONFIG, resume, ranks)
    except checkpoint.RunDirError as err:
        return f"RunDirError: {err}"
    return "ok"


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size())
    outcome = {}

    if ranks.main:
        checkpoint._write_atomic = slow_visible_write
    dist.barrier()
    if not ranks.main:
        time.sleep(0.5)  # rank 0 is inside its write by now, if it writes before every rank has looked
    outcome["race"] = claim(ranks, root / "race")
    outcome["race_config"] = (root / "race" / "config.toml").read_text() == CONFIG

    other = root / "other"
    if ranks.main:
        other.mkdir()
        (other / "config.toml").write_text("[run]\nseed = 1\n")
    dist.barrier()
    outcome["other"] = claim(ranks, other)
    outcome["nothing"] = claim(ranks, root / "race", resume=True)

    for k in (0, 1):
        try:
            ranks.agree(ConfigError(f"found by rank {k} only") if ranks.rank == k else None)
            outcome[f"agree_{k}"] = "ok"
        except ConfigError as err:
            outcome[f"agree_{k}"] = f"{type(err).__name__}: {err}"

    (root / f"outcome.rank{ranks.rank}.json").write_text(json.dumps(outcome))
    ranks.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
