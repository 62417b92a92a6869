"""The splice, text <-> ids: the episode's prompt, prompt healing, a line's text and code, encode/decode as sampled,
and the environment's tokens after a line (DESIGN.md invariants 1 and 2: ids are concatenated, never re-tokenized)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..repl import BANNER, PS1, TRUNCATED_MARKER


def build_prompt(tokenizer: Any, header: str, chat_template: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The episode's prompt text: the task header as a user turn (chat template when the tokenizer has one), then
    the assistant turn opening with the REPL banner and the first prompt, healed: ``>>>`` (see ``heal``).
    ``template_kwargs``: the chat template's options (``model.chat_template_kwargs``: Qwen3's enable_thinking)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": header}], tokenize=False,
                                             add_generation_prompt=True, **(template_kwargs or {}))
        return text + BANNER + heal(PS1)
    return header.rstrip("\n") + "\n\n" + BANNER + heal(PS1)


def heal(prompt: str) -> str:
    """The prompt as the environment emits it: without its trailing space, which the line's first token carries
    (``>>>`` + `` print`` + ``(x)\n``), as a BPE tokenizer splits the text ``>>> print(x)``."""
    return prompt[:-1] if prompt.endswith(" ") else prompt


def line_text(code: str) -> str:
    """The text a model writes for one line of code: the prompt's space, the code, the newline."""
    return " " + code + "\n"


def code_of(text: str) -> str:
    """The code in a line's text (the inverse of ``line_text``, without the newline): drop the prompt's space."""
    return text[1:] if text.startswith(" ") else text


def encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``. For a fast tokenizer in its plain state (no truncation,
    padding or special-token splitting set) that is one call of its Rust tokenizer, made here directly: transformers'
    wrapper around it cost 2-3x the call itself, and it runs for every line's output (bench/tokenize_line.py)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is not None and _plain(tokenizer, rust):
        return rust.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _plain(tokenizer: Any, rust: Any) -> bool:
    """Whether ``tokenizer.encode`` would leave ``rust`` as it is and call its ``encode_batch`` alone."""
    try:
        return (not getattr(tokenizer, "split_special_tokens", False) and not rust.encode_special_tokens
                and rust.truncation is None and rust.padding is None)
    except AttributeError:  # another kind of tokenizer object: its own encode
        return False


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` as sampled: no clean-up of spaces before punctuation (``x ...`` stays ``x ...``; SmolLM2's
    GGUF tokenizer asks for the clean-up under transformers 4.x)."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


class EnvSplice(NamedTuple):
    """The environment's tokens after a line, and where what the interpreter printed lies in them (``env_splice``)."""

    ids: list[int]
    text: str
    """The text ``ids`` encode: the printed text (cut, when long), then what the environment adds (a newline and the
    truncation marker after a cut, the next prompt)."""
    printed_chars: int
    """``text[:printed_chars]`` is what the interpreter printed (as kept)."""
    printed_tokens: int
    """``ids[:printed_tokens]`` are the tokens that start in the printed text (a token that runs on into the prompt,
    a BPE merge of ``"\n>>>"``, counts: it carries printed text)."""


def env_splice(tokenizer: Any, output: str, next_prompt: str, max_output_tokens: int) -> EnvSplice:
    """Tokens of what the environment prints after a line and the next prompt (healed: ``>>>``, ``...``); long
    output is cut with a visible marker. The printed part's extent is recorded now, where the splice knows it (no
    decode of token prefixes later): the tokens from the end that lie wholly in what follows the printed text."""
    next_prompt = heal(next_prompt)
    ids = encode(tokenizer, output + next_prompt)
    if len(ids) <= max_output_tokens:
        kept, text = output, output + next_prompt
    else:
        kept = decode(tokenizer, encode(tokenizer, output)[:max_output_tokens]).rstrip("\ufffd")
        text = kept + ("" if kept.endswith("\n") else "\n") + TRUNCATED_MARKER + next_prompt
        ids = encode(tokenizer, text)
    return EnvSplice(ids, text, len(kept), _printed_tokens(tokenizer, ids, kept, text[len(kept):]))


def _printed_tokens(tokenizer: Any, ids: list[int], kept: str, tail: str) -> int:
    """How many of ``ids`` (the tokens of ``kept + tail``) start in ``kept``: all but the trailing tokens that lie
    wholly in ``tail``. Mostly the prompt is tokenized on its own at the end (``42\\n`` + ``>>>``): then those are
    its own tokens (known once per tokenizer and prompt, no decoding); else they are found by decoding suffixes."""
    if not kept:
        return 0
    alone = _tail_ids(tokenizer, tail)
    if alone and len(alone) < len(ids) and ids[-len(alone):] == alone:
        return len(ids) - len(alone)
    n = len(ids)
    while n > 1 and len(decode(tokenizer, ids[n - 1:])) <= len(tail):  # token n - 1 starts after the printed text
        n -= 1
    return n


_TAILS: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()


def _tail_ids(tokenizer: Any, tail: str) -> list[int]:
    """``tail``'s own tokens when they decode back to exactly ``tail`` (else []), once per tokenizer and tail."""
    try:
        known = _TAILS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
        known = {}
    if tail not in known:
        ids = encode(tokenizer, tail)
        known[tail] = ids if decode(tokenizer, ids) == tail else []
    return known[tail]


def env_token_ids(tokenizer: Any, output: str, next_prompt: str, max_output_tokens: int) -> list[int]:
    """Tokens of what the environment prints after a line and the next prompt (``env_splice``'s ids)."""
    return env_splice(tokenizer, output, next_prompt, max_output_tokens).ids
