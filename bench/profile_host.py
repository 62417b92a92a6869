"""Where the trainer's own process spends its CPU during REPL rollouts (issue 65, item 1): ``bench/backends.py`` on
the CPU proxy (vLLM only, one batch size, the REPL rollouts alone) under py-spy, attached to the bench's process for
its timed REPL rollout only, then the samples aggregated by component.

    .venv-vllm/bin/pip install py-spy        # once, into the vLLM environment (.ci/vllm_env.sh)
    .venv-vllm/bin/python bench/profile_host.py --batch 128 --tokens 320 --data tests/data/gsm8k/test.jsonl
    python bench/profile_host.py --raw runs/host_profile/profile.raw --cpu-ms-per-line 3.7   # aggregate only

py-spy samples every thread of the process it does not see idle (``--idle`` is off), ``--rate`` times a second,
``--nonblocking`` (the process is never paused). On a loaded machine it also counts a runnable thread waiting for a
core (the first batch-128 run: 59.8 CPU-s sampled against the 15.8 CPU-s the process used), so: ``--renice -15``
(the default) gives the bench's own threads (not its engine or kernels) priority for the profile, and the shares are
weighted by each thread's measured CPU (the bench's ``vllm_host_cpu_s_by_thread``, from ``/proc/self/task``): a
thread's CPU seconds are exact, only their split within the thread is sampled. The table prints the samples' own
shares beside them, and the samples' CPU seconds beside the process's (``vllm_cpu_host_s``) as the check. Each
sample (a stack) goes to one component, the first of these that has a frame in it:

1. ``vllm``: vLLM's front end in this process (``vllm/``: AsyncLLM, the output processor, detokenization, the engine
   core client's sockets) and replrl's side of it (``replrl/backends/``);
2. ``kernels``: the kernels' traffic (``sandbox/``: kernel.py, zmtp.py, reply.py, the pool; ``jupyter_client``; the
   json and hmac they call; pyzmq with no owner above it, except on vLLM's loop thread, where it is vLLM's);
3. ``tokenize``: tokenization of the interpreter's output and decoding of the sampled lines
   (``replrl/rollout/transcript.py``, ``transformers``' tokenizers, ``tokenizers``);
4. ``episode``: the episode loop (``replrl/rollout/``, ``replrl/repl.py`` and its ``codeop``, ``replrl/rewards.py``,
   the bench's own loop in ``bench/backends.py``);
5. ``asyncio``: the event loops themselves: none of the above in the stack, and the innermost frame in ``asyncio/``,
   ``selectors``, ``concurrent/futures``, ``threading`` or ``queue`` (scheduling, selecting, waking threads);
6. ``other``: the rest (the bench's CPU meter, the garbage collector where py-spy shows it alone, ...).

Each component's CPU-ms per line is its share times the bench's host CPU-ms per line. vLLM's front end and the
kernel traffic are split further into parts (``PARTS``: the per-line request, the engine core client, outputs,
replrl's session; the wire, the message, a kernel's end, the checks); every component by its innermost Python file.
``--native`` adds native frames (C, Rust) to the stacks (tokenizers, hmac, json's C parts), a heavier sampler.

Writes into ``--out``: ``bench.log`` (the bench's output), ``profile.raw`` (py-spy's collapsed stacks), and prints a
table and one JSON line of the shares.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("vllm", ("vllm/", "replrl/backends/")),
    ("kernels", ("sandbox/", "jupyter_client/")),
    ("tokenize", ("replrl/rollout/transcript.py", "transformers/tokenization", "transformers/convert_slow",
                  "tokenizers/", "libtokenizers", "tokenizers.abi3")),
    ("episode", ("replrl/rollout/", "replrl/repl.py", "replrl/rewards.py", "replrl/types.py", "codeop.py",
                 "bench/backends.py", "backends.py")),
    ("asyncio", ("asyncio/", "selectors.py", "concurrent/futures/", "threading.py", "queue.py")),
]
"""Components in the order a stack is tested against them: the first with a frame whose file matches one of its
patterns (py-spy names a file by its path under its sys.path entry: ``vllm/v1/engine/async_llm.py``,
``threading.py``, the bench's own ``backends.py``) takes the sample."""
IGNORED = ("sandbox/sync.py",)
"""Files that say nothing of the work: the main thread's wait for the loop thread (``run_sync``)."""


def matches(file: str, pattern: str) -> bool:
    """Whether py-spy's ``file`` is (under) ``pattern``: equal, starting with it, or with it after a slash."""
    return file == pattern or file.startswith(pattern) or f"/{pattern}" in file


LABELS = {"vllm": "vLLM front end (AsyncLLM, output processing, detokenization, core client; replrl's session)",
          "kernels": "kernel traffic (sandbox/kernel.py, zmtp.py, reply.py; json, hmac under them)",
          "tokenize": "tokenization (interpreter output encoded, sampled lines decoded)",
          "episode": "episode loop (the bench's loop, replrl/repl.py, codeop)",
          "asyncio": "asyncio and threads alone (event loops, selectors, futures)",
          "other": "other"}
PARTS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "vllm": [("a request per line: SamplingParams built, checked, deep-copied",
              ("sampling_params.py", "copy.py", "input_processor.py")),
             ("engine core client: msgpack, ZMQ", ("core_client.py", "serial_utils.py", "zmq/")),
             ("outputs: output processor, logprobs, detokenizer", ("output_processor.py", "logprobs.py",
                                                                    "detokenizer.py", "async_llm.py", "outputs.py")),
             ("replrl's session: streams, the hand-over between the two loops", ("replrl/backends/",))],
    "kernels": [("a kernel's end: killed, its directory removed", ("KernelProcess.kill", "kernel_dirs.py")),
                ("the wire: zmtp.py (the send, frames read)", ("zmtp.py",)),
                ("the message: jupyter_client's Session (sign, serialize, json, dates)", ("jupyter_client/",)),
                ("reply and budget checks", ("reply.py", "budget.py")),
                ("kernel.py, pool.py", ("kernel.py", "pool.py"))],
}
"""Parts of a component: a stack's innermost frame (``func (file)``) that contains one of a part's strings names its
part (else ``other``)."""
VLLM_THREAD = "replrl-vllm"
"""The thread vLLM's front end runs on in the trainer's process (``replrl/backends/vllm/engine.py``'s loop)."""
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    """py-spy's collapsed stack (root first, ``;``-separated, ``func (file:line)``) -> [(func, file)], root first.
    A thread's frame (``--threads``: ``thread (0x...)``) is kept as ("thread", its text)."""
    out = []
    for part in stack.split(";"):
        if part.startswith(("thread (", "process ")):
            out.append(("thread", part))
            continue
        m = FRAME.match(part)
        out.append((m["func"], m["file"]) if m else (part, ""))
    return out


