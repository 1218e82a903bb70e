"""Typed access to the fields of producers' quantization configs.

A config is JSON a user (or a buggy exporter) wrote: any field can hold any JSON type. Reading
``qc.get("exclude")`` and iterating it as strings turns a wrong type into an ``AttributeError``
far from the file; these accessors check the type where the field is read and raise a
``CheckpointError`` naming the file, the field, what it holds and what was expected.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import CheckpointError

_MISSING = object()


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def bad_field(source: Path, field: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{source}: {field} is {_describe(value)}, expected {expected}; fix the quantization "
                           "config or re-export the checkpoint", path=source)


def get_object(d: Mapping[str, Any], key: str, source: Path, field: str) -> Optional[dict[str, Any]]:
    """``d[key]`` as a JSON object, or None when absent or null."""
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_field(source, field, value, "an object")
    return value


def get_str(d: Mapping[str, Any], key: str, source: Path, field: str, default: Any = None) -> Any:
    """``d[key]`` as a string, or ``default`` when absent or null."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_field(source, field, value, "a string")
    return value


def get_int(d: Mapping[str, Any], key: str, source: Path, field: str, default: Any = None) -> Any:
    """``d[key]`` as an integer (not a bool), or ``default`` when absent or null."""
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(source, field, value, "an integer")
    return value


def get_patterns(d: Mapping[str, Any], key: str, source: Path, field: str) -> list[str]:
    """A list of module names / fnmatch wildcards / ``re:`` regexes (each regex compiled once to check it)."""
    value = d.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise bad_field(source, field, value, "a list of module names or patterns")
    for p in value:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except (re.error, RecursionError, OverflowError) as e:
                raise CheckpointError(f"{source}: {field} holds the invalid regular expression {p!r} ({e}); fix it",
                                      path=source) from e
    return list(value)
