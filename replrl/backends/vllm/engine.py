"""``VLLMGenerator``: vLLM's async engine started from a transformers model, on the sandbox's loop thread
(``engine_loop.py``: the episodes and kernels run there too); its
sessions (``session.py``, which reads the generator through its ``SessionHost`` protocol), its weight sync
(``weights.py``: an ``EngineWeights``, held as ``weights``) and its line rule (``line_rule.py``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import shutil
import tempfile
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from replrl.backends import BackendError
from replrl.backends.step_log import StepLog
from replrl.backends.vllm.engine_loop import EngineLoop
from replrl.backends.vllm.line_rule import MASKS_FILE, LineRuleLogitsProcessor
from replrl.backends.vllm.line_stop import STOPS_FILE, engine_ready
from replrl.backends.vllm.session import EngineStopped, VLLMSession
from replrl.backends.vllm.weights import EngineWeights, WeightSyncExtension
from replrl.contract import eos_ids, line_end_ids, token_masks
from replrl.types import SamplingParams

_T = TypeVar("_T")

LINE_OUTPUT_INTERVAL = 1 << 20
"""vLLM's ``stream_interval`` for one output per line: outputs come at a request's first token, every this many
tokens, and at each line's end; no line is this long."""
VLLM_DEFAULT_MAX_NUM_SEQS = 128
"""The requests vLLM's engine runs at once when it is started as replrl starts it (``SchedulerConfig``'s default)."""
VLLM_SLEEP_LEVEL = 2
"""Sleep level used during the update: 2 frees the KV cache and drops the weights (they are copied in after the
update anyway); 1 would keep a copy of them in host memory."""

def _check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention takes only some head sizes, and finds out at the first forward pass, when the engine
    dies: say so at once, in one line."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # another vLLM layout: let vLLM decide
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in sizes:
        raise BackendError(f"vLLM's CPU attention does not take the model's head size {head_dim} (it takes "
                           f"{', '.join(map(str, sizes))}): use --model.backend hf for this model")



def step_logger_class(log: StepLog) -> type:
    """A vLLM stat logger class (vLLM makes one per engine, in this process) that appends every step to ``log``."""
    from vllm.v1.metrics.loggers import StatLoggerBase  # imported only when asked: the backend does without it

    class _StepLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            log.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _StepLogger



