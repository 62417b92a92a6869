"""What replrl's stop list costs vLLM's scheduler per engine step, as a list and with a set's ``in`` (issue 65
item 3).

vLLM's scheduler calls ``check_stop`` for every row after every step; it tests the sampled token with
``last_token_id in stop_token_ids``. replrl stops a line on every newline-ending id (1,467 for Qwen2.5's
tokenizer), so for a token that ends no line (most of them) the list is scanned to its end. ``StopIds`` here is the
same list with a set's ``in``: what the scheduler would pay if its requests held one. (They cannot be given one from
replrl's side today: the line rule's logits processor runs in vLLM's worker process, and vLLM 0.32's CPU build runs
its worker apart from the scheduler, so a list swapped there never reaches ``check_stop``; docs/rollouts.md.)

This times vLLM's own ``check_stop`` over ``--rows`` rows whose last tokens are drawn from the model's vocabulary
(none of them stops, as in most steps), both forms side by side in one run, alternating, best of ``--repeats``.
Needs vllm (on a CPU: .venv-vllm from .ci/vllm_env.sh):

    .venv-vllm/bin/python bench/stop_ids.py --rows 128

The last line is JSON: ms of a step's stop checks with the list and with StopIds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from types import SimpleNamespace

from vllm.v1.core.sched.utils import check_stop
from vllm.v1.request import RequestStatus

from replrl.contract import line_end_ids
from replrl.models import load_tokenizer


class StopIds(list):
    """The stop list with a set's ``in`` (equal to the list it was made from)."""

    def __init__(self, ids: list[int]):
        super().__init__(ids)
        self.members = frozenset(self)

    def __contains__(self, token: object) -> bool:
        return token in self.members


def step_ms(requests: list[SimpleNamespace], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        for r in requests:
            check_stop(r, 1 << 20)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="rows in a step (default 128)")
    ap.add_argument("--steps", type=int, default=200, help="steps timed per repeat (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="alternating repeats, best kept (default 5)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="tokenizer whose stop list is priced")
    args = ap.parse_args()

    tok = load_tokenizer(args.model)
    stops = sorted(line_end_ids(tok) | {tok.eos_token_id})
    rng = random.Random(0)
    plain = [i for i in range(len(tok)) if i not in set(stops)]

    def rows(ids: list[int]) -> list[SimpleNamespace]:
        return [SimpleNamespace(
            sampling_params=SimpleNamespace(eos_token_id=-1, stop_token_ids=ids, min_tokens=0,
                                            repetition_detection=None, stop=[], max_tokens=1 << 20),
            output_token_ids=[rng.choice(plain)], num_tokens=10, num_output_tokens=1, max_tokens=1 << 20,
            status=RequestStatus.RUNNING, pooling_params=None, stop_reason=None) for _ in range(args.rows)]

    as_list, as_set = rows(list(stops)), rows(StopIds(stops))
    best = {"list": float("inf"), "set": float("inf")}
    for _ in range(args.repeats):
        best["list"] = min(best["list"], step_ms(as_list, args.steps))
        best["set"] = min(best["set"], step_ms(as_set, args.steps))
    assert all(r.status == RequestStatus.RUNNING for r in as_list + as_set), "a plain token stopped a row"
    print(f"{len(stops)} stop ids, {args.rows} rows: a step's stop checks take {best['list']:.3f} ms with the "
          f"list, {best['set']:.3f} ms with StopIds ({best['list'] / best['set']:.1f}x)")
    print(json.dumps({"stop_ids": len(stops), "rows": args.rows, "list_ms_per_step": round(best["list"], 4),
                      "stopids_ms_per_step": round(best["set"], 4),
                      "ratio": round(best["list"] / best["set"], 2)}))


if __name__ == "__main__":
    main()
