"""Printing a :class:`~musecore.planning.Plan` as tables (rich), for ``print(model.plan)`` and the CLI."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def render_text(plan, width: int = 140) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=False, color_system=None, markup=False, highlight=False)
    p = plan.profile
    console.print(f"plan: {plan.model} on {plan.device} ({p.description}) via backend {plan.backend!r}, "
                  f"mode {plan.mode}, checkpoint {plan.checkpoint_format}")
    console.print(f"model: {count(plan.parameters)} parameters, {count(plan.active_parameters)} active per token "
                  "(text decoder, from config.json)")
    groups = Table(title="weights", title_justify="left")
    for col in ("group", "tensors", "params", "checkpoint", "in memory", "activations", "action", "bytes"):
        groups.add_column(col)
    for g in plan.groups:
        groups.add_row(g.group, str(g.tensors), f"{g.parameters / 1e6:.2f}M", g.source_format, g.target_format,
                       g.act_format or "16-bit", g.action + (f" ({g.note})" if g.note and g.action != "keep" else ""),
                       gib(g.bytes))
    console.print(groups)
    ops = Table(title="ops", title_justify="left")
    for col in ("op", "weights", "implementation", "tier", "reason"):
        ops.add_column(col)
    for o in plan.ops:
        weights = f"{o.weight_format}/{o.act_format or 'a16'}" if o.weight_format else ""
        ops.add_row(o.op, weights, o.implementation or "-", o.tier, o.reason)
    console.print(ops)
    if plan.kernels:
        kernels = Table(title=f"kernels ({plan.backend})",
                        title_justify="left")
        for col in ("decision", "choice", "reason", "env override"):
            kernels.add_column(col)
        for k in plan.kernels:
            kernels.add_row(k.what, k.choice, k.reason, k.env or "-")
        console.print(kernels)
    verdict = "fits" if plan.fits else f"does NOT fit: needs {plan.devices_needed} x {plan.device}"
    console.print(f"memory: {gib(plan.memory_bytes)} (weights + KV cache for {plan.kv_context} tokens) of "
                  f"{gib(plan.device_memory_bytes)} on one {plan.device}: {verdict}")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.gaps:
        console.print("GAPS (the plan cannot run as asked):")
        for gap in plan.gaps:
            console.print(f"  - {gap}")
    return buffer.getvalue().rstrip()
