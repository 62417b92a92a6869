"""Generation with vLLM: each row is one resumable request to vLLM's async engine, fed one line at a time.

A row's first ``next_line`` starts a streaming-input request with its prompt (automatic prefix caching finds the
prompt blocks other rows have computed, e.g. a GRPO group's); the line ends at a stop token, and the request waits
for its next input chunk with its KV cache kept. Each later ``next_line`` sends only the new tokens: the token that
ended the last line (vLLM drops a stopped turn's last sampled token from the request) and the interpreter's. So a
line costs what its new tokens cost; no transcript is re-sent or re-hashed, no partial KV block recomputed. Rows
are independent requests: no row waits for another, and the engine batches whatever is waiting. A row's random
stream is its request's (seeded from the session's seed and the row's index), independent of the other rows.

The distribution sampled from is ``replrl.contract.sampling_logprobs``'s, inside vLLM:

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
test or the sandbox's loop thread). vLLM starts its engine as a spawned process (this package sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless it is set: a forked engine fails on a GPU once the parent has touched
CUDA), so a script that creates a VLLMGenerator needs the ``if __name__ == "__main__":`` guard.

The package's rooms: ``engine.py`` (``VLLMGenerator``: the engine's start, event loop thread and shutdown),
``session.py`` (``VLLMSession``: one streaming request a row, fed a line at a time; it reads its generator through
``SessionHost`` and does not import ``engine.py``), ``weights.py`` (the weight sync: ``EngineWeights``, which the
generator holds as ``weights``, each sync an ``EngineSync`` through ``weight_buckets.Transport``; the flat buffers
and the worker extension), ``line_rule.py`` (the line rule as a vLLM logits processor). This file checks the
install and imports vLLM before any of them.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every request at INFO
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM forks its engine process unless CUDA is initialised in this one, and a fork after CUDA's driver was touched
# (torch.cuda.is_available() does) fails in the child with "CUDA error: initialization error": always spawn
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from replrl.backends.vllm_check import check_vllm, untested  # noqa: E402

_INSTALL = check_vllm()  # one line naming what to do when this vLLM cannot start here, before importing it
if (_UNTESTED := untested(_INSTALL)) is not None:
    logging.getLogger(__name__).warning("%s: it may work; the tested range is pinned in pyproject's vllm extra",
                                        _UNTESTED)

try:  # every vLLM name the rooms import, here first: a vLLM that does not import fails with one line
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.engine.protocol import StreamingInput  # noqa: F401
    from vllm.sampling_params import RequestOutputKind  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    from vllm.v1.engine.exceptions import EngineDeadError  # noqa: F401
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: F401
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: F401
except Exception as e:  # not installed, or installed against another torch (e.g. torchvision operators missing)
    raise ImportError(f"vllm does not import: {type(e).__name__}: {e}") from e

from replrl.backends.step_log import StepLog  # noqa: E402
from replrl.backends.vllm.engine import (  # noqa: E402
    VLLM_DEFAULT_MAX_NUM_SEQS,
    VLLM_SLEEP_LEVEL,
    VLLMGenerator,
    _check_cpu_head_size,
    step_logger_class,
)
from replrl.backends.vllm.engine_loop import EngineLoop  # noqa: E402
from replrl.backends.vllm.line_rule import LINE_RULE_KEY, MASKS_FILE, LineRuleLogitsProcessor  # noqa: E402
from replrl.backends.vllm.session import (  # noqa: E402
    TIMING_KEYS,
    EngineStopped,
    SessionHost,
    VLLMSession,
    _Row,
    _Stream,
)
from replrl.backends.vllm.weights import (  # noqa: E402
    SYNC_TRANSPORTS,
    CudaWeights,
    EngineSync,
    EngineWeights,
    FlatWeights,
    SharedWeights,
    WeightSyncExtension,
    WeightSyncTimeout,
    WeightTable,
    _unflatten,
    hf_weights,
    merged,
    pack_weights,
    remove_stale_weight_files,
    weight_table,
)

__all__ = [
    "LINE_RULE_KEY", "MASKS_FILE", "SYNC_TRANSPORTS", "TIMING_KEYS", "VLLM_DEFAULT_MAX_NUM_SEQS", "VLLM_SLEEP_LEVEL",
    "CudaWeights", "EngineStopped", "EngineSync", "EngineWeights", "FlatWeights", "LineRuleLogitsProcessor",
    "SessionHost", "SharedWeights", "StepLog", "VLLMGenerator", "VLLMSession", "WeightSyncExtension",
    "WeightSyncTimeout", "WeightTable", "EngineLoop", "_Row",
    "_Stream", "_check_cpu_head_size", "_unflatten", "hf_weights", "merged", "pack_weights",
    "remove_stale_weight_files", "step_logger_class", "weight_table", "vllm",
]
