"""JSON schemas (draft 2020-12) of every ``--json`` output of ``musecore-quant``: ``inspect``,
``convert`` (also the ``conversion_report.json`` a conversion writes), ``verify`` and ``diff``.

Shipped as package data. Each requires the keys a consumer may rely on and types them; objects may
carry more keys, so a newer musecore-quant adds fields without breaking a reader.

Example::

    from musecore_quant.schemas import load_schema
    jsonschema.validate(json.load(open("out/conversion_report.json")), load_schema("convert"))
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

NAMES = ("inspect", "convert", "verify", "diff")


def load_schema(command: str) -> dict[str, Any]:
    """The schema of ``musecore-quant COMMAND --json``."""
    if command not in NAMES:
        raise ValueError(f"no JSON schema for {command!r}; the commands with --json are {', '.join(NAMES)}")
    return json.loads(files(__package__).joinpath(f"{command}.json").read_text(encoding="utf-8"))
