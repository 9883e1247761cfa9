"""Config files and their errors, for `generate`'s engine YAML as for `serve`'s cluster YAML:
each problem is one line naming the file, the field and what is wrong (pydantic's own report
is multi-line with URLs; a missing file or a YAML syntax error was a traceback)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    pass


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML file holds; ConfigError names the file (and the line of a syntax error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def describe(e: ValidationError, prefix: str = "") -> str:
    """One line per problem: `prefix`, the dotted field path, what is wrong, the value given."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "value_error":  # our validators' messages name their fields
            msg = str(err.get("ctx", {}).get("error", err["msg"]))
        else:
            msg = err["msg"]
        got = err.get("input")
        lines.append(f"{prefix}{loc}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})")
                     if loc else f"{prefix}{msg}")
    return "\n".join(lines)
