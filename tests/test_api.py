"""The notebook API's resource ownership: a generator that ``evaluate`` / ``sample_episodes`` load is closed before
they return (a vLLM engine holds processes and GPU memory: a notebook that evaluates twice must not hold two
engines), a Trainer's generator stays open until the trainer is closed."""

from __future__ import annotations

from pathlib import Path

import pytest

import replrl.evaluation
from replrl import api
from replrl.backends.hf import HFGenerator
from replrl.trainer import Trainer
from tests.test_trainer import toy_config


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The generators whose ``close`` was called (the real one still runs)."""
    seen: list[object] = []
    real = HFGenerator.close

    def spy(generator: HFGenerator) -> None:
        seen.append(generator)
        real(generator)

    monkeypatch.setattr(HFGenerator, "close", spy)
    return seen


def test_a_generator_the_api_loads_is_closed_and_a_trainer_s_is_not(
    format_model_dir: Path, tmp_path: Path, closed: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = toy_config(format_model_dir)
    trajs = api.sample_episodes(str(format_model_dir), n=2, cfg=cfg)
    assert len(trajs) == 2 and len(closed) == 1
    scores = api.evaluate(str(format_model_dir), n=2, cfg=cfg)
    assert scores["episodes"] == 2 and len(closed) == 2 and closed[0] is not closed[1]  # each call its own, closed
    with monkeypatch.context() as m, pytest.raises(ValueError, match="no problems in split"):  # closed on an error
        m.setattr(replrl.evaluation, "split_rows", lambda task, split: [])  # a split without problems
        api.sample_episodes(str(format_model_dir), n=2, cfg=cfg)
    assert len(closed) == 3

    with Trainer(cfg, tmp_path / "run", progress=False) as trainer:
        api.evaluate(trainer, n=2)
        api.sample_episodes(trainer, n=2)
        assert len(closed) == 3  # the trainer's generator is the trainer's
    assert closed[-1] is trainer.generator  # closed when the trainer is
