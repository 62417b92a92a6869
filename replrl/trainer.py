"""The GRPO trainer. One step = numbered stages mirroring the data flow:

    1. sample problems          (a seeded permutation of the training split; the position is checkpointed: draw.py)
    2. group rollouts           (group_size episodes per problem, all at once: draw.py -> rollout/groups.py)
       (tree.branch_at: each group is a tree whose leaves are its episodes: rollout/tree.py)
       (rollout.dynamic_sampling: 1-2 in waves until enough groups have a contrast: draw.py, dynamic_sampling.py)
    3. rewards                  (per line, attached during the rollout: rewards.py; the figures: _rollout_figures)
    4. advantages               (outcome or per-line estimator: advantages.py; _advantages)
    5. loss and optimizer steps (clipped surrogate: loss.py; epochs x minibatches x micro-batches: update,
                                 _update_on_every_rank), then the new weights to the sampler (_publish_weights)
    6. log / evaluate / checkpoint

Written against ``accelerate.Accelerator`` (device placement, gradient accumulation, mixed precision on GPU), so
``accelerate launch`` scales it unchanged; the collectives between ranks are ``ranks.Ranks``'s (``self.ranks``), run
by the learner only: stages 1-2 are the rollout side's (``self.drawer``, draw.py), which draws this rank's share with
no collective inside; the ranks agree on the draw once per step (``draw.agree``, one gather), then the update's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from sandbox.limits import hides_host_files
from sandbox.protocols import Pool

from . import checkpoint
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    batch_tensors,
    compute_advantages,
    correct_negative,
    line_advantage_stats,
)
from .backends import SleepingGenerator, open_generator
from .config import Config
from .configlib import ConfigError, to_dict, to_toml
from .contract import TokenMasks, token_masks
from .draw import Drawer, Drawn, ProblemStream, agree
from .dynamic_sampling import WAVE_SEED_STRIDE, check_signal, group_has_contrast
from .evaluation import EvaluationStopped, eval_config, evaluate, extra_eval_config, split_rows
from .loss import TokenScorer, agg_units, grpo_loss, masked_mean, rows_by_length
from .metrics import EvalWaves, MetricsWriter, missing_trackers, open_trackers
from .policy import (
    apply_lora_config,
    check_distributed,
    check_trainable,
    enable_gradient_checkpointing,
    fsdp2_on_cpu,
    fsdp_wrap_decoder_layers,
    load_policy,
    mixed_precision,
    same_adapters_on_every_rank,
    shard_like,
)
from .predict_output import OutputPrediction, score_episodes
from .provenance import record_environment
from .ranks import Ranks
from .rewards import RewardModel
from .rollout import Env, EpisodeRules, TreeShape, summarize
from .tasks import task_from_config
from .types import SamplingParams, Trajectory

log = logging.getLogger(__name__)
console = logging.getLogger("replrl.console")
"""What a run tells its user as it goes (held-out results, a spent time budget): `replrl train` shows it at its
default log level."""
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the sandbox forks; keep tokenizers quiet about it


def _fresh_accelerator_state(precision: str) -> None:
    """accelerate keeps one state per process and refuses another mixed precision later: in a single process (a
    notebook's second run, a test after another) whose earlier Trainer used another precision, start it afresh.
    Under several processes it is left alone (every Trainer of a launched run has the same config)."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and int(os.environ.get("WORLD_SIZE", "1")) == 1 and str(state.get("_mixed_precision")) != precision:
        AcceleratorState._reset_state()


def _autocast_forward(model: torch.nn.Module, accelerator: Any) -> None:
    """Run ``model``'s forward under accelerate's autocast, in whatever thread calls it (the hf generator's)."""
    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def warn_readable_dataset(isolation: str, nodes: list[dict], data: str, label: str = "") -> None:
    """Say in one line that the model's code can read a dataset's file where the kernels' level has no filesystem
    view: this machine's level (``nodes`` empty), or on the Ray nodes whose level is that (``nodes``: their
    reports; there the file is readable where a node holds it: a shared file system, a copy)."""
    if hides_host_files(isolation):
        return
    if not nodes and label:
        log.warning("sandbox isolation %r has no filesystem view: the model's code can read the %s dataset %s",
                    isolation, label, data)
    elif not nodes:
        log.warning("sandbox isolation %r has no filesystem view: the model's code can read the dataset %s (and its "
                    "answers); install bubblewrap for the allowlisted view", isolation, data)
    else:
        weak = ", ".join(f"{str(n['node_id'])[:12]} ({n.get('host')}, {n['isolation']})" for n in nodes
                         if not hides_host_files(n["isolation"]))
        log.warning("sandbox isolation %r on Ray node(s) %s: no filesystem view, so the model's code can read files "
                    "of those nodes; a %sdataset there (%s, on a shared file system or a copy) can be read with its "
                    "answers; install bubblewrap on those nodes for the allowlisted view", isolation, weak,
                    f"{label} " if label else "", data)


def isolation_record(isolation: str, nodes: list[dict]) -> dict[str, Any]:
    """What ``environment.jsonl`` records of the sandbox: this machine's level, or with kernels on Ray
    ``"ray:LEVEL"`` (the weakest of the nodes' levels) and each node's level by its Ray node id."""
    if not nodes:
        return {"isolation": isolation}
    return {"isolation": f"ray:{isolation}", "ray_nodes": {str(n["node_id"]): n["isolation"] for n in nodes}}


class NullMetrics:
    """What a process other than the main one writes: nothing."""

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def samples(self, step: int, trajectories: list[Trajectory], **kwargs: Any) -> None:
        pass

    def logged(self, step: int, label: str) -> None:
        return None

    def eval_waves(self, step: int, label: str) -> None:
        return None

    def close(self) -> None:
        pass


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]
    trajectories: list[Trajectory]


class HeldOut(NamedTuple):
    """A held-out task: "eval" (the training task, or run.eval_task), "transfer" (run.transfer_task) or
    "eval_<label>" (a run.extra_eval table); its figures are logged as <label>/<metric>."""

    label: str
    cfg: Config
    task: Any
    n: int


