"""A line's output tokenized in its kernel host, not in the trainer's process (issue 65).

With kernel hosts (``rollout.kernel_hosts``), each host builds a ``Splicer`` once (``HostedPool(post=...)``: the
trainer's tokenizer, saved to a directory the host loads it from) and sends, with every result, the tokens of what
the REPL shows after the line and the next ``>>>`` prompt: ``env_splice`` of the rendered output, run there. The
episode takes them (``take``) where they are what its own ``env_splice`` would give: the statement ran (the next
prompt is ``>>>``), the host rendered the same output (a digest of it), and they fit ``max_output_tokens`` (a cut
output, rare, is re-tokenized here). Else it tokenizes as before: the transcript is the same either way
(tests/test_host_splice.py).

On the CPU proxy at batch 128 tokenizing outputs was a fifth of the trainer's CPU a line (random text: few of its
words are in the BPE cache). A host is the project's own code, but it reads kernel bytes: its ids are checked for
type and range before they are used (a wrong id could otherwise stop the engine).
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
import weakref
from typing import Any

from ..repl import PS1, ReplStep, render_output
from .transcript import EnvSplice, env_splice, heal

_SAVED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_VOCAB: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_UNCUT = 1 << 30
"""The host's ``max_output_tokens``: it never cuts (a cut depends on the episode's own limit)."""


def post_spec(tokenizer: Any) -> tuple[str, dict] | None:
    """The kernel hosts' post-processor for ``tokenizer`` (saved once to a temporary directory, removed at exit);
    None for one that cannot be saved (then the trainer tokenizes, as without hosts)."""
    try:
        path = _SAVED.get(tokenizer)
        if path is None:
            path = tempfile.mkdtemp(prefix="replrl-tokenizer-")
            atexit.register(shutil.rmtree, path, True)
            tokenizer.save_pretrained(path)
            _SAVED[tokenizer] = path
    except Exception:
        return None
    return f"{__name__}:Splicer", {"tokenizer_dir": path}


def digest(output: str) -> str:
    return hashlib.blake2b(output.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class Splicer:
    """In the kernel host: the tokens of an executed statement's output and the next ``>>>`` prompt."""

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def __call__(self, result: Any) -> dict | None:
        if result.incomplete:  # nothing ran: the next prompt is `...`, the trainer's (cheap) case
            return None
        output = render_output(result)
        splice = env_splice(self.tokenizer, output, PS1, _UNCUT)
        return {"ids": splice.ids, "printed_tokens": splice.printed_tokens, "digest": digest(output)}


def take(step: ReplStep, max_output_tokens: int, tokenizer: Any) -> EnvSplice | None:
    """The host's splice of ``step``, checked, where it is what ``env_splice(tokenizer, step.output,
    step.next_prompt, max_output_tokens)`` gives; None where the trainer must tokenize (no host data, another
    prompt, a cut, data of the wrong shape or for another output)."""
    post = step.result.post if step.result is not None else None
    if not isinstance(post, dict) or step.next_prompt != PS1:
        return None
    ids, printed = post.get("ids"), post.get("printed_tokens")
    if not isinstance(ids, list) or not 0 < len(ids) <= max_output_tokens or type(printed) is not int \
            or not 0 <= printed <= len(ids) or post.get("digest") != digest(step.output):
        return None
    vocab = _vocab(tokenizer)
    if not all(type(t) is int and 0 <= t < vocab for t in ids):
        return None
    return EnvSplice(ids, step.output + heal(PS1), len(step.output), printed)


def _vocab(tokenizer: Any) -> int:
    """``len(tokenizer)`` (every id it gives), once per tokenizer: transformers builds the vocabulary to count it."""
    try:
        return _VOCAB[tokenizer]
    except KeyError:
        n = _VOCAB[tokenizer] = len(tokenizer)
        return n
    except TypeError:  # not weakly referenceable
        return len(tokenizer)
