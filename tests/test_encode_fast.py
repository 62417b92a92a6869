"""``rollout.transcript.encode`` calls a fast tokenizer's Rust tokenizer directly: the ids must be exactly
``tokenizer.encode(text, add_special_tokens=False)``'s, for both offline tokenizers, whatever an interpreter prints
(special-token text included), and also after someone set truncation on the tokenizer (then the wrapper runs)."""

from __future__ import annotations

import pytest

from replrl.models import load_tokenizer
from replrl.rollout.transcript import encode, env_token_ids

TEXTS = [
    "", ">>>", "...", "42\n>>>", "[1, 2, 3]\n>>>", "  File \"<stdin>\", line 1\n    x = (\n        ^\n",
    "Traceback (most recent call last):\nNameError: name 'x' is not defined\n>>>",
    "<|endoftext|> <|im_end|><|im_start|>user\n", "\ufffd\u00e9\u4e2d\u6587 \U0001f600\t\r\n", " " * 50 + "x",
    "0.30000000000000004\n" * 40, "'\\x00\\x01'\n>>>",
]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_the_direct_call_gives_the_wrappers_ids(name):
    tok = load_tokenizer(name)
    assert getattr(tok, "_tokenizer", None) is not None  # the fast path is the one taken
    for text in TEXTS:
        assert encode(tok, text) == tok.encode(text, add_special_tokens=False), text
        assert env_token_ids(tok, text, ">>> ", 16) == env_token_ids(_Wrapper(tok), text, ">>> ", 16)
    tok("a b c d e f g h", truncation=True, max_length=3)  # leaves truncation set on the Rust tokenizer
    long = "1 2 3 4 5 6 7 8 9 10\n>>>"
    assert encode(tok, long) == tok.encode(long, add_special_tokens=False)
    assert len(encode(tok, long)) > 3


class _Wrapper:
    """The tokenizer seen only through its public methods (no ``_tokenizer``): the slow path."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=False):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, clean_up_tokenization_spaces=False):
        return self.tok.decode(ids, clean_up_tokenization_spaces=clean_up_tokenization_spaces)
