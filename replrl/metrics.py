"""Per-step metrics: ``metrics.jsonl`` in the run directory (plus TensorBoard when installed), sample transcripts."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .types import Trajectory

log = logging.getLogger(__name__)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return rows


class MetricsWriter:
    """Appends one JSON object per step. On resume, lines after the resumed step (written after the last checkpoint
    by the interrupted run) are dropped first, so the file continues as one consistent series."""

    def __init__(self, run_dir: str | Path, resume_after: int = 0, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= resume_after] if resume_after else []
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_after + 1)
            except ImportError:
                log.info("tensorboard is not installed: metrics go to metrics.jsonl only")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def samples(self, step: int, trajs: Sequence[Trajectory], file: str = "samples.jsonl",
                extra: dict[str, Any] | None = None) -> None:
        """Append episodes (one JSON object each, with the step and ``extra``) to ``file`` in the run directory."""
        with open(self.run_dir / file, "a") as f:
            for t in trajs:
                f.write(json.dumps({"step": step, **(extra or {}), **t.to_dict()}) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
