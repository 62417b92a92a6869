"""`replrl export`: a run's trained model out of its run directory, with a model card, and to the Hub on request.

The model is what ``checkpoint.save_model`` writes (a LoRA run's adapters merged into the base weights, the adapter
kept in ``adapter/``), so a plain ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it; the card (README.md) says
which base model, task and number of steps, the held-out accuracy before -> after, and holds the run's config.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from ..configlib import ConfigError

EXPORT_HELP = """\
Write a run's trained model to DIR in Hugging Face format, with a model card (README.md: base model, task, steps,
held-out accuracy before -> after, the run's config), loadable by AutoModelForCausalLM.from_pretrained(DIR).

Without --step: the run's final model (RUN/model, written at the end of every run and at Ctrl-C), or its latest
checkpoint where that is newer. --step N: the checkpoint of step N (checkpoints/step-0000NN). A LoRA run's adapters
are merged into the base weights; the adapter itself is kept in DIR/adapter/.

--push-to-hub REPO also uploads DIR to the Hugging Face Hub model repository REPO (created if needed, private with
--private); it needs a token (HF_TOKEN, or `hf auth login`).

examples:
  replrl export runs/smollm2-135m-instruct-arithmetic --out exported/arith
  replrl export runs/t08 --out exported/t08-step40 --step 40
  replrl export runs/t08 --out exported/t08 --push-to-hub me/smollm2-repl-arithmetic
