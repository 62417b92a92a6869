"""The weight sync into vLLM's engine: ``EngineSync`` (one sync, the ``weight_buckets.Transport`` of its buckets),
``EngineWeights`` (the weight side of ``VLLMGenerator``, held by it as ``weights``), the flat buffers, the worker
extension.

The engine starts from the model's config with placeholder weights (``load_format="dummy"``) and
``sync_weights(model)`` copies the module's weights in, in buckets (``weight_buckets``), then resets the prefix
cache. The transports (``SYNC_TRANSPORTS``): a shared-memory file the worker maps (``SharedWeights``), a buffer on
the trainer's GPU opened by CUDA IPC (``CudaWeights``), or bytes through vLLM's RPC (``pack_weights``); the worker
side is ``WeightSyncExtension`` (vLLM's ``worker_extension_cls``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import tempfile
import time
import weakref
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from replrl.backends.weight_buckets import plan, stream

_T = TypeVar("_T")

SYNC_TRANSPORTS = ("auto", "cuda_ipc", "shm", "rpc")
"""How ``sync_weights`` moves weights into the engine: ``auto`` (``cuda_ipc`` for weights on the engine's GPU, else
``shm``), a buffer on the GPU opened by CUDA IPC, a shared-memory file, or bytes through vLLM's RPC."""

class WeightSyncTimeout(TimeoutError):
    """``sync_weights`` did not finish within its bound (the message is one line)."""



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