def thread_name(fs: list[tuple[str, str]]) -> str:
    """The thread's name in py-spy's ``thread (TID): NAME`` frame (``--threads``), else ``?``."""
    frame = next((f for func, f in fs if func == "thread"), "")
    return frame.partition("): ")[2] or "?"


def component(fs: list[tuple[str, str]]) -> str:
    """The component a stack goes to (``COMPONENTS``; ``other`` when none matches). pyzmq's frames with no owner
    above them (its asyncio callbacks) belong to whoever speaks ZMQ on that thread: vLLM's engine core client on
    vLLM's loop, the kernels' sockets elsewhere (before f8fc8f8 the sandbox spoke ZMQ through pyzmq)."""
    files = [f for func, f in fs if func != "thread" and not any(matches(f, i) for i in IGNORED)]
    owned = [n for n, patterns in COMPONENTS[:2] if any(matches(f, p) for f in files for p in patterns)]
    if not owned and any(matches(f, "zmq/") for f in files):
        return "vllm" if thread_name(fs) == VLLM_THREAD else "kernels"
    for name, patterns in COMPONENTS:
        if name == "asyncio":  # the loop's own work: the innermost frame is the loop's (a thread's root always is)
            files = files[-1:]
        if any(matches(f, p) for f in files for p in patterns):
            return name
    return "other"


