"""Generation with vLLM: each row is one resumable request to vLLM's async engine, fed one line at a time.

A row's first ``next_line`` starts a streaming-input request with its prompt (automatic prefix caching finds the
prompt blocks other rows have computed, e.g. a GRPO group's); the line ends at a stop token, and the request waits
for its next input chunk with its KV cache kept. Each later ``next_line`` sends only the new tokens: the token that
ended the last line (vLLM drops a stopped turn's last sampled token from the request) and the interpreter's. So a
line costs what its new tokens cost; no transcript is re-sent or re-hashed, no partial KV block recomputed. Rows
are independent requests: no row waits for another, and the engine batches whatever is waiting. A row's random
stream is its request's (seeded from the session's seed and the row's index), independent of the other rows.

The distribution sampled from is ``replrl.backends.sampling.sampling_logprobs``'s, inside vLLM:

- the line rule and prompt healing's line-start mask are a vLLM logits processor (``LineRuleLogitsProcessor``),
  given the same masks the trainer uses (``token_masks``, written next to the engine's config); the first token
  of every request is a line's first token;
- temperature, then top-k / top-p, are vLLM's own; the engine runs with ``logprobs_mode="processed_logprobs"``,
  so the log-prob returned for a sampled token is that of the distribution it was drawn from (masks, temperature
  and truncation applied), which the trainer recomputes;
- the line ends at the first token whose text ends with a newline (``stop_token_ids``), kept whole with its
  log-prob: the ids are the truth, no text is cut or re-encoded.

Weights: the engine starts from the model's config with placeholder weights (``load_format="dummy"``) and
``sync_weights(model)`` copies the module's weights in, then resets the prefix cache, so no KV computed by the old
weights is reused. The trainer calls it after every optimizer step. On the CPU the weights travel through shared
memory (``sync_transport="shm"``): the trainer writes them into one file under /dev/shm at fixed offsets, and vLLM's
worker (a ``collective_rpc`` to a worker extension, with only the file's name and the table of offsets) maps the
same file and hands views of it to vLLM's in-place ``reload_weights``. With the trainer and the engine on one GPU
(``"cuda_ipc"``, what ``"auto"`` picks there) the flat buffer is on the GPU and the worker opens it by CUDA IPC
once: a sync is two device-to-device copies; if that fails, ``"auto"`` falls back to shared memory with a
warning. ``"rpc"`` sends the bytes through the RPC instead (slower: every byte is serialized and copied
through two processes). LoRA adapters are merged for the copy. A sync that does not finish within
``sync_timeout_s`` fails with one line (``WeightSyncTimeout``).

The engine lives on its own event loop thread (sessions may be driven from any loop, e.g. ``asyncio.run`` in a
test or the sandbox's loop thread). vLLM starts its engine as a spawned process (this module sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless it is set: a forked engine fails on a GPU once the parent has touched
CUDA), so a script that creates a VLLMGenerator needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every request at INFO
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM forks its engine process unless CUDA is initialised in this one, and a fork after CUDA's driver was touched
# (torch.cuda.is_available() does) fails in the child with "CUDA error: initialization error": always spawn
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import torch  # noqa: E402

from replrl.backends.vllm_check import check_vllm, untested  # noqa: E402

_INSTALL = check_vllm()  # one line naming what to do when this vLLM cannot start here, before importing it
if (_UNTESTED := untested(_INSTALL)) is not None:
    logging.getLogger(__name__).warning("%s: it may work; the tested range is pinned in pyproject's vllm extra",
                                        _UNTESTED)

try:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except Exception as e:  # not installed, or installed against another torch (e.g. torchvision operators missing)
    raise ImportError(f"vllm does not import: {type(e).__name__}: {e}") from e

from replrl.backends import BackendError  # noqa: E402
from replrl.backends.sampling import TokenMasks, eos_ids, line_end_ids, row_seed, token_masks  # noqa: E402
from replrl.backends.step_log import StepLog  # noqa: E402
from replrl.backends.weight_buckets import plan, stream  # noqa: E402
from replrl.types import LineSample, SamplingParams  # noqa: E402

_T = TypeVar("_T")

LINE_RULE_KEY = "replrl_line_rule"
"""``SamplingParams.extra_args`` key: the request is one line (the line rule and line-start mask apply)."""
SYNC_TRANSPORTS = ("auto", "cuda_ipc", "shm", "rpc")
"""How ``sync_weights`` moves weights into the engine: ``auto`` (``cuda_ipc`` for weights on the engine's GPU, else
``shm``), a buffer on the GPU opened by CUDA IPC, a shared-memory file, or bytes through vLLM's RPC."""
VLLM_DEFAULT_MAX_NUM_SEQS = 128
"""The requests vLLM's engine runs at once when it is started as replrl starts it (``SchedulerConfig``'s default)."""
TIMING_KEYS = ("first_token_s", "lines", "later_tokens_s", "later_tokens", "between_lines_s")
"""``VLLMSession.timing``'s counters."""
MASKS_FILE = "replrl_token_masks.pt"
"""The sampler's masks, written next to the engine's config for the logits processor to load."""