"""

HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
"""The Hub model each offline alias is a copy of (a card's base_model)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's model (merged LoRA, model card) to a directory or the Hub",
                       description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", help="run directory (it holds config.toml)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the model and its card to")
    p.add_argument("--step", type=int, help="export the checkpoint of this step (default: the final model)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload DIR to this Hub model repository")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    out = export(args.run_dir, args.out, step=args.step)
    print(f"wrote {out} (model card: {out / 'README.md'})")
    if args.push_to_hub:
        url = push_to_hub(out, args.push_to_hub, private=args.private)
        print(f"pushed to {url}")
    return 0


def run_config(run_dir: str | Path) -> Any:
    """The resolved config a run directory saved (config.toml)."""
    from ..config import Config
    from ..configlib import load_file, merge, resolve, to_dict

    saved = Path(run_dir) / "config.toml"
    if not saved.exists():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory: it has no config.toml")
    return resolve(Config, None, {}, base=merge(to_dict(Config()), load_file(saved)))


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the model of ``run_dir`` (its final model, or the checkpoint of ``step``) and its card to ``out``."""
    from .. import checkpoint

    run_dir, out = Path(run_dir), Path(out)
    cfg = run_config(run_dir)
    if out.exists() and any(out.iterdir()) and checkpoint.model_step(out) is None:
        raise ConfigError(f"--out {str(out)!r} exists and holds something other than an exported model")
    if out.resolve() == (run_dir / checkpoint.MODEL_DIR).resolve():
        raise ConfigError("--out is the run's own model directory: name another")
    final = run_dir / checkpoint.MODEL_DIR
    final_step = checkpoint.model_step(final)
    if step is None:
        latest = checkpoint.latest(run_dir)
        latest_step = _ckpt_step(latest) if latest is not None else None
        if final_step is not None and (latest_step is None or final_step >= latest_step):
            _copy_model(final, out)
        elif latest is not None:
            _save_checkpoint_model(cfg, latest, out, latest_step or 0)
        else:
            raise ConfigError(f"run {str(run_dir)!r} has no final model and no checkpoint to export")
    elif final_step == step:
        _copy_model(final, out)
    else:
        ckpt = run_dir / checkpoint.CKPT_DIR / f"step-{step:06d}"
        if not (ckpt / "state.json").exists():
            have = sorted(_ckpt_step(p) for p in (run_dir / checkpoint.CKPT_DIR).glob("step-*")
                          if (p / "state.json").exists()) if (run_dir / checkpoint.CKPT_DIR).exists() else []
            also = [final_step] if final_step is not None else []
            raise ConfigError(f"run {str(run_dir)!r} has no model of step {step}; steps it has: "
                              f"{', '.join(map(str, sorted(set(have + also)))) or 'none'}")
        _save_checkpoint_model(cfg, ckpt, out, step)
    exported = checkpoint.model_step(out) or 0
    (out / "replrl_config.toml").write_text((run_dir / "config.toml").read_text())
    (out / "README.md").write_text(model_card(cfg, run_dir, exported, name=out.resolve().name))
    return out


def _ckpt_step(path: Path) -> int:
    return int(json.loads((path / "state.json").read_text())["step"])


def _copy_model(src: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)


def _save_checkpoint_model(cfg: Any, ckpt: Path, out: Path, step: int) -> None:
    """A checkpoint's model written as ``save_model`` writes the final one (an adapter checkpoint merged)."""
    from .. import checkpoint
    from ..policy import load_policy

    model, tokenizer = load_policy(cfg.model, seed=cfg.run.seed, checkpoint=ckpt)
    checkpoint.save_model(out, model, tokenizer, step, base_model=cfg.model.name)


def held_out(run_dir: str | Path, step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The eval/ figures of the untrained model (step 0) and of the last evaluation at or before ``step``."""
    from ..metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    before = next((r for r in rows if r["step"] == 0), None)
    after = next((r for r in reversed(rows) if 0 < r["step"] <= step), None)
    return before, after


def model_card(cfg: Any, run_dir: str | Path, step: int, name: str = "model") -> str:
    """README.md of an exported model: Hub metadata, what it was trained on, held-out before -> after, the config."""
    from ..configlib import to_toml

    base = cfg.model.name
    hub_base = HUB_IDS.get(base, base if "/" in base and not Path(base).exists() else "")
    meta = ["---", "library_name: transformers", "pipeline_tag: text-generation",
            "tags:", "- replrl", "- grpo", "- reinforcement-learning", "- python-repl"]
    if hub_base:
        meta.append(f"base_model: {hub_base}")
    meta.append("---")
    task = cfg.task.name + (f" (data: {cfg.task.data})" if cfg.task.data else
                            f" (level {cfg.task.level})" if cfg.task.name in ("arithmetic", "programs", "explore")
                            else "")
    before, after = held_out(run_dir, step)

    def pct(row: dict[str, Any] | None) -> str:
        return "-" if row is None else f"{100 * row['eval/accuracy']:.0f}%"

    episodes = int((after or before or {}).get("eval/episodes", cfg.run.eval_n))
    lora = f", LoRA rank {cfg.model.lora_rank} (merged into the weights; the adapter is in adapter/)" \
        if cfg.model.lora_rank else ""
    lines = [*meta, "", f"# {name}", "",
             "A language model trained with replrl (GRPO) to reason inside a "
             "live Python REPL, one line at a time: it writes a line after each `>>> ` prompt, the line runs, and "
             "the interpreter's output is spliced in before the next prompt, as in a CPython interactive session.",
             "", "| | |", "|---|---|",
             f"| base model | {hub_base or base}{lora} |",
             f"| task | {task} |",
             f"| training steps | {step} (of run.max_steps {cfg.run.max_steps}) |",
             f"| held-out accuracy ({episodes} problems of {cfg.task.eval_split}) | {pct(before)} -> {pct(after)} |",
             "", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'model = AutoModelForCausalLM.from_pretrained("{name}")',
             f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", "",
             "To let it work in the REPL it was trained in: `replrl eval --model DIR` (held-out accuracy) or "
             "`replrl rollout --model DIR` (episodes to read).", "",
             "## Training config", "", "The run's resolved config (also in `replrl_config.toml`):", "",
             "```toml", to_toml(cfg).rstrip(), "```", ""]
    return "\n".join(lines)


def push_to_hub(folder: str | Path, repo: str, private: bool = False) -> str:
    """Upload ``folder`` to the Hub model repository ``repo`` (created if it does not exist); the repo's URL."""
    from huggingface_hub import HfApi, get_token

    if not get_token():
        raise ConfigError("--push-to-hub needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    api = HfApi()
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                      commit_message="replrl export")
    return f"https://huggingface.co/{repo}"