class EngineSync:
    """One weight sync into a vLLM engine, as a ``weight_buckets.Transport``: ``run`` streams the model's weights in
    buckets, and ``send`` writes each into the flat buffer for ``transport`` and has the worker load it. It holds
    what the sync needs and nothing of the generator: the engine, the loop it runs on (``submit``), the buffer it may
    reuse or replace (``buffer``, read back after the sync), the deadline and the bucket size."""

    def __init__(self, engine: Any, loop: Any, transport: str, buffer: FlatWeights | None, deadline: float,
                 timeout_s: float, bucket_bytes: int):
        self.engine, self.loop, self.transport, self.buffer = engine, loop, transport, buffer
        self.deadline, self.timeout_s, self.bucket_bytes = deadline, timeout_s, bucket_bytes
        self.partial = False

    def run(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Stream the weights to the worker in buckets (``weight_buckets``): each gathered, written for the
        transport into a buffer the size of the largest bucket, and loaded, before the next."""
        buckets = plan(named, self.bucket_bytes)
        self.partial = len(buckets) > 1
        if self.transport in ("shm", "cuda_ipc"):
            kind = CudaWeights if self.transport == "cuda_ipc" else SharedWeights
            largest = max(buckets, key=lambda b: weight_table([named[i] for i in b])[1])
            sized = [named[i] for i in largest]  # shapes and dtypes only (a DTensor's are the whole tensor's)
            if not isinstance(self.buffer, kind) or self.buffer.nbytes < weight_table(sized)[1]:
                if self.buffer is not None:
                    self.buffer.close()
                self.buffer = None
                self.buffer = kind(sized)
        stream(named, self, self.bucket_bytes)

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Write one bucket of whole tensors for the transport and have the worker load it."""
        if self.transport in ("shm", "cuda_ipc"):
            shared = self.buffer
            assert shared is not None
            table, _ = weight_table(bucket)
            for (_, dtype, shape, offset), (_, t) in zip(table, bucket, strict=True):
                _unflatten(shared.flat, dtype, shape, offset).copy_(t)
            if isinstance(shared, CudaWeights):
                torch.cuda.synchronize(shared.flat.device)  # the worker reads on its own stream, in another process
                method, args = "replrl_load_cuda", (shared.handle, shared.gpu_uuid, table, self.partial)
            else:
                assert isinstance(shared, SharedWeights)
                method, args = "replrl_load_shared", (shared.path, shared.nbytes, table, self.partial)
        else:
            method, args = "replrl_load_weights", (*pack_weights(bucket), self.partial)
        # the bound is ours, not vLLM's: a collective_rpc timeout inside the engine kills the engine core
        self.bounded(self.engine.collective_rpc(method, args=args))

    def bounded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the engine's loop; ``WeightSyncTimeout`` if it is not done by the deadline."""
        future = self.loop.submit(coro)
        try:
            return future.result(max(self.deadline - time.perf_counter(), 0.0))
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise WeightSyncTimeout(
                f"weight sync into vLLM did not finish within {self.timeout_s:g} s (model.sync_timeout_s): "
                "the engine is stuck or the machine is overloaded; the run stops here (resume from its checkpoint)"
            ) from None


class EngineWeights:
    """The weight side of ``VLLMGenerator`` (composed: the generator holds one as ``weights`` and delegates its
    ``sync_weights`` to ``sync``): the sync settings, the flat buffer kept from one sync to the next, whether CUDA
    IPC failed here, and what the last sync did. Each sync is an ``EngineSync``, the ``weight_buckets.Transport``
    its buckets go through, run on the engine's loop (``loop``); the engine is passed to each call, so nothing here
    keeps it alive after the generator lets it go."""

    def __init__(self, loop: Any, *, cuda: bool, transport: str = "auto", timeout_s: float = 300.0,
                 bucket_bytes: int = 2**30):
        if transport not in SYNC_TRANSPORTS:
            raise ValueError(f"sync_transport must be one of {', '.join(SYNC_TRANSPORTS)}, not {transport!r}")
        if not timeout_s > 0:
            raise ValueError("sync_timeout_s must be > 0")
        self.loop, self.cuda = loop, cuda
        self.transport = transport
        """How a sync moves the weights (``SYNC_TRANSPORTS``; ``auto`` is resolved per sync, ``transport_for``)."""
        self.timeout_s = float(timeout_s)
        """The bound on one sync (``WeightSyncTimeout`` past it)."""
        self.bucket_bytes = int(bucket_bytes)
        """The bucket size (``weight_buckets.plan``: whole decoder layers, a larger layer alone)."""
        self.buffer: FlatWeights | None = None
        """The flat buffer the last sync wrote (reused by the next while it fits)."""
        self.ipc_failed = False
        """``auto``'s CUDA IPC failed here once: shared memory from then on."""
        self.last_sync_s = float("nan")
        """Seconds the last ``sync`` took."""
        self.last_sync_transport = ""
        """The transport the last ``sync`` used (``auto`` resolved; "": none yet)."""

    def sync(self, engine: Any, model: Any) -> None:
        """Copy ``model``'s weights into ``engine`` (in memory, see ``transport``; loaded by vLLM's in-place reload)
        and drop the prefix cache computed with the old ones. Call it between rollouts (no request in flight).
        Raises ``WeightSyncTimeout`` (one line) when it takes longer than ``timeout_s``."""
        t0 = time.perf_counter()
        with merged(model), torch.no_grad():
            named = list(hf_weights(model))  # under FSDP2 DTensor shards: each bucket gathers its own (every rank)
            sync = self._sync(engine, self.transport_for(named), t0)
            try:
                sync.run(named)
            except WeightSyncTimeout:
                raise
            except Exception as e:
                if self.transport != "auto" or sync.transport != "cuda_ipc":
                    raise
                # auto's first choice failed (the engine on another GPU, IPC not allowed here): shared memory from
                # now on, which works wherever the engine runs
                logging.getLogger(__name__).warning("weight sync by CUDA IPC failed (%s); using shared memory",
                                                    str(e).strip().splitlines()[-1] if str(e).strip() else e)
                self.ipc_failed = True
                sync = self._sync(engine, "shm", t0, sync.buffer)
                sync.run(named)
            finally:
                self.buffer = sync.buffer
        if not sync.bounded(engine.reset_prefix_cache()):
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        self.last_sync_s = time.perf_counter() - t0
        self.last_sync_transport = sync.transport

    def transport_for(self, named: list[tuple[str, torch.Tensor]]) -> str:
        """``transport`` with ``auto`` resolved: CUDA IPC when the weights and the engine are on a GPU (and it has
        not failed here before), else shared memory."""
        if self.transport != "auto":
            return self.transport
        on_gpu = self.cuda and bool(named) and named[0][1].is_cuda
        return "cuda_ipc" if on_gpu and not self.ipc_failed else "shm"

    def release(self, engine: Any) -> None:
        """The worker lets go of the weight buffer (before the engine stops: a CUDA IPC buffer's producer, the
        trainer, must not exit while the worker holds it); best effort, bounded: the engine may be gone."""
        if self.buffer is None or engine is None:
            return
        try:
            EngineSync(engine, self.loop, "", None, time.perf_counter() + 10, self.timeout_s, 0).bounded(
                engine.collective_rpc("replrl_release"))
        except Exception:
            pass

    def close(self) -> None:
        """Remove the buffer (after the engine has stopped)."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def _sync(self, engine: Any, transport: str, t0: float, buffer: FlatWeights | None = None) -> EngineSync:
        return EngineSync(engine, self.loop, transport, buffer if buffer is not None else self.buffer,
                          t0 + self.timeout_s, self.timeout_s, self.bucket_bytes)