class EngineStopped(BackendError):
    """vLLM's engine process stopped (the line is ours; vLLM's own log, printed above it, names the cause)."""


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


class WeightSyncTimeout(TimeoutError):
    """``sync_weights`` did not finish within its bound (the message is one line)."""


class LineRuleLogitsProcessor(LogitsProcessor):
    """The line rule and prompt healing inside vLLM (runs in the engine's worker process).

    For every request that opted in (``extra_args[LINE_RULE_KEY]``): its first sampled token (no output yet) is a
    line's first, masked with ``TokenMasks.line_start``; every later one with ``TokenMasks.anywhere``. Applied
    before temperature and truncation, like the ``banned`` argument of ``sampling_logprobs`` (a removed token
    stays removed under both).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        masks = torch.load(Path(vllm_config.model_config.model) / MASKS_FILE)
        vocab = vllm_config.model_config.get_vocab_size()
        if masks["anywhere"].shape[0] != vocab:
            raise ValueError(f"replrl masks cover {masks['anywhere'].shape[0]} ids, the model's logits {vocab}")
        self._use(TokenMasks(masks["anywhere"], masks["line_start"]), device)

    @classmethod
    def for_masks(cls, masks: TokenMasks, device: str | torch.device = "cpu") -> LineRuleLogitsProcessor:
        """The processor over ``masks`` without an engine (tests and benches of ``apply``)."""
        proc = cls.__new__(cls)
        proc._use(masks, device)
        return proc

    def _use(self, masks: TokenMasks, device: str | torch.device) -> None:
        self.line_start = masks.line_start.to(device)                                             # [V] bool
        self.anywhere_ids = masks.anywhere.nonzero().squeeze(1).to(device)                        # [K] (K << V)
        self.outputs: dict[int, list[int]] = {}
        """Batch index -> the request's output ids (vLLM's live list): empty while sampling a line's first token."""

    def is_argmax_invariant(self) -> bool:
        return False  # removing tokens can change the most likely one

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.outputs, batch_update,
                             lambda params, _, out: out if (params.extra_args or {}).get(LINE_RULE_KEY) else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # every step, in place: most rows are inside a line and lose only the few tokens banned anywhere (an index
        # write of R x K); a line's first token (one row in about twenty) takes the line-start mask, most of the
        # vocabulary, over its own row. (The first version gathered, masked and scattered whole [R, V] rows every
        # step: that made a step with 32 rows 1.9x slower on the CPU, bench/backends.py.)
        if not self.outputs:
            return logits
        inside: list[int] = []
        for i, out in self.outputs.items():
            if out:
                inside.append(i)
            else:
                logits[i].masked_fill_(self.line_start, float("-inf"))                          # [V]
        if inside:
            rows = torch.tensor(inside, device=logits.device)                                   # [R]
            logits[rows.unsqueeze(1), self.anywhere_ids] = float("-inf")                        # [R, K]
        return logits


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


