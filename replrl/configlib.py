"""Config machinery: TOML files and dotted command-line overrides onto the dataclasses of ``replrl.config``.

Field docstrings (the string literal under each field) are read from the source with ``ast`` and become the
``--help`` text. Unknown keys and wrong types are errors with one clear line (and a did-you-mean).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config value or key is wrong; the message is one line saying which and why."""


BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")
"""What a bool option accepts as text (any case)."""


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ConfigError(f"{section}.{name} must be > 0; got {getattr(obj, name)!r}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal under each field in the class body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def sections(config_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check/convert ``value`` to the annotated type; raise ConfigError with the key on a mismatch."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return value.lower() in ("true", "1", "yes")
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is dict:
        value = _json_or_same(value)
        if isinstance(value, dict):
            return dict(value)
    elif origin is list:
        value = _json_or_same(value)
        if isinstance(value, str):  # the command line's a,b,c
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            (arg,) = typing.get_args(hint) or (Any,)
            return [v if arg is Any else _coerce(key, v, arg) for v in value]
    elif origin is tuple:
        value = _json_or_same(value)
        if isinstance(value, (list, tuple)):
            args = typing.get_args(hint)
            return tuple(_coerce(key, v, a) for v, a in zip(value, args)) if len(args) == len(value) else \
                _fail(key, value, hint)
    return _fail(key, value, hint)


def _json_or_same(value: Any) -> Any:
    """A string read as JSON where it parses (``--set a=[1,2]`` gives a list), anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def _fail(key: str, value: Any, hint: Any) -> Any:
    name = getattr(hint, "__name__", str(hint)).replace("typing.", "")
    raise ConfigError(f"{key} must be {name}; got {value!r}")


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def build(config_cls: type, values: dict[str, Any]) -> Any:
    """A config from nested ``{section: {field: value}}``; unknown keys and wrong types raise ConfigError."""
    upgrade = getattr(config_cls, "upgrade", None)  # keys of older saved configs, renamed
    values = upgrade(values) if upgrade is not None else values
    secs = sections(config_cls)
    all_keys = [f"{s}.{f.name}" for s, c in secs.items() for f in dataclasses.fields(c)]
    kwargs = {}
    for sec, value in values.items():
        if sec not in secs:
            raise _unknown(sec, list(secs))
        if not isinstance(value, dict):
            raise ConfigError(f"config section [{sec}] must be a table")
        cls = secs[sec]
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        sec_kwargs = {}
        for key, v in value.items():
            if key not in fields:
                raise _unknown(f"{sec}.{key}", all_keys)
            sec_kwargs[key] = _coerce(f"{sec}.{key}", v, hints[key])
        kwargs[sec] = cls(**sec_kwargs)
    return config_cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` on top of ``base``, section by section; a table field (``rewards.weights``, ``task.options``)
    merges key by key with the table below it, whether it comes from a file or as JSON from the command line
    (``[rewards.weights] ran_and_printed = 0.05`` adds a term and keeps ``correct``; a weight of 0 removes one)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for sec, values in overrides.items():
        if isinstance(values, dict) and isinstance(out.get(sec), dict):
            for key, v in values.items():
                if isinstance(out[sec].get(key), dict):
                    v = _json_or_same(v)
                if isinstance(v, dict) and isinstance(out[sec].get(key), dict):
                    out[sec][key] = {**out[sec][key], **v}
                else:
                    out[sec][key] = v
        else:
            out[sec] = values
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None


@functools.cache
def field_choices(cls: type) -> dict[str, tuple]:
    """{field: choices} from the ``check_choice("section.field", self.field, (...))`` calls of the class's
    ``__post_init__`` whose choices are a literal tuple (the one place the choices are written)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    out = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_choice" and len(node.args) == 3
                and isinstance(node.args[1], ast.Attribute) and isinstance(node.args[2], ast.Tuple)):
            try:
                out[node.args[1].attr] = ast.literal_eval(node.args[2])
            except ValueError:
                continue
    return out


