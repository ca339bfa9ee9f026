"""Command-line flags: every `llmlab` command that builds an engine gets one flag per
`EngineConfig` field (`add_engine_arguments`, read back by `engine_kwargs`, written out
again by `engine_argv` for a server the command starts), and the small argument types the
commands share (`positive_int`, `int_span`). argparse lives here, so `config.py` stays the
plain dataclass."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing

from llmlab.config import EngineConfig


def positive_int(text: str) -> int:
    """An argparse type for counts that cannot be zero (requests, steps, repeats): argparse
    then names the flag in its error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def int_span(text, flag: str) -> tuple[int, int]:
    """LOW,HIGH from the command line (a range of lengths), or a ValueError naming the flag."""
    parts = str(text).split(",")
    try:
        low, high = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"{flag} must be LOW,HIGH (two integers), got {text!r}") from None
    if not 0 < low <= high:
        raise ValueError(f"{flag} must be LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return low, high


# ---- command-line flags, generated from EngineConfig's fields ---------------------------
# Every `llmlab` command that builds an engine gets the same flags, with vLLM's spelling
# (--max-num-seqs, --enable-prefix-caching / --no-enable-prefix-caching); a new field
# becomes a flag with no edit here. Its help is the comment beside the field.
FLAG_ALIASES = {"tensor_parallel_size": ["-tp", "--tp"], "pipeline_parallel_size": ["-pp", "--pp"]}
# fields a command sets itself, never a flag: `llmlab serve` asks for the server's defaults
NOT_FLAGS = ("usage_context",)


def _field_comments() -> dict[str, str]:
    """{field name: the comment on its line (and on comment-only lines right below)}."""
    try:
        lines = inspect.getsource(EngineConfig).splitlines()
    except (OSError, TypeError):    # no source (a frozen install): flags without help
        return {}
    comments, last = {}, None
    for line in lines:
        if field_line := re.match(r"\s+(\w+): [^#]*?(?:#\s*(.*))?$", line):
            last = field_line.group(1)
            comments[last] = field_line.group(2) or ""
        elif last and (more := re.match(r"\s+#\s*(.*)$", line)):
            comments[last] += " " + more.group(1)
        else:
            last = None
    return comments


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: dict | None = None,
                         exclude: tuple[str, ...] = ()) -> None:
    """Add one flag per EngineConfig field (an argument group "engine"). A flag not given
    leaves its field at EngineConfig's default, or at `defaults[name]` when given (a
    benchmark may want a larger batch); `engine_kwargs(args)` collects what was set."""
    defaults = defaults or {}
    types = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    group = parser.add_argument_group("engine (EngineConfig fields)")
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude + NOT_FLAGS]
    parser.set_defaults(engine_flags=tuple(f.name for f in fields))   # what engine_kwargs reads
    for f in fields:
        default = defaults.get(f.name, f.default)
        kind = next((t for t in typing.get_args(types[f.name]) if t is not type(None)), types[f.name])
        help = comments.get(f.name, "")
        help = f"{help} (default: {default})" if help else f"default: {default}"
        names = [f"--{f.name.replace('_', '-')}", *FLAG_ALIASES.get(f.name, [])]
        # default None: "not given", so engine_kwargs leaves EngineConfig's own default alone
        keep = defaults.get(f.name)
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=keep, help=help.replace("%", "%%"))
        else:
            group.add_argument(*names, dest=f.name, type=kind, default=keep, metavar=kind.__name__.upper(),
                               help=help.replace("%", "%%"))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields set on the command line (or by `add_engine_arguments`'s
    defaults): only flags it added, so a command's own --seed or --model is left alone."""
    return {name: getattr(args, name) for name in getattr(args, "engine_flags", ())
            if getattr(args, name, None) is not None}


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give `engine_kwargs(args)` again: what a command passes on to the
    `llmlab serve` process it starts (["--max-model-len", "256", "--no-enable-prefix-caching"])."""
    argv = []
    for name, value in engine_kwargs(args).items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv
