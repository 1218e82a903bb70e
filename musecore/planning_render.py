"""Printing a :class:`~musecore.planning.Plan` as tables (rich), for ``print(model.plan)`` and the CLI."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from musecore.planning_mesh import USABLE, MeshPlan


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
    one_fits = plan.memory_bytes <= USABLE * plan.device_memory_bytes
    verdict = "fits" if one_fits else f"does NOT fit: needs {plan.devices_needed} x {plan.device}"
    verdict += " (the mesh below splits it)" if plan.mesh is not None else ""
    console.print(f"memory: {gib(plan.memory_bytes)} (weights + KV cache for {plan.kv_context} tokens) of "
                  f"{gib(plan.device_memory_bytes)} on one {plan.device}: {verdict}")
    if plan.mesh is not None:
        render_mesh(console, plan.mesh, plan.device, "mesh")
    elif plan.proposed_mesh is not None:
        render_mesh(console, plan.proposed_mesh, plan.device, "proposed mesh")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.gaps:
        console.print("GAPS (the plan cannot run as asked):")
        for gap in plan.gaps:
            console.print(f"  - {gap}")
    return buffer.getvalue().rstrip()


def nbytes(n: float) -> str:
    """A byte count of any size, for per-token traffic (``gib`` is for memory)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def launch_hint(mesh: MeshPlan, device: str) -> str:
    """The torchrun line that starts the mesh's ranks."""
    flags = f"--tp {mesh.tp} --ep {mesh.ep}" + (" --sp" if mesh.sp else "")
    if mesh.devices_per_node is None or mesh.nodes == 1:
        return f"torchrun --nproc-per-node {mesh.world} -m musecore generate --device {device} {flags} ..."
    return (f"torchrun --nnodes {mesh.nodes} --nproc-per-node {mesh.devices_per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT -m musecore generate --device {device} {flags} ... (on each node)")


def render_mesh(console: Console, mesh: MeshPlan, device: str, title: str) -> None:
    """The mesh section: ranks and nodes, one rank's memory, and the bytes it sends per token."""
    where = (f"{mesh.world} x {device} on one host" if mesh.devices_per_node is None else
             f"{mesh.world} x {device}, {mesh.nodes} node{'s' if mesh.nodes > 1 else ''} of {mesh.devices_per_node}")
    sp = "sequence-parallel prefill" if mesh.sp else "no sequence parallelism"
    console.print(f"{title}: {mesh.label} over {mesh.world} ranks ({where}), {sp}, MoE dispatch {mesh.moe_dispatch}")
    shared = mesh.devices_per_node is None
    total = f" x {mesh.world} ranks = {gib(mesh.rank_bytes * mesh.world)}" if shared else ""
    usable = "of the host's memory" if shared else f"usable on one {device}"
    console.print(f"  per rank: weights {gib(mesh.weight_bytes)} + KV cache {gib(mesh.kv_bytes)} = "
                  f"{gib(mesh.rank_bytes)}{total} of {gib(mesh.usable_bytes)} {usable}: "
                  f"{'fits' if mesh.fits else 'does NOT fit'}")
    full = " (the model's maximum)" if mesh.max_context == mesh.max_position_embeddings else ""
    console.print(f"  KV cache: {mesh.kv_heads} KV head{'s' if mesh.kv_heads > 1 else ''} per rank "
                  f"({mesh.kv_replication:g}x replication); room for a {mesh.max_context}-token context at batch 1{full}")
    groups = Table(title=f"{title}: weights per rank (the busiest)", title_justify="left")
    for col in ("group", "bytes per rank"):
        groups.add_column(col)
    for group, value in sorted(mesh.weight_bytes_by_group.items()):
        groups.add_row(group, gib(value))
    console.print(groups)
    per_token = mesh.prefill_per_token()
    traffic = Table(title=f"{title}: bytes rank 0 sends per token, by collective", title_justify="left")
    for col in ("collective", "decode (batch 1)", f"prefill ({mesh.prefill_tokens}-token prompt)"):
        traffic.add_column(col)
    for name, value in mesh.decode.items():
        traffic.add_row(name, nbytes(value), nbytes(per_token[name]))
    traffic.add_row("total", nbytes(sum(mesh.decode.values())), nbytes(sum(per_token.values())))
    console.print(traffic)
    for note in mesh.notes:
        console.print(f"  {title} note: {note}")
    console.print(f"  launch: {launch_hint(mesh, device)}")
