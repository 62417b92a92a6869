"""The `replrl` command: `replrl repl | rollout | train | eval | plot | export | sweep | compare | env`.

Every subcommand turns expected failures (bad config, missing model or dataset, a sandbox that cannot start) into
one clear line on stderr and a non-zero exit code; ``--debug`` shows the full traceback instead.

One module per command group, each with ``add_parser(sub)``: ``repl``, ``rollout``, ``train`` (train, eval, plot),
``export``, ``sweep`` (sweep, compare), ``env``. A new command is a module here and a line in ``build_parser``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from sandbox.errors import KernelStartError, SandboxUnavailable

from .. import __version__
from ..configlib import settle_config_file
from . import env, export, repl, rollout, sweep, train

# Errors a user can fix; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, KernelStartError, SandboxUnavailable)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replrl",
        description="Reinforcement learning for language models that reason inside a live Python REPL.",
    )
    parser.add_argument("--version", action="version", version=f"replrl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (repl, rollout, train, export, sweep, env):
        module.add_parser(sub)
    return parser


class _ConsoleFormatter(logging.Formatter):
    """Results meant for the reader (the ``replrl.console`` logger's INFO lines: held-out accuracy as it comes) as
    plain lines; every other record with its level and logger. (``--no-progress`` swaps in a formatter that stamps
    every line with its time and logger, for log files.)"""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "replrl.console" and record.levelno == logging.INFO:
            return record.getMessage()
        return super().format(record)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_ConsoleFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, handlers=[handler])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(settle_config_file(args)) or 0)
    except KeyboardInterrupt:
        print("replrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `replrl env | head -3`: the reader has gone, which is no error of ours
        return _reader_gone()
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"replrl {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 1


def run_script(fn: Callable[[], object], name: str | None = None) -> int:
    """Run a script's ``main`` (bench/, examples/) with the CLI's error contract: a user error is one line on stderr
    and exit code 1 (``REPLRL_DEBUG=1`` shows the traceback)."""
    name = name or os.path.basename(sys.argv[0])
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if os.environ.get("REPLRL_DEBUG"):
            raise
        print(f"{name}: error: {_one_line(err)}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """stdout's reader closed the pipe: point stdout at /dev/null (the exit's flush would raise again) and exit as a
    process killed by SIGPIPE would, quietly (Python's documented recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