class Trainer:
    """``Trainer(cfg, run_dir).train()``; ``resume=True`` continues the run in ``run_dir`` at its next step."""

    skip_zero_gradient = True
    """Skip the backward of a micro-batch whose gradient is exactly zero (no advantage, no KL term): the update is
    the same, faster (False: run every backward, as a check of that claim)."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True, *,
                 task: Any = None, reward_funcs: Sequence[Callable[..., Any]] = (), lora: Any = None):
        """``task``: a Task object to train on instead of ``cfg.task``'s (from Python: ``replrl.train(task=...)``).
        ``reward_funcs``: episode-level reward functions (callables) beside ``cfg.rewards.functions``.
        ``lora``: a ``peft.LoraConfig`` for the adapters (its rank, alpha, dropout and target modules are written
        into ``cfg.model``, so the run's config.toml records them; fields it cannot carry are refused)."""
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        if lora is not None:
            cfg = dataclasses.replace(cfg, model=apply_lora_config(cfg.model, lora))
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        # the kernels' sandbox level (this machine's; with kernel_backend = ray, the weakest of the Ray nodes that take
        # kernels, kernel_nodes their reports); no sandbox where kernels would run: one line now, before any work
        self.isolation, self.kernel_nodes = cfg.rollout.kernel_isolation()
        cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
        check_trainable(cfg.model, cpu)  # precision and adapters this machine cannot train: one line, now
        # broadcast_buffers off: the buffers of a causal LM (rotary tables) are the same on every rank, and DDP would
        # otherwise broadcast them at each synchronised forward
        precision = mixed_precision(cfg.model, cpu)
        _fresh_accelerator_state(precision)
        check_distributed(None)  # what the launch asked (FSDP1, DeepSpeed, ...): refused in one line
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=precision,
                                       kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        fsdp2_on_cpu(self.accelerator)  # an FSDP2 config on a CPU: sharded over gloo, not accelerate's silent DDP
        check_distributed(self.accelerator.distributed_type)  # and what accelerate chose (XLA, ...)
        # Processes (`accelerate launch`): each rank rolls out whole problems (a GRPO group never spans ranks), the
        # update runs through the model accelerate prepared (DDP reduces the gradients, bucketed and overlapped with
        # the backward), and only the main process writes files (nanoGPT's master_process).
        self.main = self.accelerator.is_main_process
        self.fsdp = bool(getattr(self.accelerator, "is_fsdp2", False))
        """The model is sharded (FSDP2): every rank holds a part of each parameter, gradient and AdamW state."""
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        if cfg.rollout.problems_per_step < self.world:
            raise ConfigError(f"rollout.problems_per_step ({cfg.rollout.problems_per_step}) must be >= the number of "
                              f"processes ({self.world}): each process rolls out whole problems")
        if cfg.advantages.estimator not in ADVANTAGE_ESTIMATORS:  # now, not at the end of the first rollout
            raise ConfigError(f"advantages.estimator: unknown estimator {cfg.advantages.estimator!r}; known: "
                              f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))} (register yours with "
                              "@replrl.advantages.advantage_estimator before training)")
        check_signal(cfg.rollout.dynamic_sampling_signal)
        # every reward term and function resolves (a user's by import path): one line now, before any work
        self.rewards = RewardModel(cfg.rewards.weights, cfg.rewards.gates,
                                   functions=[*cfg.rewards.functions, *reward_funcs])
        self.ranks = Ranks(self.rank, self.world, self.accelerator.device)
        # a tracker not installed: one line now, before any work, on every rank (only the main process reports)
        self.ranks.agree(missing_trackers(cfg.run.report_to) if self.main else None)
        checkpoint.claim_run_dir(self.run_dir, to_toml(cfg), resume, self.ranks)
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        self.task = task if task is not None else task_from_config(cfg)
        if getattr(self.task, "data", None):
            warn_readable_dataset(self.isolation, self.kernel_nodes, self.task.data)
        self.train_rows = split_rows(self.task, cfg.task.train_split, cfg.task.limit)
        # held-out tasks, loaded now so that a bad one fails before any training
        self.held_out = [HeldOut("eval", cfg, self.task, cfg.run.eval_n)]
        if cfg.run.eval_task:
            eval_cfg = eval_config(cfg, cfg.run.eval_task)
            self.held_out[0] = HeldOut("eval", eval_cfg, task_from_config(eval_cfg), cfg.run.eval_n)
        if cfg.run.transfer_task and cfg.run.transfer_n:
            transfer_cfg = eval_config(cfg, cfg.run.transfer_task, fresh=True)
            self.held_out.append(HeldOut("transfer", transfer_cfg, task_from_config(transfer_cfg),
                                         cfg.run.transfer_n))
        for extra in cfg.run.extra_evals():
            extra_cfg = extra_eval_config(cfg, extra)
            self.held_out.append(HeldOut(extra.prefix[:-1], extra_cfg, task_from_config(extra_cfg), extra.n))
        for label, _, task, _ in self.held_out:
            if tuple(task.tools) != tuple(self.task.tools):
                raise ConfigError(f"the {label} task {task.name!r} injects other tools ({', '.join(task.tools)}) "
                                  f"than the training task ({', '.join(self.task.tools)})")
            if task is not self.task and getattr(task, "data", None):
                warn_readable_dataset(self.isolation, self.kernel_nodes, task.data, label)
        model, self.tokenizer = load_policy(cfg.model, seed=cfg.run.seed,
                                            checkpoint=checkpoint.latest(self.run_dir) if resume else None)
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.loss.kl_coef > 0 else None
        if cfg.optim.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas,
                                      weight_decay=cfg.optim.weight_decay)
        # The scheduler is not prepared: accelerate's wrapper steps it once per process per step.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        scorer = TokenScorer(model)
        if scorer.unused_parameters():  # trainable parameters outside the decoder and the LM head: DDP looks for them
            self.accelerator.ddp_handler = DistributedDataParallelKwargs(broadcast_buffers=False,
                                                                         find_unused_parameters=True)
        same_adapters_on_every_rank(self.accelerator, model)  # FSDP2 + LoRA: rank 0's adapters (DDP broadcasts)
        fsdp_wrap_decoder_layers(self.accelerator, model)  # FSDP2: the decoder layers are the sharded units
        self.scorer, self.optimizer = self.accelerator.prepare(scorer, optimizer)
        """The update's scoring module as accelerate prepared it (DDP under several processes): every forward of the
        update goes through it, so the wrapper's gradient reduction runs."""
        self.model = model
        """The policy itself (not wrapped; its parameters are the scorer's): generation, checkpoints, weight sync."""
        if self.accelerator.mixed_precision != "no":  # the hf sampler computes as the update does (accelerate gave
            _autocast_forward(model, self.accelerator)  # the scorer's forward the same autocast)
        self._grad_scale = self.world if self.world > 1 else 1
        """DDP averages the gradients over ranks; each rank's loss is weighted by its share of the minibatch, whose
        sum over ranks is the minibatch's loss: scaled by the number of ranks, the average is that sum."""
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        self.ref_scorer = None if self.ref_model is None else \
            shard_like(self.scorer, TokenScorer(self.ref_model), self.accelerator)
        """The reference model's scorer (FSDP2: sharded in the policy's units, ``policy.shard_like``)."""
        self.generator = open_generator(cfg.model, self.model, self.tokenizer, device=self.accelerator.device,
                                        max_rows=cfg.rollout.group_size * self._local_problems())
        if cfg.model.vllm_sleep and not isinstance(self.generator, SleepingGenerator):
            raise ConfigError(f"model.vllm_sleep puts vLLM's engine to sleep during the update; the backend here is "
                              f"{type(self.generator).__name__}: set model.backend = vllm or vllm_sleep = false")
        self.rules = EpisodeRules.from_config(cfg.rollout)
        self.tree = TreeShape.from_config(cfg.tree)
        self.pad_id = self.generator.pad_id
        self.predict_output = OutputPrediction(cfg.loss.predict_output, cfg.loss.predict_output_metrics)
        """loss.predict_output: the cross-entropy on the interpreter's output tokens (off: nothing added)."""
        self.step = 0
        self.drawer = Drawer(cfg.rollout, self.tree, self.wave_sampling, ProblemStream(self.train_rows, cfg.run.seed),
                             self.rank, self.world)
        """The rollout side (draw.py): its Env (opened in ``train``), the problem stream, each step's draw."""
        self._resumed = resume
        if resume:
            self._resume()
            self.generator.version = self.step  # opened from the checkpoint's weights: that step's policy
        self._gathered = False
        self._warned_scoring = False  # the held-out output-prediction figures skipped (_held_out_scoring), said once
        """FSDP2 with the hf backend: the whole weights are gathered for the rollouts (``_gather_for_rollouts``)."""
        self._root_ran = False
        """The FSDP root (the prepared scorer) has run a forward, which initialises every unit."""
        self._gather_for_rollouts()
        self.metrics = MetricsWriter(self.run_dir, resume_after=self.step, trackers=open_trackers(
            cfg.run.report_to, self.run_dir, cfg.run.project, to_dict(cfg), self.step)) if self.main else NullMetrics()
        if self.main:  # which code and libraries this stretch of the run ran on (a resumed run may differ)
            record_environment(self.run_dir, self.step, backend=cfg.model.backend, device=str(self.accelerator.device),
                               processes=self.world, **isolation_record(self.isolation, self.kernel_nodes))
        self._banned: TokenMasks | None = None
        self._stop = False
        self._evaluating = False
        """A held-out evaluation is running (what Ctrl-C waits for)."""
        self._saved_step = self.step
        self.evals: dict[str, dict[str, float]] = {}
        """Held-out evaluations: "before" (the untrained model; a resumed run's from its metrics) and "after" (the
        last one); "transfer_before" and "transfer_after" likewise, and "<label>_before", "<label>_after" for each
        other held-out task (eval_explore_before, ...)."""
        for held in self.held_out:
            logged = self.metrics.logged(0, held.label) if self.step else None  # step 0's: the untrained model
            if logged is not None:
                self.evals[self._evals_key(held.label, "before")] = logged
        self.curves: Path | None = None

    # -- set-up ----------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        path = checkpoint.latest(self.run_dir)
        assert path is not None
        if self.fsdp:
            state = checkpoint.load_sharded(path, self.scorer, self.optimizer.optimizer, self.scheduler)
        else:
            state = checkpoint.load_state(path, self.optimizer, self.scheduler)
        self.step = state["step"]
        self.drawer.problems.position = state["data_position"]
        log.info("resumed from %s (step %d)", path, self.step)

    def _lr_factor(self, step: int) -> float:
        o, total = self.cfg.optim, self.cfg.run.max_steps
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        frac = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
        if o.schedule == "linear":
            return max(1.0 - frac, 0.0)
        if o.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0

    @property
    def sampling(self) -> SamplingParams:
        return self.wave_sampling(0)

    def wave_sampling(self, wave: int) -> SamplingParams:
        """Sampling of this step's ``wave`` (dynamic sampling's later waves get seeds of their own)."""
        return self.cfg.rollout.sampling(seed=self.cfg.rollout.seed * 1_000_003 + self.step + wave * WAVE_SEED_STRIDE)

    def banned(self, vocab_size: int) -> TokenMasks:
        if self._banned is None or len(self._banned.anywhere) != vocab_size:
            device = self.accelerator.device
            self._banned = TokenMasks(*(m.to(device) for m in token_masks(self.tokenizer, vocab_size)))
        return self._banned

    # -- the loop --------------------------------------------------------------------------------------------
    def train(self, on_step: Callable[[StepResult], Any] | None = None) -> Path:
        """Train until run.max_steps (or Ctrl-C: the step in flight finishes, a checkpoint is saved, exit 0).
        ``on_step(result)`` runs after each step (and its checkpoint and evaluation): a notebook's live curve."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        # Ctrl-C, and in a single process SIGTERM (`kill PID`, a scheduler's notice), finish the step and save. Under
        # several ranks SIGTERM keeps its own action: torchrun sends it when a rank dies, and a rank that went on to
        # finish its step would wait for the dead one.
        stops = (signal.SIGINT, signal.SIGTERM) if self.world == 1 else (signal.SIGINT,)
        previous = {sig: signal.getsignal(sig) for sig in stops}
        for sig in stops:
            signal.signal(sig, self._on_sigint)
        bar = tqdm(total=cfg.run.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.progress and self.main), dynamic_ncols=True)
        deadline = time.monotonic() + 60 * cfg.run.time_budget_min if cfg.run.time_budget_min else math.inf
        rollouts = contextlib.ExitStack()
        try:
            # the rollout side opens its Env: a kernel pool of group_size kernels per problem of this rank's share,
            # with own kernel uids per rank of this machine (uids are per machine: the local rank, not the global one)
            pool = rollouts.enter_context(self.drawer.open(
                cfg, pool_size=cfg.rollout.group_size * self._local_problems(), generator=self.generator,
                task=self.task, rewards=self.rewards,
                uid_base=70000 + 20000 * self.accelerator.local_process_index)).pool
            if self.main and cfg.run.eval_n and cfg.run.eval_before and self.step == 0:  # untrained, same problems
                self.evaluate_all(pool, "before")
            if self.main and cfg.run.eval_n and self._resumed and self._eval_due(self.step):
                self.evaluate_all(pool)  # the parts a kill interrupted; finished ones are kept
            while self.step < cfg.run.max_steps and not self._stop:
                result = self.train_step()
                bar.update(1)
                m = result.metrics
                budget = {} if deadline == math.inf else {"budget_left": f"{(deadline - time.monotonic()) / 60:.1f}m"}
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", acc=f"{m['accuracy']:.2f}",
                                syntax=f"{m['syntax_error_rate']:.2f}", **budget, refresh=False)
                if self.main and not self.progress:  # no bar (a log file): a line a step instead
                    log.info("step %d/%d: reward %.3f, accuracy %.2f, syntax errors %.2f per line, %.1f lines per "
                             "episode; %.0f s (rollout %.0f s, update %.0f s)", self.step, cfg.run.max_steps,
                             m["reward_mean"], m["accuracy"], m["syntax_error_rate"], m["lines_per_episode"],
                             m["step_s"], m["rollout_s"], m["update_s"])
                if cfg.run.save_every and self.step % cfg.run.save_every == 0:
                    self.save()
                if self.main and cfg.run.eval_n and self._eval_due(self.step):
                    self.evaluate_all(pool)
                if on_step is not None:
                    on_step(result)
                # every rank stops after the same step, and for the same reason (Ctrl-C skips the last evaluation)
                self._stop = self.ranks.any(self._stop)
                out_of_time = self.ranks.any(time.monotonic() > deadline)
                if self._stop or out_of_time:
                    if out_of_time:
                        console.info("run.time_budget_min (%g min) spent after step %d of %d", cfg.run.time_budget_min,
                                     self.step, cfg.run.max_steps)
                    break
            if self.step and self._saved_step != self.step:  # the end of the run, or Ctrl-C
                self.save()
            if self.step and cfg.run.save_model:  # the final policy, in Hugging Face format (merged LoRA)
                self.save_model()
            if self.main and cfg.run.eval_n and self.step and not self._stop and not self._eval_due(self.step):
                self.evaluate_all(pool, "after")
        finally:
            bar.close()
            rollouts.close()  # the rollout side's pool
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.metrics.close()
        if self.step and self.main:
            from .plot import plot_run

            self.curves = plot_run(self.run_dir)
        return self.run_dir

    def _eval_due(self, step: int) -> bool:
        """Whether run.eval_every puts a held-out evaluation after ``step``."""
        return bool(self.cfg.run.eval_every) and step % self.cfg.run.eval_every == 0

    def _weights_checksum(self) -> float:
        """The sum of every weight of the policy: each rank's own copy under DDP (the ranks' must agree); under FSDP2
        the sum over ranks of each rank's shards (one figure, the same on every rank), or of the gathered weights."""
        from torch.distributed.tensor import DTensor

        params = list(self.model.parameters())
        local = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum()) for p in params)
        if self.world > 1 and any(isinstance(p, DTensor) for p in params):
            return self.ranks.sum(local)
        return local

    def _fsdp_units(self) -> list[Any]:
        """The FSDP2 units of the prepared scorer: the decoder layers, then the root (the TokenScorer)."""
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.scorer.modules() if isinstance(m, FSDPModule)][::-1]

    def _gather_for_rollouts(self) -> None:
        """FSDP2 with a generator that samples from the policy itself (hf): the whole weights gathered once, after
        the update, for the rollouts and evaluations, so that ranks with different numbers of lines never wait on
        each other (every sampling forward would otherwise gather the parameters: a collective). Costs the whole
        model in memory, in the all-gather dtype, until ``_reshard`` before the next update. A vLLM engine holds its
        own copy: nothing to gather."""
        if not self.fsdp or self._gathered or self.generator.own_weights:
            return
        if not self._root_ran:  # FSDP initialises its units in the root's first forward: one before any layer
            ids = torch.full((1, 2), self.pad_id, device=self.accelerator.device)  # runs alone in a rollout
            with torch.no_grad():
                self.scorer(ids, torch.ones_like(ids), self.sampling, with_entropy=False)
            self._root_ran = True
        for unit in self._fsdp_units():
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        self._gathered = True

    def _reshard(self) -> None:
        """Free what ``_gather_for_rollouts`` gathered: each unit back to its shard, resharding after forward again
        (the decoder layers as the accelerate config says, the root never, as torch's default for it)."""
        if not self._gathered:
            return
        plugin = self.accelerator.state.fsdp_plugin
        units = self._fsdp_units()
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(bool(plugin.reshard_after_forward) and unit is not units[-1],
                                           recurse=False)
        self._gathered = False

    @contextlib.contextmanager
    def _sharded(self) -> Any:
        """The weights as shards for the block (a checkpoint's state dicts), gathered again after it if they were."""
        gathered = self._gathered
        self._reshard()
        try:
            yield
        finally:
            if gathered:
                self._gather_for_rollouts()

    def close(self) -> None:
        """Release the generator (a vLLM engine's processes and GPU memory; nothing for the HF backend). The trainer
        can still be saved and its model read; with vLLM it cannot sample again (one-line EngineStopped). ``with
        Trainer(...) as t:`` closes on exit."""
        self.generator.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> str:
        """The run in a few lines: held-out accuracy and per-line syntax-error rate before -> after, where it is."""
        before, after = self.evals.get("before"), self.evals.get("after")
        lines = [f"trained {self.step} steps; run directory: {self.run_dir}"]
        def pct(d: dict | None, k: str) -> str:
            return "  -" if d is None or k not in d else f"{100 * d[k]:3.0f}%"

        if after:
            n = int(after.get("episodes", self.cfg.run.eval_n))
            lines += [f"held-out ({n} problems of {self.cfg.task.name} {self.cfg.task.eval_split}):  before -> after",
                      f"  accuracy                  {pct(before, 'accuracy')} -> {pct(after, 'accuracy')}",
                      f"  submitted an answer       {pct(before, 'submit_rate')} -> {pct(after, 'submit_rate')}",
                      f"  syntax errors per line    {pct(before, 'syntax_error_rate')} -> "
                      f"{pct(after, 'syntax_error_rate')}"]
            for level in sorted(k for k in after if k.startswith("accuracy_level")):
                lines.append(f"  {level.replace('_', ' '):<26}{pct(before, level)} -> {pct(after, level)}")
        transfer_after = self.evals.get("transfer_after")
        if transfer_after:
            transfer = next(h for h in self.held_out if h.label == "transfer")
            before = self.evals.get("transfer_before")
            lines += [f"transfer ({int(transfer_after['episodes'])} problems of {transfer.task.name} "
                      f"{transfer.cfg.task.eval_split}):",
                      f"  accuracy                  {pct(before, 'accuracy')} -> {pct(transfer_after, 'accuracy')}"]
        for held in self.held_out[1:]:
            if held.label == "transfer":
                continue
            extra_after = self.evals.get(self._evals_key(held.label, "after"))
            if extra_after:
                before = self.evals.get(self._evals_key(held.label, "before"))
                lines += [f"{held.label} ({int(extra_after['episodes'])} problems of {held.task.name} "
                          f"{held.cfg.task.eval_split}):",
                          f"  accuracy                  {pct(before, 'accuracy')} -> {pct(extra_after, 'accuracy')}"]
        if self.curves is not None:
            lines.append(f"learning curves: {self.curves}")
        return "\n".join(lines)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop:  # a second Ctrl-C (or SIGTERM): stop now (the last checkpoint stays intact, sandboxes close)
            raise KeyboardInterrupt
        self._stop = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self._evaluating:  # its finished waves are on disk; the checkpoint of this step is saved or comes next
            then = "saving a checkpoint, then exiting" if self.step else "then exiting (no step to save yet)"
            log.warning("%s: finishing the evaluation's wave in flight (finished waves are kept), %s (again to "
                        "abort)", what, then)
        else:
            log.warning("%s: finishing this step, saving a checkpoint, then exiting (again to abort)", what)

    def env(self, pool: Pool, task: Any = None, rules: EpisodeRules | None = None) -> Env:
        """What this step's episodes run with: the policy's generator, ``pool``, ``task`` and its ``rules`` (the
        training task's by default), the reward weights scheduled for this step, ``[model]``'s chat template."""
        model = self.cfg.model
        return Env(self.generator, pool, task or self.task, rules or self.rules, self.rewards.at(self.step),
                   chat_template=model.chat_template, chat_template_kwargs=model.chat_template_kwargs)

    def _local_problems(self) -> int:
        """Problems this rank samples a step (the kernel pool holds ``group_size`` kernels for each)."""
        return -(-self.cfg.rollout.problems_per_step // self.world)

    def train_step(self) -> StepResult:
        """One training step, its six stages (inside ``train``: the rollout side's Env is open); the step's figures
        are written, and returned with this rank's episodes."""
        cfg, t_step = self.cfg, time.perf_counter()
        assert self.drawer.env is not None, "train_step runs inside train(), which opens the rollout side's Env"
        pool = self.drawer.env.pool
        self.model.eval()  # the policy samples in eval mode, without gradients
        boots = pool.boots_while_busy
        # 1-2. problems and group rollouts (flat, trees, or dynamic sampling's waves) on this rank: draw.py, which
        # runs no collective
        drawn = self.drawer.draw(self.step, stop=lambda: self._stop)
        # 1-2b. the ranks' agreement, once per step (one gather): every rank's groups, the tree/ and dynsamp/ figures
        # over every rank, the stream's furthest position
        drawn = agree(drawn, self.ranks.gather([drawn.summary()]), cfg.rollout.group_size)
        self.drawer.problems.position = drawn.position
        if drawn.waves is not None and drawn.waves.bound_reached and self.main:
            contrast = sum(c for w in drawn.waves.records for c in w.contrast)
            log.info("step %d: %d of %d groups with a contrast after %d waves (the bound); training on those",
                     self.step + 1, contrast, cfg.rollout.problems_per_step, len(drawn.waves.records))
        t_rollout = time.perf_counter() - t_step
        # 3. rewards: attached per line during the rollout; the step's figures report each term, over all ranks'
        # episodes (with dynamic sampling: every episode drawn, kept or not, so accuracy stays the policy's)
        metrics = self._rollout_figures(drawn, self.rewards.at(self.step), boots=pool.boots_while_busy - boots)
        # 4. advantages (the estimator takes the options of cfg.advantages it declares)
        batch, adv = self._advantages(drawn.mine, metrics)
        # 5. loss and optimizer step(s)
        t_update = time.perf_counter()
        if cfg.model.vllm_sleep:  # the engine's KV cache and weights freed for the update's memory
            cast(SleepingGenerator, self.generator).sleep()
        metrics.update(self._update_on_every_rank(batch, adv))
        # 5b. publish the new weights to the sampler (vLLM: copied in memory, prefix cache dropped; HF: nothing)
        metrics.update(self._publish_weights())
        self.scheduler.step()
        self.step += 1
        # 6. log (evaluation and checkpoints are decided in train())
        metrics.update({"rollout_s": t_rollout, "update_s": time.perf_counter() - t_update,
                        "step_s": time.perf_counter() - t_step, "lr": self.scheduler.get_last_lr()[0],
                        "data_position": self.drawer.problems.position})
        self.metrics.write(self.step, metrics)
        if self.main and cfg.run.log_samples_every and self.step % cfg.run.log_samples_every == 0:
            self.metrics.samples(self.step, [g[0] for g in drawn.groups[:2]])
        return StepResult(self.step, metrics, drawn.mine)

    def _rollout_figures(self, drawn: Drawn, rewards: RewardModel, boots: int) -> dict[str, float]:
        """Stage 3's figures: ``summarize`` over every group of every rank, the groups with a contrast, dynamic
        sampling's figures, the kernels booted beside the rollout (idle refill: only when short), the scheduled
        reward weights."""
        every_rank = [t for g in drawn.groups for t in g]  # every group of every rank, in the order drawn
        metrics = summarize(every_rank, drawn.stats)
        metrics["groups_with_contrast"] = sum(group_has_contrast(g, self.cfg.rollout.dynamic_sampling_signal)
                                              for g in drawn.groups)
        metrics.update(drawn.figures)
        metrics["pool/boots_in_rollout"] = boots
        metrics.update(rewards.scheduled_weights())  # weight/<term> of every scheduled term
        return metrics

    def _advantages(self, trajs: list[Trajectory], metrics: dict[str, float]) -> tuple[dict[str, torch.Tensor],
                                                                                          torch.Tensor]:
        """Stage 4: this rank's batch and advantages [B, T]; adds the advantages' figures to ``metrics``."""
        cfg = self.cfg
        batch = batch_tensors(trajs, self.pad_id)
        self.predict_output.add_mask(batch, trajs)  # batch["output_mask"] (loss.predict_output)
        adv = compute_advantages(cfg.advantages.estimator, batch, **vars(cfg.advantages))       # [B, T]
        negative, n_correct = correct_negative(adv, batch["loss_mask"], batch["correct"])
        n_correct = self.ranks.sum(n_correct)
        if n_correct:  # the share of correct episodes pushed down on some token (e.g. by summed line penalties)
            metrics["adv/correct_negative_frac"] = self.ranks.sum(negative) / n_correct
        metrics.update(line_advantage_stats(adv, batch))  # how much lines of an episode differ (this rank's)
        return batch, adv

    def _update_on_every_rank(self, batch: dict[str, torch.Tensor], adv: torch.Tensor) -> dict[str, float]:
        """Stage 5: ``update``'s statistics; under several ranks their mean over the ranks, and how far the ranks'
        weights drifted apart (``rank_weight_drift``, 0: every rank holds the same weights)."""
        update_stats = self.update(batch, adv)
        if self.world == 1:
            return update_stats
        update_stats["weights_checksum"] = self._weights_checksum()
        per_rank = self.ranks.gather([update_stats])
        sums = [r.pop("weights_checksum") for r in per_rank]
        update_stats = {k: sum(r[k] for r in per_rank) / len(per_rank) for k in per_rank[0]}
        update_stats["rank_weight_drift"] = max(sums) - min(sums)
        return update_stats

    def _publish_weights(self) -> dict[str, float]:
        """Stage 5b: the sampler gets the new weights (a sleeping vLLM engine woken first); the sync's time, its
        transport, and the trainer's GPU memory peak."""
        figures: dict[str, float] = {}
        t_sync = time.perf_counter()
        if self.cfg.model.vllm_sleep:
            cast(SleepingGenerator, self.generator).wake()
        self.generator.sync_weights(self.model, self.step + 1)  # the policy after this step's update
        figures["time/sync_weights_s"] = time.perf_counter() - t_sync
        if transport := self.generator.last_sync_transport:
            figures[f"sync/{transport}"] = 1.0  # which way the weights went (vLLM's auto: cuda_ipc or shm)
        device = self.accelerator.device
        if device.type == "cuda":  # the trainer's own peak (a vLLM engine's memory is its process's, not in this)
            figures["mem/trainer_gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            figures["mem/trainer_gpu_reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
        return figures

    def update(self, batch: dict[str, torch.Tensor], adv: torch.Tensor) -> dict[str, float]:
        """epochs x minibatches optimizer steps over the batch; each minibatch accumulates micro-batches.

        Every rank runs the same collectives in the same order, whatever its share of the step's rows (trees and
        dynamic sampling deal ranks different numbers): as many minibatches, micro-batches and no-grad scoring
        passes as the rank with the most, the missing ones padded with micro-batches of weight 0, and a backward
        skipped only where every rank skips it. DDP needs it for its one reduction a minibatch, FSDP for every
        forward and backward (each gathers the parameters)."""
        cfg, device = self.cfg, self.accelerator.device
        self._reshard()
        self.model.train()
        B = batch["input_ids"].shape[0]
        sampling = self.sampling
        # reused samples, or a compute dtype the sampler did not run in: the old policy is the current one, scored
        # as the update scores it (so the first ratio is exactly 1)
        if cfg.optim.epochs > 1 or cfg.optim.minibatches > 1 or cfg.model.compute_dtype not in ("", cfg.model.dtype):
            old = self._logprobs_no_grad(self.scorer, batch, sampling)
        else:  # one pass on fresh samples: the sampler's own log-probs are the old policy's
            old = batch["old_logprobs"]
        ref = None if self.ref_scorer is None else self._logprobs_no_grad(self.ref_scorer, batch, sampling)
        totals: dict[str, float] = {}
        count = micros = skipped = empty = 0
        kl_term = ref is not None and bool(cfg.loss.kl_coef)
        gen = torch.Generator().manual_seed(cfg.run.seed + self.step)
        scored_adv = adv.masked_fill(batch["loss_mask"] == 0, 0.0)                           # [B, T]
        # each minibatch's rows by length (those without a scored advantage first: their micro-batches skip the
        # backward): a micro-batch is as long as its longest row, so like lengths together score fewer pad tokens
        # (a default-run batch: 1.36x its real tokens in the order drawn, 1.12x so). The loss is the same sum.
        by_length = rows_by_length(batch["attention_mask"], scored_adv.ne(0).any(1))
        # torch.chunk gives fewer parts than asked for some sizes (5 rows in 4: 3 parts): the most over the ranks
        n_minibatches = self.ranks.max([len(torch.arange(B).chunk(cfg.optim.minibatches))])[0]
        for _ in range(cfg.optim.epochs):
            order = torch.randperm(B, generator=gen) if cfg.optim.minibatches > 1 else torch.arange(B)
            minibatches = list(order.chunk(cfg.optim.minibatches))
            minibatches += [order[:0]] * (n_minibatches - len(minibatches))  # empty: padding micro-batches only
            for mb in minibatches:
                mb = by_length(mb)
                self.optimizer.zero_grad(set_to_none=True)
                weights, share = self._micro_weights(batch, mb)
                self.predict_output.start_minibatch(batch, mb, self.ranks.sum, self._grad_scale)
                # zero advantage on every scored token (or a weight of 0) and no KL term: the gradient is exactly
                # zero, so only the forward runs (for the logged statistics), without autograd and without a
                # backward; under several ranks, only where every rank's micro-batch j is so
                skippable = self.skip_zero_gradient and not kl_term
                skips = [skippable and (w == 0.0 or not bool(scored_adv[micro].any())) for micro, w, _ in weights]
                skips = self.predict_output.keep_backward(skips, weights, batch)
                order = list(range(len(weights)))
                if self.world > 1:
                    skips = self.ranks.all(skips)
                    # DDP reduces in the minibatch's last backward, which every rank must run: the skipped
                    # micro-batches go first (the same order on every rank), and the last one runs its backward
                    # even at a zero gradient
                    order.sort(key=lambda k: not skips[k])
                    skips[order[-1]] = False
                for j in order:
                    (micro, weight, padding), skip = weights[j], skips[j]
                    ids, att, lm = (batch[k][micro].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
                    T = int(att.sum(1).max())
                    ids, att, lm = ids[:, :T], att[:, :T], lm[:, :T]                        # [b, T]
                    om = self.predict_output.mask(batch, micro, T, device)                   # [b, T] or None
                    # gradients accumulate locally until the last backward, whose DDP hooks reduce them (FSDP:
                    # every backward reduce-scatters into the sharded gradients, which never exist whole)
                    reduce = j == order[-1] or self.fsdp
                    sync = contextlib.nullcontext() if reduce else self.accelerator.no_sync(self.scorer)
                    with sync, torch.no_grad() if skip else contextlib.nullcontext():
                        logp, entropy, *more = self.scorer(ids, att, sampling, self.banned(self._vocab()),
                                                           loss_mask=lm, output_mask=om,
                                                           output_grad=self.predict_output.weight > 0)
                        loss, stats = grpo_loss(logp, old[micro][:, :T].to(device), adv[micro][:, :T].to(device),
                                                lm, clip=(cfg.loss.clip_low, cfg.loss.clip_high), agg=cfg.loss.agg,
                                                ref_logp=None if ref is None else ref[micro][:, :T].to(device),
                                                kl_coef=cfg.loss.kl_coef, max_len=cfg.rollout.max_total_tokens)
                        total = loss * (weight * share * self._grad_scale)
                        if more:  # (cross-entropy, hits) on the output tokens: loss.predict_output's term
                            total = total + self.predict_output.term(*more[0], om, padding)
                        if not skip:
                            self.accelerator.backward(total)
                    if padding:  # a stand-in for another rank's micro-batch: no statistics of its own
                        continue
                    micros, skipped = micros + 1, skipped + skip
                    stats["entropy"] = float(masked_mean(entropy, lm))
                    stats["loss"] = float(loss.detach())
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + float(v) * weight
                params = [p for p in self.model.parameters() if p.requires_grad]
                if all(skips):  # every backward of this minibatch was skipped (one process): zero gradients, as
                    for p in params:  # computed ones (AdamW still decays and moves by momentum; it would skip a
                        if p.grad is None:  # None gradient)
                            p.grad = torch.zeros_like(p)
                norm = self.accelerator.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(norm)
                count += 1
                if cfg.optim.skip_empty_steps and float(norm) == 0.0:  # the same norm on every rank (reduced grads)
                    empty += 1
                    continue
                self.optimizer.step()
        self.model.eval()
        self._gather_for_rollouts()
        out = {k: v / count for k, v in totals.items()}
        out["optimizer_steps"] = count - empty
        out["optimizer_steps_skipped"] = empty
        out["backward_skipped_frac"] = skipped / max(micros, 1)
        out.update(self.predict_output.figures())
        return out

    def _micro_weights(self, batch: dict[str, torch.Tensor],
                       mb: torch.Tensor) -> tuple[list[tuple[torch.Tensor, float, bool]], float]:
        """Micro-batches of a minibatch with the weight of each loss so their sum is this rank's minibatch loss, and
        this rank's share of the minibatch over all ranks (tokens, sequences or episodes, as ``loss.agg`` counts):
        summed over ranks, ``share * loss`` is the loss of the whole minibatch. Padded to as many micro-batches as
        the rank with the most, with stand-ins of weight 0 (the batch's first row; True in third place)."""
        agg, lm = self.cfg.loss.agg, batch["loss_mask"]
        micros = list(mb.chunk(math.ceil(len(mb) / self.cfg.optim.micro_batch))) if len(mb) else []
        size = lambda m: float(agg_units(lm[m], agg))  # noqa: E731  (the loss's own rule: loss.agg_units)
        local = size(mb)
        total, most = self.ranks.sum_and_max(local, max(len(micros), 1))
        padding = [(torch.arange(1), 0.0, True)] * (most - len(micros))
        return [(m, size(m) / (local or 1.0), False) for m in micros] + padding, (local / total if total else 0.0)

    def _vocab(self) -> int:
        return self.accelerator.unwrap_model(self.model).get_output_embeddings().weight.shape[0]

    @torch.no_grad()
    def _logprobs_no_grad(self, scorer: Any, batch: dict[str, torch.Tensor], sampling: SamplingParams) -> torch.Tensor:
        """Log-probs [B, T] of the batch's tokens under ``scorer`` (a ``TokenScorer``, wrapped or not). Every rank
        runs as many forwards as the rank with the most micro-batches (FSDP gathers the parameters in each): the
        missing ones score the batch's first row, for nothing."""
        device = self.accelerator.device
        out = torch.zeros_like(batch["old_logprobs"])
        micros = list(rows_by_length(batch["attention_mask"])(torch.arange(batch["input_ids"].shape[0])).split(
            self.cfg.optim.micro_batch))  # like lengths together: fewer pad tokens scored
        most = self.ranks.max([len(micros)])[0]
        for k in range(max(most, len(micros))):
            micro = micros[k] if k < len(micros) else torch.arange(1)
            ids, att = batch["input_ids"][micro].to(device), batch["attention_mask"][micro].to(device)
            lm = batch["loss_mask"][micro].to(device)
            T = int(att.sum(1).max())
            logp, _ = scorer(ids[:, :T], att[:, :T], sampling, self.banned(self._vocab()), lm[:, :T],
                             with_entropy=False)
            if k < len(micros):
                out[micro, :T] = logp.float().cpu()
        return out

    # -- evaluation and checkpoints --------------------------------------------------------------------------
    def evaluate(self, pool: Pool, n: int | None = None, desc: str = "eval", which: str = "eval",
                 episodes: list[Trajectory] | None = None, waves: EvalWaves | None = None,
                 stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """Accuracy and per-line statistics on a held-out task (same sampling code as training): ``which`` is
        "eval" (the eval split of the training task, or of run.eval_task), "transfer" (run.transfer_task) or
        "eval_<label>" (a run.extra_eval table).
        ``waves`` and ``stop``: see ``evaluation.evaluate``."""
        from tqdm.auto import tqdm

        held = next(h for h in self.held_out if h.label == which)
        n = n or held.n
        k = held.cfg.run.eval_samples
        env = self.env(pool, held.task, EpisodeRules.from_config(held.cfg.rollout))
        with tqdm(total=n * k, desc=desc, unit="episode", disable=not self.progress, leave=False) as bar:
            return evaluate(env, held.cfg, n, k, progress=bar, episodes=episodes, waves=waves, stop=stop)

    def evaluate_all(self, pool: Pool, when: str = "") -> None:
        """Every held-out task (eval, then transfer and each run.extra_eval if set): figures logged as eval/<m>,
        transfer/<m> and eval_<label>/<m> at this step, episodes appended to eval_samples.jsonl, and kept in
        ``evals`` (under ``when``, default "after").
        Ctrl-C stops it after the wave in flight, nothing logged: its finished waves are kept for the next start."""
        figures: dict[str, dict[str, float]] = {}
        for label, _, task, _ in self.held_out:
            done = self.metrics.logged(self.step, label)
            if done is not None:  # a resumed run: this evaluation finished before the interruption
                log.info("%s at step %d: evaluated before the run was resumed", label, self.step)
                figures[label] = done
                continue
            episodes: list[Trajectory] = []
            desc = f"{label} ({task.name}){' ' + when + ' training' if when else ''}"
            waves = self.metrics.eval_waves(self.step, label)  # finished waves are kept: a kill loses one at most
            self._evaluating = True
            try:
                figures[label] = self.evaluate(pool, desc=desc, which=label, episodes=episodes, waves=waves,
                                               stop=lambda: self._stop)
            except EvaluationStopped as e:
                again = ("run the same command again" if self.step == 0 else
                         f"run `replrl train --resume {self.run_dir}`")
                log.warning("%s at step %d: stopped after %d of %d waves, which are kept; to finish it, %s", label,
                            self.step, e.done, e.total, again)
                return
            finally:
                self._evaluating = False
            if self.predict_output.on and self._held_out_scoring(label):  # how well the policy predicts the REPL
                with self.accelerator.autocast():                            # on problems it never saw
                    figures[label].update(score_episodes(TokenScorer(self.model), episodes, self.pad_id,
                                                         self.cfg.optim.micro_batch, self.accelerator.device))
            # episodes first: a logged figure row means its episodes are all on disk (what a resume relies on)
            self.metrics.samples(self.step, episodes, file="eval_samples.jsonl", extra={"eval": label})
            self.metrics.write(self.step, {f"{label}/{k}": v for k, v in figures[label].items()})
            passes = "".join(f", {k} {v:.3f}" for k, v in figures[label].items() if k.startswith("pass@"))
            console.info("%s at step %d: accuracy %.3f%s over %d episodes (%.0f s)", label, self.step,
                         figures[label]["accuracy"], passes, figures[label]["episodes"], figures[label]["wall_s"])
            if waves is not None:
                waves.clear()
        for label, got in figures.items():
            self.evals[self._evals_key(label, when or "after")] = got

    def _held_out_scoring(self, label: str) -> bool:
        """Whether the main rank may score held-out episodes with the policy on its own (the output-prediction
        figures). Under FSDP2 with a vLLM engine the weights stay sharded (nothing was gathered for rollouts), so a
        forward on the main rank alone would wait for the other ranks' all-gather forever: skipped, said once."""
        if not self.fsdp or self._gathered:
            return True
        if not self._warned_scoring:
            log.warning("%s: the held-out output-prediction figures are not computed under FSDP2 with a vLLM engine "
                        "(the sharded policy cannot score on one rank alone); the training figures are", label)
            self._warned_scoring = True
        return False

    @staticmethod
    def _evals_key(label: str, when: str) -> str:
        """Where ``evals`` keeps a held-out task's figures: "before"/"after" for eval, "<label>_<when>" else."""
        return when if label == "eval" else f"{label}_{when}"

    def save_model(self, out: str | Path | None = None) -> Path | None:
        """The policy as it is now, in Hugging Face format, to ``out`` (default RUN/model; written by the main
        process): a LoRA model merged into its base weights, its adapter kept in ``adapter/`` beside them. Under
        FSDP2 every rank must call it: the main process writes the full state dict gathered from the shards."""
        full = None
        if self.fsdp:
            with self._sharded():
                full = checkpoint.full_state_dict(self.scorer, prefix="lm.", merge=self.model)
        if not self.main:
            return None
        return checkpoint.save_model(out or self.run_dir / checkpoint.MODEL_DIR,
                                     self.accelerator.unwrap_model(self.model), self.tokenizer, self.step,
                                     base_model=self.cfg.model.name, state_dict=full)

    def save(self) -> Path | None:
        """A checkpoint of this step (written by the main process; every rank holds the same state. FSDP2: every
        rank writes its shards, the main process the rest)."""
        model = self.model
        self._saved_step = self.step
        if self.fsdp:
            with self._sharded():
                return checkpoint.save_sharded(self.run_dir, self.step, self.scorer, model, self.tokenizer,
                                               self.optimizer.optimizer, self.scheduler,
                                               {"data_position": self.drawer.problems.position},
                                               keep=self.cfg.run.keep_checkpoints)
        path, error = None, None
        if self.main:
            try:
                path = checkpoint.save(self.run_dir, self.step, model, self.tokenizer, self.optimizer,
                                       self.scheduler, {"data_position": self.drawer.problems.position},
                                       keep=self.cfg.run.keep_checkpoints)
            except OSError as e:  # e.g. a full disk: the last good checkpoint is intact; every rank stops
                error = e
        if self.ranks.any(error is not None):  # also the barrier: no rank runs ahead of the save
            raise error or OSError("the main process could not write the checkpoint")
        return path
