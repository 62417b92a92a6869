"""What the TRL side's prompt makes the model write before any training: two samples per problem, printed raw, to
see whether the tool call is in the <tool_call> tags TRL's loop parses (docs/results/vs_trl_qwen_2026-11-28/).

    python bench/vs_trl_tool_probe.py [--model qwen2.5-coder-0.5b-instruct]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402

from replrl.models import load_model_and_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--samples", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(str(resolve_model(args.model)), dtype=torch.float32, device="cpu")
    env = vs_trl.PythonSandbox()
    for q in ["What is 42 - 40?", "What is 67 * 62?"]:
        msgs = [{"role": "user", "content": f"{q}\n\n{vs_trl.TOOL_NOTE}"}]
        text = tok.apply_chat_template(msgs, tools=[env.python], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        torch.manual_seed(0)
        print(q)
        for _ in range(args.samples):
            out = model.generate(ids, max_new_tokens=120, do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
            text_out = tok.decode(out[0, ids.shape[1]:])
            print("  tool call in tags:", "<tool_call>" in text_out, "|", repr(text_out))


if __name__ == "__main__":
    main()