class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): weight updates by ``collective_rpc``.

    ``table`` lists (name, dtype, shape, offset) of each weight in a flat byte buffer: a shared-memory file the
    worker maps (``replrl_load_shared``), or bytes sent through the RPC (``replrl_load_weights``; vLLM's RPC
    serializer keeps bytes as they are, where tensors in untyped arguments would arrive as lists).
    """

    def replrl_load_weights(self, table: list[tuple[str, str, list[int], int]], buffer: bytes,
                            partial: bool = False) -> int:
        """Copy named weights (Hugging Face names, as in a checkpoint) into the worker's model; returns how many.
        ``partial``: one bucket of a streamed sync (whole layers; the others keep their weights, unlogged)."""
        return self._replrl_reload(table, torch.frombuffer(bytearray(buffer), dtype=torch.uint8), partial)

    def replrl_load_shared(self, path: str, nbytes: int, table: list[tuple[str, str, list[int], int]],
                           partial: bool = False) -> int:
        """The same from the shared-memory file ``path`` (mapped once, kept mapped while the file stays the same)."""
        mapped = getattr(self, "_replrl_shared", None)
        if mapped is None or mapped[0] != (path, nbytes):
            mapped = ((path, nbytes), torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
            self._replrl_shared = mapped
        return self._replrl_reload(table, mapped[1], partial)

    def replrl_load_cuda(self, handle: bytes, gpu_uuid: str, table: list[tuple[str, str, list[int], int]],
                         partial: bool = False) -> int:
        """The same from the trainer's CUDA buffer (``CudaWeights``), opened by CUDA IPC once and kept open: a
        device-to-device copy into the engine's weights. ``gpu_uuid`` is the trainer's GPU: the engine must be on
        the same one."""
        mapped = getattr(self, "_replrl_cuda", None)
        if mapped is None or mapped[0] != handle:
            device = torch.device(self.device)  # type: ignore[attr-defined]
            mine = str(torch.cuda.get_device_properties(device).uuid)
            if mine != gpu_uuid:
                raise RuntimeError(f"sync_transport 'cuda_ipc' needs the engine on the trainer's GPU ({gpu_uuid}); "
                                   f"it is on {mine}: use sync_transport 'shm'")
            rebuild, args = pickle.loads(handle)
            args = list(args)
            args[6] = device.index if device.index is not None else torch.cuda.current_device()  # this process's
            mapped = (handle, rebuild(*args))
            self._replrl_cuda = mapped
        loaded = self._replrl_reload(table, mapped[1], partial)
        torch.cuda.synchronize(mapped[1].device)  # read to the end before the trainer may write the buffer again
        return loaded

    def replrl_release(self) -> int:
        """Drop the mapped weight buffers (before the engine stops: a CUDA IPC buffer's producer, the trainer, must
        not exit while this process still holds it); returns how many were held."""
        held = [name for name in ("_replrl_shared", "_replrl_cuda") if getattr(self, name, None) is not None]
        for name in held:
            setattr(self, name, None)
        return len(held)

    def _replrl_reload(self, table: list[tuple[str, str, list[int], int]], flat: torch.Tensor,
                       partial: bool = False) -> int:
        # vLLM's in-place reload: checkpoint-format weights through each layer's loader, then the layer's
        # post-processing again (e.g. the CPU's repacked linear weights). A layer that gets no weight in this call
        # (another bucket's) keeps its tensors, with a warning per layer that a partial load would repeat each sync
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload")
        level = quiet.level
        if partial:
            quiet.setLevel(logging.ERROR)
        try:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=[(name, _unflatten(flat, dtype, shape, offset))
                                  for name, dtype, shape, offset in table])
        finally:
            quiet.setLevel(level)
        return len(table)


def _unflatten(flat: torch.Tensor, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    return flat[offset:offset + n].view(dt).view(shape)


WeightTable = list[tuple[str, str, list[int], int]]
"""(name, dtype, shape, byte offset) of each weight in a flat buffer."""


def weight_table(named: list[tuple[str, torch.Tensor]]) -> tuple[WeightTable, int]:
    """(table, total bytes) of named tensors laid out one after another, every offset 64-byte aligned."""
    table, offset = [], 0
    for name, t in named:
        table.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // 64) * 64
    return table, offset


def pack_weights(named: list[tuple[str, torch.Tensor]]) -> tuple[WeightTable, bytes]:
    """(table, buffer) of named tensors for ``WeightSyncExtension.replrl_load_weights`` (copied to the CPU)."""
    table, nbytes = weight_table(named)
    flat = torch.zeros(nbytes, dtype=torch.uint8)                                     # [bytes]
    for (_, dtype, shape, offset), (_, t) in zip(table, named, strict=True):
        _unflatten(flat, dtype, shape, offset).copy_(t.detach())
    return table, flat.numpy().tobytes()


class FlatWeights:
    """A model's weights in one flat byte buffer at the offsets of ``weight_table``, written in place every sync;
    the buffer (``flat``) is the subclass's: a shared-memory file or a CUDA allocation."""

    table: WeightTable
    nbytes: int
    flat: torch.Tensor

    def fits(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """The same names, dtypes and shapes as the table (the buffer can be written again)."""
        return weight_table(named)[0] == self.table

    def write(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the tensors into the buffer (from any device)."""
        for (_, dtype, shape, offset), (_, t) in zip(self.table, named, strict=True):
            _unflatten(self.flat, dtype, shape, offset).copy_(t.detach())

    def close(self) -> None:
        pass


class CudaWeights(FlatWeights):
    """The weights in one buffer on the trainer's GPU, shared with vLLM's worker by CUDA IPC (``handle``: what
    ``torch.multiprocessing`` pickles for a CUDA tensor): a sync is a device-to-device copy into the buffer, then
    one from it into the engine's weights, with no trip through host memory. Needs the engine on the same GPU."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        from torch.multiprocessing.reductions import reduce_tensor

        self.table, self.nbytes = weight_table(named)
        device = named[0][1].device
        if device.type != "cuda":
            raise ValueError(f"CudaWeights needs weights on a CUDA device, not {device}")
        self.flat = torch.empty(max(self.nbytes, 1), dtype=torch.uint8, device=device)  # [bytes]
        self.handle = pickle.dumps(reduce_tensor(self.flat))
        self.gpu_uuid = str(torch.cuda.get_device_properties(device).uuid)

    def write(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().write(named)
        torch.cuda.synchronize(self.flat.device)  # the worker reads on its own stream, in another process

    def close(self) -> None:
        self.flat = torch.empty(0, dtype=torch.uint8)


class SharedWeights(FlatWeights):
    """A model's weights in one shared-memory file, at the offsets of ``weight_table``: the trainer writes them
    (``write``), vLLM's worker maps the same file and reads them in place. The file is removed by ``close`` (or
    when this object is collected)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], directory: str | None = None):
        self.table, self.nbytes = weight_table(named)
        shm = "/dev/shm"
        directory = directory or (shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir())
        remove_stale_weight_files(directory)
        fd, self.path = tempfile.mkstemp(prefix=f"replrl-weights-{_pid_namespace()}-{os.getpid()}-", dir=directory)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, max(self.nbytes, 1))
        finally:
            os.close(fd)
        self.flat = torch.from_file(self.path, shared=True, size=max(self.nbytes, 1), dtype=torch.uint8)  # [bytes]

    def close(self) -> None:
        self._finalizer()


def remove_stale_weight_files(directory: str) -> list[str]:
    """Remove the weight files of trainers that no longer run (``replrl-weights-<pid namespace>-<pid>-*`` of this
    process's pid namespace whose process is gone).

    A trainer killed by a signal it cannot catch (SIGKILL: the OOM killer) leaves its file behind, and a file under
    /dev/shm is memory: 2.5 GB for the 0.5B, held until the machine restarts, which made the next heavy job the OOM
    killer's next victim. Files of another pid namespace (a container sharing /dev/shm, ``--ipc=host``) are never
    touched: their pids mean nothing here. Returns the paths removed."""
    removed, mine = [], _pid_namespace()
    for path in Path(directory).glob("replrl-weights-*-*-*"):
        parts = path.name.split("-")
        if parts[2] != mine or not parts[3].isdigit() or _alive(int(parts[3])):
            continue
        _unlink(str(path))
        removed.append(str(path))
    return removed


def _pid_namespace() -> str:
    """This process's pid namespace (its inode), or "0" where /proc does not say."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def hf_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a transformers model's weights, as its ``save_pretrained`` would name them.

    A peft model yields its base model's weights with the adapters merged in: call it inside ``merged(model)``.
    A tensor shared under two names (tied input and output embeddings) is sent under both names, as before.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, tensor in base.state_dict().items():
        if "lora_" in name:  # adapter weights: already merged into the base layers
            continue
        yield name.replace(".base_layer.", "."), tensor


class merged:  # noqa: N801  (a context manager named for what it does)
    """``with merged(model):`` a peft model's adapters are merged into its weights, and unmerged after."""

    def __init__(self, model: Any):
        self.model = model
        self.peft = hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")

    def __enter__(self) -> Any:
        if self.peft:
            self.model.merge_adapter()
        return self.model

    def __exit__(self, *exc: Any) -> None:
        if self.peft:
            self.model.unmerge_adapter()


class _EngineBucket:
    """The ``weight_buckets.Transport`` of a sync: each bucket into the generator's engine."""

    def __init__(self, gen: VLLMGenerator, transport: str, deadline: float, partial: bool):
        self.gen, self.transport, self.deadline, self.partial = gen, transport, deadline, partial

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.gen._load_bucket(bucket, self.transport, self.deadline, self.partial)


class _LoopThread:
    """A private event loop on a daemon thread: the engine's home."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="replrl-vllm", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop (e.g. the engine's output handler), then stop the thread."""
        if self.loop.is_running():
            try:
                self.call(_cancel_others(), timeout=10)
            except Exception:  # a loop that cannot answer is stopped all the same
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Row:
    ids: list[int]
    """The row's transcript so far (prompt, sampled lines, environment tokens)."""
    lines: int = 0
    future: Any = None
    """The in-flight line (a concurrent.futures.Future on the engine's loop)."""
    stream: _Stream | None = None
    """The row's streaming request (created on the engine's loop by the first line)."""
    sent: int = 0
    """How many of ``ids`` the engine holds in the request's KV cache (all but the last sampled token)."""
    finished: bool = False
    restarts: int = 0
    """Rollbacks so far: each ends the row's request; the next line starts a new one (its own id and seed)."""


class _Stream:
    """One row's resumable request on the engine's loop: line requests in (``chunks``), lines out (``lines``).

    vLLM keeps a resumable request's KV blocks between its input chunks and continues it from there: the next
    chunk is appended to the request, so a line's request prefills only its new tokens (the token that ended the
    last line, which vLLM drops from a stopped turn, then the environment's). Lives and dies on the engine loop.
    """

    def __init__(self, gen: VLLMGenerator, request_id: str, params: vllm.SamplingParams,
                 timing: dict[str, float] | None = None):
        self.chunks: asyncio.Queue[tuple[list[int], vllm.SamplingParams] | None] = asyncio.Queue()
        self.lines: asyncio.Queue[tuple[LineSample, int] | BaseException] = asyncio.Queue()
        self.timing = timing if timing is not None else dict.fromkeys(TIMING_KEYS, 0.0)
        self._sent = self._done = 0.0  # when the last chunk was handed over, when the last line came out
        self.task = asyncio.ensure_future(self._run(gen, request_id, params))

    async def _inputs(self) -> Any:
        while (chunk := await self.chunks.get()) is not None:
            ids, params = chunk
            yield StreamingInput(vllm.TokensPrompt(prompt_token_ids=ids), params)

    async def _run(self, gen: VLLMGenerator, request_id: str, params: vllm.SamplingParams) -> None:
        tokens: list[int] = []
        logprobs: list[float] = []
        timing, first_at, first_n = self.timing, 0.0, 0
        try:
            async for out in gen.engine.generate(self._inputs(), params, request_id=request_id):
                now = time.perf_counter()
                completion = out.outputs[0]
                new = list(completion.token_ids)
                if not tokens and new:  # the line's first token(s)
                    first_at, first_n = now, len(new)
                    timing["first_token_s"] += now - self._sent
                    timing["lines"] += 1
                tokens += new
                logprobs += [step[t].logprob for step, t in zip(completion.logprobs or [], new, strict=True)]
                if completion.finish_reason is not None and tokens:
                    timing["later_tokens_s"] += now - first_at
                    timing["later_tokens"] += len(tokens) - first_n
                    self._done = now
                    last = tokens[-1]
                    finish = "eos" if last in gen.eos else ("newline" if last in gen.line_end else "length")
                    self.lines.put_nowait((LineSample(tokens, logprobs, finish), out.num_cached_tokens or 0))
                    tokens, logprobs = [], []
        except BaseException as e:  # the engine failed the request (or it was cancelled): fail the waiting line
            self.lines.put_nowait(e if isinstance(e, Exception) else RuntimeError("request cancelled"))
            raise
        self.lines.put_nowait(RuntimeError("the row's request ended"))

    async def line(self, ids: list[int], params: vllm.SamplingParams) -> tuple[LineSample, int]:
        if self.task.done() and self.lines.empty():  # ended (aborted, failed) and its error already reported
            raise RuntimeError("the row's vLLM request has ended")
        self._sent = time.perf_counter()
        if self._done:
            self.timing["between_lines_s"] += self._sent - self._done
        self.chunks.put_nowait((ids, params))
        item = await self.lines.get()
        if isinstance(item, EngineDeadError):
            raise EngineStopped("vLLM's engine stopped (EngineDeadError): the engine's log above names the cause") \
                from item
        if isinstance(item, BaseException):
            raise RuntimeError(f"vLLM request failed: {item!r}") from item
        return item

    async def close(self) -> None:
        """End the request (vLLM frees its KV blocks) and wait until the engine has."""
        if not self.task.done():
            self.chunks.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(self.task), timeout=30)
            except BaseException:  # not ended in time, or failed: abort it
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)

    async def abort(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class VLLMSession:
    """A GenSession over a VLLMGenerator's engine (see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, gen: VLLMGenerator, prompts: list[list[int]], sampling: SamplingParams):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMSession needs at least one prompt, and every prompt needs at least one token")
        self._gen, self.sampling = gen, sampling
        self._rows = [_Row(list(p)) for p in prompts]
        self._name = f"replrl-{os.getpid()}-{next(self._ids)}"
        self._closed = False
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "sampled_tokens": 0, "rollbacks": 0,
                      "dropped_tokens": 0}
        """Counters: line requests; their transcripts' tokens; of which not computed again (kept in the row's
        request, or found in the prefix cache); tokens sampled; rollbacks, and the context tokens they dropped."""
        self.timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        """Where a line's time goes, summed over rows (seconds; kept on the engine's loop): ``first_token_s``,
        from a line's input handed to the engine to its first sampled token (queueing, prefill, one step), over
        ``lines``; ``later_tokens_s``, from there to the line's last token, over ``later_tokens`` (so
        ``later_tokens_s / later_tokens`` is the engine's time per step as a row sees it); ``between_lines_s``,
        from a line out of the engine to the row's next input (the caller: running the line, and any wait)."""

    def _params(self, i: int, room: int) -> vllm.SamplingParams:
        s = self.sampling
        # one random stream per row: vLLM seeds a request's generator from its first chunk and keeps it (a request
        # after a rollback: a stream of its own)
        seed = None if s.seed is None else row_seed(s.seed, i, self._rows[i].restarts)
        return vllm.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed,
            max_tokens=min(s.max_line_tokens, room), logprobs=0, detokenize=False,
            stop_token_ids=self._gen.stop_ids, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
            logit_bias=self._gen.logit_bias, extra_args={LINE_RULE_KEY: True},
        )

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        if row.future is not None:
            raise RuntimeError(f"row {i} already has a pending next_line request")
        row.ids.extend(env_ids)
        room = self._gen.max_model_len - len(row.ids)
        if room < 1:
            raise ValueError(f"row {i}'s transcript ({len(row.ids)} tokens) fills the engine's max_model_len")
        params = self._params(i, room)
        chunk = row.ids[row.sent:]
        request_id = f"{self._name}-{i}" + (f"-r{row.restarts}" if row.restarts else "")
        restarts = row.restarts
        row.future = future = self._gen._loop.submit(self._line(row, request_id, chunk, params))
        try:
            sample, cached = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if self._closed:
                raise RuntimeError("session closed") from None
            raise
        finally:
            if row.future is future:
                row.future = None
        if row.restarts != restarts:  # rolled back after the engine answered, before this coroutine resumed
            raise asyncio.CancelledError
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(row.ids)
        self.stats["cached_tokens"] += cached if row.sent == 0 else row.sent
        self.stats["sampled_tokens"] += len(sample.token_ids)
        row.ids.extend(sample.token_ids)
        row.sent = len(row.ids) - 1
        row.lines += 1
        return sample

    async def _line(self, row: _Row, request_id: str, chunk: list[int], params: vllm.SamplingParams
                    ) -> tuple[LineSample, int]:
        """On the engine's loop: the row's next line (its request started by the first)."""
        if row.stream is None:
            row.stream = _Stream(self._gen, request_id, params, self.timing)
        stream = row.stream
        try:
            return await stream.line(chunk, params)
        except asyncio.CancelledError:  # the caller gave up on the line (or rolled it back): the request cannot go on
            await stream.abort()
            if row.stream is stream:
                row.stream = None
            raise

    async def rollback(self, i: int, length: int) -> None:
        """Drop row ``i``'s tokens after its first ``length`` (see ``GenSession.rollback``). A streaming request
        can only grow, so the row's request is aborted (its line in flight with it) and its next line starts a new
        request over the kept transcript: the prefix cache holds its whole blocks (the row's own, computed before),
        so the new request prefills about one block. The new request's seed is derived from the session's, the row
        and the restart count (never the first request's again)."""
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        if not 1 <= length <= len(row.ids):
            raise ValueError(f"row {i} holds {len(row.ids)} context tokens: cannot keep {length}")
        future, stream = row.future, row.stream
        row.future, row.stream = None, None
        self.stats["rollbacks"] += 1
        self.stats["dropped_tokens"] += len(row.ids) - length
        row.ids, row.sent = row.ids[:length], 0
        row.restarts += 1
        if future is not None:
            future.cancel()  # its _line aborts the request on the engine's loop
        if stream is not None:  # gone from the engine before the row's next request
            await asyncio.wrap_future(self._gen._loop.submit(stream.abort()))

    def finish(self, i: int) -> None:
        row = self._rows[i]
        row.finished = True
        if row.future is not None:
            row.future.cancel()  # aborts the request in the engine
        elif row.stream is not None:
            self._gen._loop.submit(row.stream.close())

    async def aclose(self) -> None:
        self._closed = True
        for row in self._rows:
            if row.future is not None:
                row.future.cancel()
        streams = [row.stream for row in self._rows if row.stream is not None]
        if streams:
            await asyncio.wrap_future(self._gen._loop.submit(_close_all(streams)))