def innermost(fs: list[tuple[str, str]], patterns: tuple[str, ...] = ("",)) -> str:
    """The innermost frame's file (shortened to its last two path parts) matching one of ``patterns``, else ``-``."""
    for func, f in reversed(fs):
        if func != "thread" and f and any(matches(f, p) for p in patterns):
            parts = Path(f).parts
            return "/".join(parts[-2:]) if len(parts) > 1 else f
    return "-"


def part(comp: str, stack: str) -> str:
    """The part of ``comp`` a stack belongs to (``PARTS``), from its innermost frame outwards."""
    for frame in reversed(stack.split(";")):
        for name, keys in PARTS.get(comp, []):
            if any(k in frame for k in keys):
                return name
    return "other"


def aggregate(raw: Path) -> dict:
    """Samples by component, by thread, and by innermost file within each component, from py-spy's raw output."""
    by_comp: Counter[str] = Counter()
    by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    by_file: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        fs = frames(stack)
        comp = component(fs)
        by_comp[comp] += n
        by_thread[thread_name(fs)][comp] += n
        if comp in PARTS:
            by_thread[thread_name(fs)][f"{comp}: {part(comp, stack)}"] += n
        patterns = dict(COMPONENTS).get(comp, ("",))
        by_file[comp][innermost(fs, patterns) if comp == "vllm" else innermost(fs)] += n
        total += n
    return {"total": total, "by_comp": by_comp, "by_thread": by_thread, "by_file": by_file}


def cpu_weighted(agg: dict, by_thread_cpu: dict[str, float]) -> dict[str, float]:
    """Component shares of the process's CPU: each thread's measured CPU seconds (``by_thread_cpu``, the bench's
    ``/proc/self/task`` figures) split over components as that thread's samples are. A sampler that counts a
    runnable thread as running (py-spy did on this loaded machine: 59.8 CPU-s sampled against 15.8 used)
    over-counts what runs just after waking up; per thread, the CPU total is exact. A thread with CPU and no
    samples goes to ``other``."""
    out: Counter[str] = Counter()
    total = sum(by_thread_cpu.values()) or 1.0
    for thread, comps in agg["by_thread"].items():
        if thread not in by_thread_cpu:
            continue
        cpu = by_thread_cpu[thread]
        n = sum(k for c, k in comps.items() if ": " not in c)
        for comp, k in comps.items():
            out[comp] += cpu * k / n
    for thread, cpu in by_thread_cpu.items():
        if thread not in agg["by_thread"]:
            out["other"] += cpu
    return {c: v / total for c, v in out.items()}


