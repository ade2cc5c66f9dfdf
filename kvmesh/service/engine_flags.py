"""Command-line flags and `KVMESH_*` environment variables generated from EngineConfig's fields.

Every field is one flag: vLLM's name where vLLM has the setting (`--kv-cache-dtype`,
`--gpu-memory-utilization`), else `--field-name`, with older names kept as aliases. Help text and
choices come from the field's metadata and the default from the field itself, so each default is
written once (in `kvmesh.engine.config`). Booleans are `--flag/--no-flag`.

`KVMESH_<FLAG>` (the main flag's name, upper case, `-` as `_`: `KVMESH_BLOCK_SIZE=32`) sets a
flag's default; the command line wins. Values are checked against EngineConfig's own validation
as soon as the options are parsed, so a bad value is an error naming its flag or variable.
Importing this module imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.memory.planner import parse_bytes

# field -> (main flag, aliases...); a field not listed is `--field-name`.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "kv_dtype": ("--kv-cache-dtype", "--kv-dtype"),
    "memory_utilization": ("--gpu-memory-utilization", "--memory-utilization"),
}
NEGATIVE_ALIASES = {"enable_chunked_prefill": "--no-chunked-prefill"}  # store False
SIZE_FIELDS = ("kv_cache_memory",)  # parse_bytes: 512MiB, 2GiB = 2Gi = 2 × 2**30, 2GB = 2G = 2e9
KIND_NAMES = {"int": "an integer", "float": "a number", "str": ""}
ENV_PREFIX = "KVMESH_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}")


# kind -> parser; a "size" is parsed by `parse_bytes`, given the flag's name (EngineFlag.convert)
PARSERS: dict[str, Callable[[str], Any]] = {
    "bool": parse_bool, "int": int, "float": float, "str": str,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    """The flag of one EngineConfig field."""

    field: str
    flags: tuple[str, ...]  # main flag first
    kind: str  # "bool", "int", "float", "size" or "str"
    default: Any
    help: str
    choices: tuple[str, ...] | None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flags[0].removeprefix("--").upper().replace("-", "_")

    @property
    def metavar(self) -> str:
        return self.flags[0].removeprefix("--").upper().replace("-", "_")

    def convert(self, text: str) -> Any:
        """The value of a command-line or environment string (ValueError when invalid)."""
        if self.kind == "size":  # kvmesh.memory.planner's rule; the message names the flag
            return parse_bytes(text, self.flags[0])
        try:
            value = PARSERS[self.kind](text)
        except ValueError:
            if self.kind == "bool":
                raise
            raise ValueError(f"not {KIND_NAMES[self.kind]}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)}; got {value!r}")
        return value

    def argv(self, value: Any) -> list[str]:
        """Command-line words that set `value`."""
        if self.kind == "bool":
            return [self.flags[0] if value else "--no-" + self.flags[0].removeprefix("--")]
        return [self.flags[0], str(value)]


def engine_flags(exclude: Collection[str] = ()) -> list[EngineFlag]:
    """One EngineFlag per EngineConfig field (in field order), except `exclude`."""
    result = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude:
            continue
        base = str(f.type).replace(" | None", "")
        kind = "size" if f.name in SIZE_FIELDS else base
        if kind not in ("bool", "int", "float", "size", "str"):
            raise TypeError(f"EngineConfig.{f.name}: no flag type for {f.type}")
        flags = FLAG_NAMES.get(f.name, ("--" + f.name.replace("_", "-"),))
        choices = f.metadata.get("choices")
        result.append(EngineFlag(f.name, flags, kind, f.default, f.metadata["help"], choices))
    return result


def add_engine_flags(
    parser: argparse.ArgumentParser, flags: list[EngineFlag], *, omit_defaults: bool = False
) -> None:
    """Add `flags` to `parser` (dest = the field name). With `omit_defaults`, a flag not given
    is absent from the parsed namespace (`kvmesh up` passes on only what was set)."""
    for flag in flags:
        default = argparse.SUPPRESS if omit_defaults else flag.default
        text = f"{flag.help} (default {flag.default}; env {flag.env})"
        if flag.kind == "bool":
            parser.add_argument(
                *flag.flags, dest=flag.field, action=argparse.BooleanOptionalAction,
                default=default, help=text,
            )  # fmt: skip
        else:
            parser.add_argument(
                *flag.flags, dest=flag.field, type=_typed(flag), choices=flag.choices,
                default=default, help=text, metavar=None if flag.choices else flag.metavar,
            )  # fmt: skip
        if flag.field in NEGATIVE_ALIASES:
            parser.add_argument(
                NEGATIVE_ALIASES[flag.field], dest=flag.field, action="store_false",
                default=default, help=f"same as --no-{flag.flags[0].removeprefix('--')}",
            )  # fmt: skip


def _typed(flag: EngineFlag) -> Callable[[str], Any]:
    """argparse's `type` (its __name__ shows in argparse's "invalid ... value" error)."""
    if flag.kind != "size":
        return PARSERS[flag.kind]

    def size(text: str) -> int:
        return flag.convert(text)

    return size


def env_values(flags: list[EngineFlag], environ: Mapping[str, str]) -> dict[str, Any]:
    """Field -> value of each `KVMESH_<FLAG>` set in `environ` (ValueError naming the
    variable when one is invalid)."""
    values = {}
    for flag in flags:
        text = environ.get(flag.env)
        if text is None:
            continue
        try:
            values[flag.field] = flag.convert(text)
            _validate({flag.field: values[flag.field]})
        except ValueError as exc:
            raise ValueError(f"environment variable {flag.env}={text!r}: {_reason(exc)}") from None
    return values


def validate(values: Mapping[str, Any], flags: list[EngineFlag]) -> None:
    """Check `values` (field -> value) as EngineConfig does; ValueError naming the flag."""
    for flag in flags:
        if flag.field in values:
            try:
                _validate({flag.field: values[flag.field]})
            except InvalidParameterError as exc:
                raise ValueError(f"{flag.flags[0]}: {exc.message}") from None
    _validate(values)  # a combination no single value explains names its field


def apply_env(
    parser: argparse.ArgumentParser, flags: list[EngineFlag], environ: Mapping[str, str]
) -> None:
    """Make each set `KVMESH_<FLAG>` the default of its flag; an invalid value exits with an
    error naming the variable (argparse's `parser.error`)."""
    try:
        parser.set_defaults(**env_values(flags, environ))
    except ValueError as exc:
        parser.error(str(exc))


def check_values(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flags: list[EngineFlag]
) -> None:
    """Validate the parsed engine values as EngineConfig does; exit naming the bad flag."""
    try:
        validate(engine_values(args, flags), flags)
    except ValueError as exc:
        parser.error(str(exc))


def engine_values(args: argparse.Namespace, flags: list[EngineFlag]) -> dict[str, Any]:
    """EngineConfig keyword arguments of the flags present in `args`."""
    return {f.field: getattr(args, f.field) for f in flags if hasattr(args, f.field)}


def engine_argv(values: Mapping[str, Any], flags: list[EngineFlag]) -> list[str]:
    """Command-line words of `kvmesh serve ROLE` that set `values` (field -> value)."""
    by_field = {f.field: f for f in flags}
    return [
        word
        for name, value in values.items()
        if value is not None
        for word in by_field[name].argv(value)
    ]


def _validate(values: Mapping[str, Any]) -> None:
    EngineConfig(**{k: v for k, v in values.items() if k != "model"})


def _reason(exc: Exception) -> str:
    return exc.message if isinstance(exc, InvalidParameterError) else str(exc)
