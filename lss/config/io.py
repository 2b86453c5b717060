"""Reading config sources: YAML files and `--set section.key=value` pairs, and numbers written as
text.

PyYAML follows YAML 1.1, which reads `1.0e-7` and `.inf` as floats but `1e-7`, `1E3` and `inf` as
strings; the config's typed fields therefore read numbers with Python's own `int()` / `float()`
(`read_number`). A key given twice in one mapping is an error (PyYAML would keep the last one
silently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import yaml

from lss.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, with mappings that refuse a key given twice."""

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            if (
                key_node.tag == "tag:yaml.org,2002:merge"
            ):  # `<<: *anchor` entries may be overridden by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if earlier is not None:
                lines = f"lines {earlier} and {line}" if earlier != line else f"line {line}"
                raise ConfigError(f"key {key!r} appears twice in one mapping ({lines}); keep one")
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: what the parser found and where (PyYAML's own message spans several lines)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem is None:
        return " ".join(str(e).split())
    return (
        f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
        if mark is not None
        else problem
    )


def read_yaml_file(path: Union[str, Path]) -> dict:
    """The top-level mapping of the YAML file at `path`; ConfigError if it is missing, empty, not
    YAML or has a key given twice."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config path {path} is a directory: pass a YAML file (e.g. one of configs/*.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for the shipped ones)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}): save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        values = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if values is None:
        raise ConfigError(
            f"config file {path} is empty: expected a mapping of sections, e.g. "
            "'train: {max_steps: 100}'; write {} to keep every default"
        )
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections at the top level")
    return values


def parse_override(item: str) -> dict:
    """`section.key=value` (value in YAML) as the nested mapping {section: {key: value}}."""
    if "=" not in item:
        raise ConfigError(
            f"--set {item!r}: expected section.key=value, e.g. --set train.max_steps=100"
        )
    key, raw = item.split("=", 1)
    try:
        value: Any = yaml.load(raw, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {item!r}: the value is not valid YAML: {_yaml_problem(e)}; quote a string that "
            "holds YAML syntax, write a list as [a, b]"
        ) from None
    except ConfigError as e:
        raise ConfigError(f"--set {item!r}: {e}") from None
    for k in reversed(key.strip().split(".")):
        value = {k: value}
    return value


def read_number(value: Any) -> Optional[Union[int, float]]:
    """`value` as an int or float: YAML numbers as they are, text as Python's int() or float() reads
    it (`1e-7`, `1E3`, `inf`, `1_000`); None when it is not a number (booleans are not numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            try:
                return parse(value)
            except ValueError:
                pass
    return None