async def _close_all(streams: list[_Stream]) -> None:
    await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)


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
    """

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
    ):
        if sync_transport not in SYNC_TRANSPORTS:
            raise ValueError(f"sync_transport must be one of {', '.join(SYNC_TRANSPORTS)}, not {sync_transport!r}")
        if not sync_timeout_s > 0:
            raise ValueError("sync_timeout_s must be > 0")
        self.sync_transport, self.sync_timeout_s = sync_transport, float(sync_timeout_s)
        self.sync_bucket_bytes = int(sync_bucket_bytes)
        """The weight sync's bucket size (``weight_buckets.plan``: whole decoder layers, a larger layer alone)."""
        self._shared: FlatWeights | None = None
        self._ipc_failed = False
        self.last_sync_s = float("nan")
        """Seconds the last ``sync_weights`` took."""
        self.last_sync_transport = ""
        """The transport the last ``sync_weights`` used (``auto`` resolved)."""
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
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        if not cuda:
            _check_cpu_head_size(config)

        self._dir = Path(tempfile.mkdtemp(prefix="replrl-vllm-"))
        config.save_pretrained(self._dir)
        if generation_config is not None:
            generation_config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)
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
        self._cuda = cuda
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
        args.update(engine_args or {})
        self._loop = _LoopThread()
        self._finalizer = weakref.finalize(self, _shutdown, None, self._loop, self._dir)
        loggers = [step_logger_class(self.step_log)] if self.step_log is not None else None
        self.engine: AsyncLLM = self._loop.call(_start(AsyncEngineArgs(**args), loggers))
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self._loop, self._dir)
        self.max_model_len = self.engine.model_config.max_model_len
        self.sync_weights(model)

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> VLLMSession:
        """Open a session: one row per prompt."""
        self._check_open()
        return VLLMSession(self, prompts, sampling)

    def _check_open(self) -> None:
        if self.engine is None:
            raise EngineStopped("this vLLM generator was closed (close(), Trainer.close()); load a new one")

    def sync_weights(self, model: Any) -> None:
        """Copy ``model``'s weights into the engine (in memory, see ``sync_transport``; loaded by vLLM's in-place
        reload) and drop the prefix cache computed with the old ones. Call it between rollouts (no request in
        flight). Raises ``WeightSyncTimeout`` (one line) when it takes longer than ``sync_timeout_s``."""
        self._check_open()
        t0 = time.perf_counter()
        deadline = t0 + self.sync_timeout_s
        with merged(model), torch.no_grad():
            named = list(hf_weights(model))  # under FSDP2 DTensor shards: each bucket gathers its own (every rank)
            transport = self._transport(named)
            try:
                self._load(named, transport, deadline)
            except WeightSyncTimeout:
                raise
            except Exception as e:
                if self.sync_transport != "auto" or transport != "cuda_ipc":
                    raise
                # auto's first choice failed (the engine on another GPU, IPC not allowed here): shared memory from
                # now on, which works wherever the engine runs
                logging.getLogger(__name__).warning("weight sync by CUDA IPC failed (%s); using shared memory",
                                                    str(e).strip().splitlines()[-1] if str(e).strip() else e)
                self._ipc_failed = True
                transport = "shm"
                self._load(named, transport, deadline)
        if not self._bounded(self.engine.reset_prefix_cache(), deadline):
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        self.last_sync_s = time.perf_counter() - t0
        self.last_sync_transport = transport

    def _transport(self, named: list[tuple[str, torch.Tensor]]) -> str:
        """``sync_transport`` with ``auto`` resolved: CUDA IPC when the weights and the engine are on a GPU (and
        it has not failed here before), else shared memory."""
        if self.sync_transport != "auto":
            return self.sync_transport
        on_gpu = self._cuda and bool(named) and named[0][1].is_cuda
        return "cuda_ipc" if on_gpu and not self._ipc_failed else "shm"

    def _load(self, named: list[tuple[str, torch.Tensor]], transport: str, deadline: float) -> None:
        """Stream the weights to the worker in buckets (``weight_buckets``): each gathered, written for
        ``transport`` into a buffer the size of the largest bucket, and loaded, before the next."""
        buckets = plan(named, self.sync_bucket_bytes)
        if transport in ("shm", "cuda_ipc"):
            kind = CudaWeights if transport == "cuda_ipc" else SharedWeights
            largest = max(buckets, key=lambda b: weight_table([named[i] for i in b])[1])
            sized = [named[i] for i in largest]  # shapes and dtypes only (a DTensor's are the whole tensor's)
            if not isinstance(self._shared, kind) or self._shared.nbytes < weight_table(sized)[1]:
                if self._shared is not None:
                    self._shared.close()
                self._shared = None
                self._shared = kind(sized)
        stream(named, _EngineBucket(self, transport, deadline, partial=len(buckets) > 1), self.sync_bucket_bytes)

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]], transport: str, deadline: float,
                     partial: bool) -> None:
        """Write one bucket of whole tensors for ``transport`` and have the worker load it."""
        if transport in ("shm", "cuda_ipc"):
            shared = self._shared
            assert shared is not None
            table, _ = weight_table(bucket)
            for (_, dtype, shape, offset), (_, t) in zip(table, bucket, strict=True):
                _unflatten(shared.flat, dtype, shape, offset).copy_(t)
            if isinstance(shared, CudaWeights):
                torch.cuda.synchronize(shared.flat.device)  # the worker reads on its own stream, in another process
                method, args = "replrl_load_cuda", (shared.handle, shared.gpu_uuid, table, partial)
            else:
                assert isinstance(shared, SharedWeights)
                method, args = "replrl_load_shared", (shared.path, shared.nbytes, table, partial)
        else:
            method, args = "replrl_load_weights", (*pack_weights(bucket), partial)
        # the bound is ours, not vLLM's: a collective_rpc timeout inside the engine kills the engine core
        self._bounded(self.engine.collective_rpc(method, args=args), deadline)

    def _bounded(self, coro: Coroutine[Any, Any, _T], deadline: float) -> _T:
        """Run ``coro`` on the engine's loop; ``WeightSyncTimeout`` if it is not done by ``deadline``."""
        future = self._loop.submit(coro)
        try:
            return future.result(max(deadline - time.perf_counter(), 0.0))
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise WeightSyncTimeout(
                f"weight sync into vLLM did not finish within {self.sync_timeout_s:g} s (model.sync_timeout_s): "
                "the engine is stuck or the machine is overloaded; the run stops here (resume from its checkpoint)"
            ) from None

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run a coroutine on the engine's event loop and wait for it (for direct use of ``self.engine``)."""
        return self._loop.call(coro)

    def close(self) -> None:
        """Shut the engine down (its processes exit) and remove its config directory and shared weights."""
        if self._shared is not None and self.engine is not None:
            try:  # the worker lets go of the weight buffer first (best effort: the engine may be gone)
                self._bounded(self.engine.collective_rpc("replrl_release"), time.perf_counter() + 10)
            except Exception:
                pass
        self._finalizer()
        if self._shared is not None:
            self._shared.close()
        # the last reference to the engine: collected now, not at interpreter exit, where its __del__ (shutdown
        # again) would find vLLM's module globals already gone and print an ignored exception
        self.engine = None  # type: ignore[assignment]


async def _start(args: AsyncEngineArgs, stat_loggers: list[type] | None = None) -> AsyncLLM:
    if stat_loggers and "stat_loggers" not in inspect.signature(AsyncLLM.from_engine_args).parameters:
        logging.getLogger(__name__).warning("this vLLM takes no stat loggers: no per-step statistics (step_log)")
        stat_loggers = None
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers) if stat_loggers else \
        AsyncLLM.from_engine_args(args)


def _shutdown(engine: AsyncLLM | None, loop: _LoopThread, directory: Path) -> None:
    if engine is not None:
        try:  # the engine's output handler first: it would log the engine process's exit as an error
            if loop.loop.is_running():
                loop.call(_cancel_others(), timeout=10)
        except Exception:  # a loop that cannot answer is stopped below all the same
            pass
        try:
            engine.shutdown()
        except Exception:  # already gone: nothing left to release
            pass
    loop.stop()
    shutil.rmtree(directory, ignore_errors=True)