class VLLMGenerator:
    """Generator over vLLM's async engine, started from a transformers model (see the module docstring).

    ``model`` is the policy module (its config and dtype define the engine's model; its weights are copied in by
    ``sync_weights``). ``kv_cache_gib`` is the KV cache's size (on the CPU, default 2 GiB); on a GPU, unless
    ``kv_cache_gib`` is given, the engine takes ``gpu_memory_utilization`` of its memory (weights and KV cache; the
    trainer holds its own copy beside it) and sizes its KV cache by profiling.
    ``max_model_len`` bounds prompt plus line (default: the model's). ``logit_bias`` (id -> value) is added to the
    logits before everything else, as an output-layer bias would be (tests use it to make tiny random models end
    lines). ``sync_transport`` is how ``sync_weights`` moves the weights (``auto``: ``cuda_ipc`` when the trainer's
    weights and the engine are on a GPU, else ``shm``; ``cuda_ipc``: a buffer on the trainer's GPU the worker opens
    by CUDA IPC; ``shm``: a shared-memory file; ``rpc``: through vLLM's RPC), ``sync_timeout_s`` the bound on one
    sync. ``max_rows`` is the most rows sessions hold at once (the trainer passes its kernel pool's size): when it
    is more than vLLM's default of 128 requests (``max_num_seqs``), the engine gets room for that many. A row keeps
    its request, and its place, while its line runs, so without it rows beyond 128 would wait for whole episodes
    to end. ``engine_args`` go to vLLM's ``AsyncEngineArgs`` as they are (and win). ``step_stats``: keep vLLM's
    statistics of every engine step in ``step_log`` (a ``StepLog``; for benches: vLLM computes them only then).
    ``per_token_outputs``: the front end hands each row every sampled token as it comes (vLLM's default), which
    times a line's first token apart from the rest (``VLLMSession.timing``); by default it hands a row one output
    per line, at the line's end (vLLM's ``stream_interval`` set past any line: a streaming-input request may not
    ask for ``FINAL_ONLY``), which spares the trainer's process an output object, a queue hand-over and a wake-up
    per token.

    Its weight side is composed, not inherited: ``weights`` (an ``EngineWeights``) holds the sync's settings, its
    buffer and what the last sync did (``weights.last_sync_s``; ``last_sync_transport`` is read through here).
    """

    version: int = 0
    """The policy version the engine samples with (``sync_weights``'s; 0: the weights it was started with)."""
    own_weights = True
    """The engine holds its own copy of the weights, which ``sync_weights`` fills."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device | None = None,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        logit_bias: dict[int, float] | None = None,
        seed: int = 0,
        sync_transport: str = "auto",
        sync_timeout_s: float = 300.0,
        sync_bucket_bytes: int = 2**30,
        max_rows: int | None = None,
        engine_args: dict[str, Any] | None = None,
        step_stats: bool = False,
        per_token_outputs: bool = False,
    ):
        self.loop = EngineLoop()
        """The event loop thread the engine, its rows' streams and the episodes run on (``engine_loop.py``)."""
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        self.weights = EngineWeights(self.loop, cuda=cuda, transport=sync_transport, timeout_s=sync_timeout_s,
                                     bucket_bytes=sync_bucket_bytes)  # (checks the settings before the engine starts)
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.logit_bias = dict(logit_bias) if logit_bias else None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        generation_config = getattr(base, "generation_config", None)
        self.eos = eos_ids(tokenizer, generation_config)
        self.line_end = line_end_ids(tokenizer)
        self.stop_ids = sorted(self.line_end | self.eos)
        vocab = base.get_output_embeddings().weight.shape[0]
        if not cuda:
            _check_cpu_head_size(config)

        self._dir = Path(tempfile.mkdtemp(prefix="replrl-vllm-"))
        config.save_pretrained(self._dir)
        if generation_config is not None:
            generation_config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)
        (self._dir / STOPS_FILE).write_text(json.dumps(self.stop_ids))
        masks = token_masks(tokenizer, vocab)
        torch.save({"anywhere": masks.anywhere, "line_start": masks.line_start}, self._dir / MASKS_FILE)

        dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        args: dict[str, Any] = dict(
            model=str(self._dir), tokenizer=str(self._dir), load_format="dummy", dtype=dtype, seed=seed,
            enable_prefix_caching=True, logprobs_mode="processed_logprobs", max_logprobs=0,
            logits_processors=[LineRuleLogitsProcessor],
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
            max_model_len=max_model_len, disable_log_stats=True,
        )
        if cuda:
            args["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_gib is not None:  # a fixed KV cache: no memory profiling (which assumes no other process
                args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)  # on the GPU changes its use meanwhile)
            # vLLM 0.26 schedules asynchronously on CUDA by default, and its streaming-input requests then can keep
            # tokens still in flight when a line stops (vLLM #35755, #52693): one step at a time, as on the CPU
            args["async_scheduling"] = False
        else:
            args["kv_cache_memory_bytes"] = int((kv_cache_gib or 2.0) * 2**30)
            # the smallest block the CPU attention takes: prompts shared between rows (a GRPO group's) are found
            # in the prefix cache in whole blocks
            args["block_size"] = 32
            # vLLM 0.32 on the CPU fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does
            # not use offset"): whole prefills only (prompts and line chunks), in steps that fit the longest
            # request. Line chunks are short and ride along with the other rows' decoding in one step: vLLM's
            # scheduler takes running requests first, then waiting ones while the step's token budget lasts.
            longest = max_model_len or getattr(config, "max_position_embeddings", None) or 8192
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(int(longest), 4096)
        if max_rows is not None and max_rows > VLLM_DEFAULT_MAX_NUM_SEQS:
            args["max_num_seqs"] = int(max_rows)
        self.step_log = StepLog() if step_stats else None
        if step_stats and "enable_logging_iteration_details" in AsyncEngineArgs.__dataclass_fields__:
            args["enable_logging_iteration_details"] = True  # (vLLM 0.32; older versions report no step details)
        if not per_token_outputs and "stream_interval" in AsyncEngineArgs.__dataclass_fields__:
            args["stream_interval"] = LINE_OUTPUT_INTERVAL  # (a vLLM without the setting: per-token outputs)
        args.update(engine_args or {})
        self.per_token_outputs = int(args.get("stream_interval", 1)) <= 1
        self.tasks: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        """The tasks of this engine's sessions' row streams (cancelled when it shuts down)."""
        self._finalizer = weakref.finalize(self, _shutdown, None, self.loop, self._dir, self.tasks)
        loggers = [step_logger_class(self.step_log)] if self.step_log is not None else None
        self.engine: AsyncLLM = self.loop.call(_start(AsyncEngineArgs(**args), loggers))
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self.loop, self._dir, self.tasks)
        self.max_model_len = self.engine.model_config.max_model_len
        self.line_stops: str | None = str(self._dir / STOPS_FILE) if self.loop.call(engine_ready(self.engine)) \
            else None
        """The stop-id file a line's request names (``line_stop.py``: a set in the engine's scheduler); None where
        the engine's core has no wrapper: requests carry ``stop_ids``."""
        self.sync_weights(model)

    @property
    def last_sync_transport(self) -> str:
        """How the last ``sync_weights`` moved the weights (``cuda_ipc``, ``shm`` or ``rpc``; ``auto`` resolved)."""
        return self.weights.last_sync_transport

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        """Copy ``model``'s weights into the engine (``EngineWeights.sync``: in memory, see ``sync_transport``;
        loaded by vLLM's in-place reload) and drop the prefix cache computed with the old ones; the engine samples
        with ``version`` from now on (None: the next one). Call it between rollouts (no request in flight). Raises
        ``WeightSyncTimeout`` (one line) when it takes longer than ``sync_timeout_s``."""
        self._check_open()
        self.weights.sync(self.engine, model)
        self.version = self.version + 1 if version is None else int(version)

    def sleep(self) -> None:
        """Put the engine to sleep (``VLLM_SLEEP_LEVEL``) so the update can use its GPU memory (needs the engine
        started with ``enable_sleep_mode``: ``model.vllm_sleep``); ``wake``, then ``sync_weights``, bring it back."""
        self.loop.call(self.engine.sleep(level=VLLM_SLEEP_LEVEL))

    def wake(self) -> None:
        """Undo ``sleep``: the weights and the KV cache allocated again."""
        self.loop.call(self.engine.wake_up())

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> VLLMSession:
        """Open a session: one row per prompt."""
        self._check_open()
        return VLLMSession(self, prompts, sampling)

    def _check_open(self) -> None:
        if self.engine is None:
            raise EngineStopped("this vLLM generator was closed (close(), Trainer.close()); load a new one")

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run a coroutine on the engine's event loop and wait for it (for direct use of ``self.engine``)."""
        return self.loop.call(coro)

    def close(self) -> None:
        """Shut the engine down (its processes exit) and remove its config directory and shared weights."""
        self.weights.release(self.engine)  # the worker lets go of the weight buffer first
        self._finalizer()
        self.weights.close()
        # the last reference to the engine: collected now, not at interpreter exit, where its __del__ (shutdown
        # again) would find vLLM's module globals already gone and print an ignored exception
        self.engine = None  # type: ignore[assignment]


async def _start(args: AsyncEngineArgs, stat_loggers: list[type] | None = None) -> AsyncLLM:
    if stat_loggers and "stat_loggers" not in inspect.signature(AsyncLLM.from_engine_args).parameters:
        logging.getLogger(__name__).warning("this vLLM takes no stat loggers: no per-step statistics (step_log)")
        stat_loggers = None
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers) if stat_loggers else \
        AsyncLLM.from_engine_args(args)


def _shutdown(engine: AsyncLLM | None, loop: EngineLoop, directory: Path, tasks: weakref.WeakSet) -> None:
    if engine is not None:
        # the engine's output handler first (it would log the engine process's exit as an error), and its rows'
        # streams: only this engine's tasks, the loop is shared (engine_loop.py)
        loop.cancel([getattr(engine, "output_handler", None), *list(tasks)])
        try:
            engine.shutdown()
        except Exception:  # already gone: nothing left to release
            pass
    shutil.rmtree(directory, ignore_errors=True)