def type_name(hint: Any) -> str:
    """How ``--help`` names a field's type: int, float, str, bool, table (a dict), list, pair."""
    origin = typing.get_origin(hint)
    if origin is dict:
        return "table"
    if origin is list:
        return "list"
    if origin is tuple:
        return "pair" if len(typing.get_args(hint)) == 2 else "tuple"
    return getattr(hint, "__name__", str(hint))


def add_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One ``--section.field VALUE`` option per field, documented by the field's docstring, type, default and
    choices. A bool field also works as a bare flag: ``--run.eval_before`` is ``--run.eval_before true``."""
    defaults = config_cls()
    for sec, cls in sections(config_cls).items():
        group = parser.add_argument_group(f"[{sec}]")
        docs, choices, hints = field_docs(cls), field_choices(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, sec), f.name)
            shown = json.dumps(default) if isinstance(default, (dict, tuple, list)) else repr(default)
            kind = type_name(hints[f.name])
            extra = f"; choices: {', '.join(map(str, choices[f.name]))}" if f.name in choices else ""
            text = f"{docs.get(f.name, '')} ({kind}, default: {shown}{extra})".replace("%", "%%")
            if hints[f.name] is bool:
                group.add_argument(f"--{sec}.{f.name}", dest=f"cfg:{sec}.{f.name}", metavar="BOOL", default=None,
                                   nargs="?", const="true", action=_BoolOption, help=text)
            else:
                group.add_argument(f"--{sec}.{f.name}", dest=f"cfg:{sec}.{f.name}", metavar=kind.upper(),
                                   default=None, help=text)


class _BoolOption(argparse.Action):
    """A bool option: bare (true) or with a value. A bare flag just before the positional config file
    (``--run.eval_before run.toml``) would take the file as its value: the flag is then true and the file is kept
    as the command's config (``settle_config_file`` puts it back after parsing)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if isinstance(values, str) and values.lower() not in BOOL_WORDS and hasattr(namespace, "config"):
            namespace.spilled_config, values = values, "true"
        setattr(namespace, self.dest, "true" if values is None else values)


def settle_config_file(args: argparse.Namespace) -> argparse.Namespace:
    """After parsing: a config file a bare bool flag took as its value becomes the command's config again."""
    spilled = vars(args).pop("spilled_config", None)
    if spilled is not None:
        if getattr(args, "config", None) is not None:
            raise ConfigError(f"a bool option takes true or false; got {spilled!r} (and the config file is "
                              f"{args.config!r})")
        args.config = spilled
    return args


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg:") and value is not None:
            sec, name = key[4:].split(".", 1)
            out.setdefault(sec, {})[name] = value
    return out


def resolve(config_cls: type, file: str | None, overrides: dict[str, Any], base: dict | None = None) -> Any:
    """defaults <- implied defaults <- base (e.g. a saved run's config) <- file <- command-line overrides.

    Implied defaults (``config_cls.implied_defaults(values)``, e.g. a task's rollout limits) fill what neither the
    file nor the overrides set; a saved run's config (``base``) already holds them and keeps its own values.
    """
    given = merge(load_file(file) if file else {}, overrides)
    values = to_dict(config_cls()) if base is None else base
    values = merge(values, given)
    implied = getattr(config_cls, "implied_defaults", None)
    if base is None and implied is not None:
        for section, defaults in implied(values).items():
            keep = given.get(section, {})
            values = merge(values, {section: {k: v for k, v in defaults.items() if k not in keep}})
    return build(config_cls, values)


def to_toml(config: Any) -> str:
    """The resolved config as TOML (saved with every run; loadable with ``load_file``)."""
    lines = []
    for sec, values in to_dict(config).items():
        lines.append(f"[{sec}]")
        tables = []
        for key, value in values.items():
            if isinstance(value, dict):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, table in tables:
            lines.append(f"[{sec}.{key}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} to TOML")