def report(agg: dict, rate: float, host_ms_per_line: float | None, host_cpu_s: float | None, extra: dict,
           by_thread_cpu: dict[str, float] | None = None) -> dict:
    """Print the table; return the JSON line's object. With ``by_thread_cpu``, the shares are of the CPU each
    thread used (``cpu_weighted``); the samples' own shares are printed beside them."""
    total = max(agg["total"], 1)
    names = [n for n, _ in COMPONENTS] + ["other"]
    sample_shares = {n: round(agg["by_comp"][n] / total, 4) for n in names}
    weighted = cpu_weighted(agg, by_thread_cpu) if by_thread_cpu else None
    shares = {n: round(weighted.get(n, 0.0), 4) for n in names} if weighted else sample_shares
    sampled_s = agg["total"] / rate
    print(f"\n{agg['total']} samples at {rate:g} Hz: {sampled_s:.1f} CPU-s sampled"
          + (f" against {host_cpu_s:.1f} CPU-s the process used over the rollout" if host_cpu_s else ""))
    head = "CPU-ms a line" if host_ms_per_line else ""
    kind = "share of the CPU (by thread)" if weighted else "share of samples"
    print(f"\n| component | {kind} | share of samples | {head} |\n|---|---|---|---|")
    for n in names:
        ms = f"{shares[n] * host_ms_per_line:.2f}" if host_ms_per_line else ""
        print(f"| {LABELS[n]} | {shares[n]:.1%} | {sample_shares[n]:.1%} | {ms} |")
    if host_ms_per_line:
        print(f"| all (the bench's host CPU over the rollout's lines) | 100% | 100% | {host_ms_per_line:.2f} |")
    print("\nBy thread (samples; measured CPU-s where known; components of its samples):")
    threads = sorted(agg["by_thread"].items(), key=lambda kv: -sum(kv[1].values()))
    for thread, comps in threads[:8]:
        comps = Counter({c: k for c, k in comps.items() if ": " not in c})
        n = sum(comps.values())
        cpu = f", {by_thread_cpu[thread]:.2f} CPU-s" if by_thread_cpu and thread in by_thread_cpu else ""
        print(f"  {thread}: {n} ({n / total:.1%}{cpu}): "
              + ", ".join(f"{c} {k / n:.0%}" for c, k in comps.most_common(5)))
    if by_thread_cpu:
        unsampled = {t: c for t, c in by_thread_cpu.items() if t not in agg["by_thread"]}
        if unsampled:
            print("  measured, never sampled: " + ", ".join(f"{t} {c:.2f} CPU-s" for t, c in unsampled.items()))
    shares_of = weighted if weighted else {c: k / total for c, k in sum(agg["by_thread"].values(), Counter()).items()}
    parts = {c: round(v, 4) for c, v in sorted(shares_of.items()) if ": " in c}
    print("\nParts of vLLM's front end and of the kernel traffic:")
    print(f"\n| part | share | {head} |\n|---|---|---|")
    for c, v in parts.items():
        ms = f"{v * host_ms_per_line:.2f}" if host_ms_per_line else ""
        print(f"| {c} | {v:.1%} | {ms} |")
    print("\nInnermost files per component (share of all samples):")
    for n in names:
        files = agg["by_file"][n].most_common(6)
        if files:
            print(f"  {n}: " + ", ".join(f"{f} {k / total:.1%}" for f, k in files))
    out = {"samples": agg["total"], "rate_hz": rate, "sampled_cpu_s": round(sampled_s, 2), "shares": shares,
           "sample_shares": sample_shares, "shares_weighted_by_thread_cpu": bool(weighted), "parts": parts, **extra}
    if host_ms_per_line:
        out["cpu_ms_per_line"] = {n: round(shares[n] * host_ms_per_line, 3) for n in names}
    out["top_files"] = {n: {f: round(k / total, 4) for f, k in agg["by_file"][n].most_common(6)} for n in names}
    return out


