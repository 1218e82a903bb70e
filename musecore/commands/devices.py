"""``musecore devices``: the catalog of named targets, their backends, memory and number formats."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="list the device catalog")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from musecore.devices import CATALOG

    if args.json:
        print(json.dumps([p.to_dict() for p in CATALOG.values()], indent=2))
        return 0
    from rich.table import Table

    from musecore.console import data_console

    table = Table(title="musecore devices")
    for col in ("device", "backend", "arch", "memory", "weights", "activations", "NVFP4 checkpoint", "BF16 checkpoint"):
        table.add_column(col)
    for p in CATALOG.values():
        nv, bf = p.conversion("nvfp4"), p.conversion("bf16")
        table.add_row(p.name, p.backend, p.arch, f"{p.memory_gib:g} GiB" if p.memory_gib else "host",
                      ", ".join(p.weight_formats), ", ".join(p.activation_formats) or "16-bit",
                      f"{nv.action('nvfp4')}, {_bits(nv)}",
                      bf.action("bf16"))
    data_console().print(table)
    return 0


BITS = {"nvfp4": 4, "mxfp4": 4, "int4": 4, "fp8": 8, "int8": 8, None: 16}


def _bits(conversion) -> str:
    """``W4A16``-style: the weights' and the activations' bits as loading leaves them (``BF16`` when dequantized)."""
    if conversion.target in ("bf16", "fp16", "fp32"):
        return conversion.target.upper()
    act = conversion.act_format.split("-")[0] if conversion.act_format else None  # ("fp8-token": per-token scales)
    return f"W{BITS.get(conversion.target, '?')}A{BITS.get(act, '?')}"
