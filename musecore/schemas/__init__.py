"""JSON schemas (draft 2020-12) of every ``--json`` output of the ``musecore`` command line.

One file per command, shipped as package data: ``plan``, ``devices``, ``doctor``, ``bench``,
``matrix``, ``generate``. ``musecore-quant``'s outputs have their own in ``musecore_quant.schemas``.
Each schema requires the keys a consumer may rely on and types them; objects may carry more keys
(a newer musecore adds fields without breaking a reader), and fields still settling (the plan's
``mesh``) are optional.

Example::

    import jsonschema, json, subprocess
    from musecore.schemas import load_schema
    plan = json.loads(subprocess.check_output(["musecore", "plan", "--json"]))
    jsonschema.validate(plan, load_schema("plan"))
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

NAMES = ("plan", "devices", "doctor", "bench", "matrix", "generate", "calibrate")


def load_schema(command: str) -> dict[str, Any]:
    """The schema of ``musecore COMMAND --json``."""
    if command not in NAMES:
        raise ValueError(f"no JSON schema for {command!r}; the commands with --json are {', '.join(NAMES)}")
    return json.loads(files(__package__).joinpath(f"{command}.json").read_text(encoding="utf-8"))