def renice(pid: int, nice: int) -> None:
    """Give every thread of ``pid`` (the bench's own process; not its engine or kernels) niceness ``nice``, so that
    on a loaded machine a thread of it that wakes up gets a core at once: a sampler that counts a runnable thread
    as running (py-spy, on a loaded machine) then counts what it runs, not the run queue."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass


def run_bench(args: argparse.Namespace, out: Path) -> dict:
    """The bench under py-spy for its timed REPL rollout; the bench's JSON line's figures of that batch."""
    py_spy = shutil.which("py-spy", path=f"{Path(args.python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if py_spy is None:
        sys.exit(f"py-spy not found beside {args.python} or on PATH: {args.python} -m pip install py-spy")
    cmd = [args.python, str(ROOT / "bench" / "backends.py"), "--model", args.model, "--no-hf", "--refill", "idle",
           "--repl-only", "--mark", "--batches", str(args.batch), "--tokens", str(args.tokens),
           "--line-tokens", str(args.line_tokens), *(["--data", args.data] if args.data else [])]
    print("$ " + " ".join(cmd), flush=True)
    log = open(out / "bench.log", "w")
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             cwd=args.cwd or None)
    spy: subprocess.Popen | None = None
    last = ""
    assert bench.stdout is not None
    for line in bench.stdout:
        log.write(line)
        log.flush()
        if line.startswith("@@ rollout start"):
            pid = line.split()[-1]
            spy_cmd = [py_spy, "record", "--pid", pid, "--rate", str(args.rate), "--format", "raw", "--threads",
                       "--nonblocking", "-o", str(out / "profile.raw"), *(["--native"] if args.native else [])]
            print("$ " + " ".join(spy_cmd), flush=True)
            spy = subprocess.Popen(spy_cmd, stdout=open(out / "py-spy.log", "w"), stderr=subprocess.STDOUT)
            if args.renice:
                renice(int(pid), args.renice)
        elif line.startswith("@@ rollout end") and spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            spy.wait(120)
            print(line.strip(), flush=True)
        elif line.startswith("{"):
            last = line
        elif not line.startswith(("Loading", "(")) and "WARNING" not in line:
            print(line.rstrip(), flush=True)
    if bench.wait() != 0 or not last:
        sys.exit(f"the bench failed (exit {bench.returncode}): see {out / 'bench.log'}")
    figures = json.loads(last)
    host = figures["host_by_batch"][str(args.batch)]
    return {"bench": {k: v for k, v in figures.items() if k not in ("batches", "ratios_by_batch")}, "host": host,
            "steps": figures["batches"][str(args.batch)].get("vllm_steps_repl")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_py = ROOT / ".venv-vllm" / "bin" / "python"
    ap.add_argument("--python", default=str(default_py) if default_py.exists() else sys.executable,
                    help="the Python with vllm and py-spy (default: .venv-vllm's)")
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=320, help="model tokens a row (the rollout's length)")
    ap.add_argument("--line-tokens", type=int, default=24)
    ap.add_argument("--data", default=os.environ.get("REPLRL_GSM8K"), help="GSM8K (the bench's --data)")
    ap.add_argument("--rate", type=float, default=200, help="py-spy's samples a second")
    ap.add_argument("--renice", type=int, default=-15,
                    help="niceness of the bench's own threads during the profile (0: left as they are; below 0 "
                         "needs root)")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C and Rust frames too)")
    ap.add_argument("--cwd", default="", help="run the bench there (a worktree of another commit, with PYTHONPATH)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "host_profile")
    ap.add_argument("--raw", type=Path, help="aggregate this py-spy raw file only (no run)")
    ap.add_argument("--cpu-ms-per-line", type=float, help="with --raw: the host's CPU-ms a line, for the ms column")
    ap.add_argument("--thread-cpu", type=json.loads, help="with --raw: the bench's vllm_host_cpu_s_by_thread (JSON)")
    args = ap.parse_args()
    if args.raw:
        print(json.dumps(report(aggregate(args.raw), args.rate, args.cpu_ms_per_line, None, {}, args.thread_cpu)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ran = run_bench(args, args.out)
    host = ran["host"]
    extra = {"batch": args.batch, "tokens_per_row": args.tokens, "wall_s": round(time.time() - t0),
             "host_cpu_ms_per_line": host["vllm_host_cpu_ms_per_line"],
             "host_cpu_ms_per_model_token": host["vllm_host_cpu_ms_per_model_token"],
             "host_cpu_cores": host["vllm_host_cpu_cores"], "host": host, "loadavg": host["vllm_loadavg"]}
    extra["renice"] = args.renice
    result = report(aggregate(args.out / "profile.raw"), args.rate, host["vllm_host_cpu_ms_per_line"],
                    host["vllm_cpu_host_s"], extra, host.get("vllm_host_cpu_s_by_thread"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
