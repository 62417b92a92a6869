"""The CPU proxy of the line loop's cost (issue 48): Qwen2.5's real tokenizer (its 151,936-token vocabulary and
1,466 line-ending ids, as the 0.5B model samples them) over a model cut so small that an engine step on this CPU is
not mostly the model: 2 layers, hidden 128, 2 heads of 64 (1 KV head), random weights (seeded), tied embeddings. (Its
LM head, 128 x 151,936, is still most of its forward: about 19M multiply-adds a token, as the earlier SmolLM2-based
proxy's 256 x 49,152.) Built
once in replrl's cache from the qwen2.5-coder-0.5b-instruct alias's GGUF (the tokenizer is read from it; no weights
are used), then loaded like any model directory.

    python bench/proxy_model.py            # prints the directory (builds it the first time)
    python bench/backends.py --model proxy # what the bench's --model proxy means
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROXY = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=256, max_position_embeddings=4096, tie_word_embeddings=True)
"""The proxy's shape (a Qwen2 config with these fields changed)."""
QWEN25_VOCAB = 151_936
"""The 0.5B model's vocabulary size (its embedding rows: the tokenizer's ids, padded)."""


def proxy_dir(seed: int = 0) -> Path:
    """The proxy model's directory in replrl's cache, built on first use (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from replrl.model_aliases import QWEN_CODER, split_gguf
    from replrl.models import cache_dir

    out = cache_dir() / "proxy" / f"qwen2.5-tokenizer-l2-h128-seed{seed}"
    if (out / "config.json").is_file():
        return out
    gguf = split_gguf(QWEN_CODER, cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = Qwen2Config(vocab_size=QWEN25_VOCAB, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **PROXY)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    print(proxy_dir(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
