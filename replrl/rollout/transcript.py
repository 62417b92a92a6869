"""The splice, text <-> ids: the episode's prompt, prompt healing, a line's text and code, encode/decode as sampled,
and the environment's tokens after a line (DESIGN.md invariants 1 and 2: ids are concatenated, never re-tokenized)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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


def env_token_ids(tokenizer: Any, output: str, next_prompt: str, max_output_tokens: int) -> list[int]:
    """Tokens of what the environment prints after a line and the next prompt (healed: ``>>>``, ``...``); long
    output is cut with a visible marker."""
    next_prompt = heal(next_prompt)
    ids = encode(tokenizer, output + next_prompt)
    if len(ids) <= max_output_tokens:
        return ids
    kept = decode(tokenizer, encode(tokenizer, output)[:max_output_tokens]).rstrip("\ufffd")
    return encode(tokenizer, kept + ("" if kept.endswith("\n") else "\n") + TRUNCATED_MARKER + next_prompt)
