"""Loading a config: dataclass defaults (the LSS paper recipe, lss.config.schema), overridden by
YAML, then by `--set` pairs.

Unknown keys, wrong types and values outside a `Literal[...]` are errors that name the key, where it
came from and what is allowed; `validate` (lss.config.validation) then checks ranges and cross-field
rules (of the device or the data where known).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from lss.config.io import parse_override, read_number, read_yaml_file
from lss.config.schema import Config
from lss.config.validation import validate
from lss.errors import ConfigError


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true/false"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _allowed(values: tuple) -> str:
    return ", ".join(repr(v) for v in values)


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if isinstance(value, bool) or value not in args:
            raise ConfigError(f"{where}={value!r}: expected one of {_allowed(args)}")
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner:  # the first type that takes the value
            try:
                return _convert(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(
            f"{where}={value!r}: expected "
            + " or ".join(
                _type_name(a)
                if typing.get_origin(a) is not Literal
                else _allowed(typing.get_args(a))
                for a in inner
            )
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: expected a mapping for section {tp.__name__}, got {value!r}"
            )
        return _merge(tp(), value, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(
                    f"{where}: expected {len(args)} values, got {len(value)}: {value!r}"
                )
            return tuple(
                _convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))
            )
        elem = args[0] if args else Any
        if typing.get_origin(elem) is Literal:
            unknown = [v for v in value if isinstance(v, bool) or v not in typing.get_args(elem)]
            if unknown:
                noun = where.rsplit(".", 1)[-1].removesuffix("s")  # model.heads -> "head"
                raise ConfigError(
                    f"{where}={list(value)!r}: unknown {noun}(s) {unknown}; expected values from "
                    f"{_allowed(typing.get_args(elem))}"
                )
        out = [_convert(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        number = read_number(value)
        if isinstance(number, float) and number.is_integer():
            number = int(number)  # 1e3 or 1000.0 written for a count
        if isinstance(number, int):
            return number
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = read_number(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if number != number:
            raise ConfigError(f"{where}: expected a number (not NaN), got {value!r}")
        return float(number)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def _merge(obj: Any, values: dict, where: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    allowed = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        if key not in allowed:
            raise ConfigError(
                f"{where or 'top level'}: unknown key '{key}'. Allowed keys: {', '.join(allowed)}"
            )
        path = f"{where}.{key}" if where else key
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            # a later source overrides single keys, keeping the section's other values
            _merge(current, value, path)
        else:
            setattr(obj, key, _convert(value, hints[key], path))
    return obj


def load_config(
    path: Optional[Union[str, Path]] = None, overrides: typing.Sequence[str] = ()
) -> Config:
    """Defaults, then the YAML file at `path`, then `overrides` ("section.key=value", value parsed
    as YAML)."""
    cfg = Config()
    if path is not None:
        values = read_yaml_file(path)
        try:
            _merge(cfg, values, "")
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    return validate(_apply_overrides(cfg, overrides))


def _apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`overrides` ("section.key=value", value parsed as YAML) merged into `cfg` in order."""
    for item in overrides:
        nested = parse_override(item)
        try:
            _merge(cfg, nested, "")
        except ConfigError as e:
            raise ConfigError(f"--set {item}: {e}") from None
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """Plain dict (tuples as lists) suitable for YAML/JSON."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def config_from_dict(values: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """The config of `values` (as config_to_dict writes it), then `overrides` applied."""
    return validate(_apply_overrides(_merge(Config(), values, "config"), overrides))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: Union[str, Path]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dump_config(cfg))
    tmp.replace(path)
