"""The plan of a model split over ranks: per-rank memory, the mesh to propose, and the bytes each collective moves.

A :class:`~musecore.distributed.Mesh` decides which piece of each tensor a rank keeps
(:func:`~musecore.distributed.tensor_piece`) and which KV heads it caches
(:func:`~musecore.distributed.head_shard`). This module turns that into numbers without hardware:
each rank's weight bytes (the backend's resident bytes of its pieces), its KV cache, whether it fits,
the mesh to propose when one device is too small (:func:`propose_mesh`), and the bytes one rank
sends through each collective of :class:`~musecore.distributed.Comm`'s schedule per forward
(:func:`collective_bytes`), which is what ``Comm.traffic`` counts on a real run.

Example::

    from musecore.config import MuseConfig
    from musecore.distributed import Mesh
    collective_bytes(MuseConfig.from_name("muse-tiny"), Mesh(tp=2, ep=2), tokens=1, dtype_bytes=2)
    # -> {'all_reduce': 0, 'all_gather': 14336, 'reduce_scatter': 0, 'all_to_all': 13152}  (one decode token)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional

from musecore_quant.formats.facts import bytes_per_value

from musecore.distributed import (Mesh, head_shard, keeps_expert, piece_shape, replicated_moe_limit, tensor_piece,
                                  token_chunk)
from musecore.names import TOWERS, expert_key, weight_group

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
USABLE = 0.9  # the share of a device's memory the plan lets weights and KV cache take (Plan.fits)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Devices per node (one host, one torchrun --nnodes entry) by catalog name; a profile attribute
# ``devices_per_node`` wins. GB200/GB300 compute trays hold 4 GPUs; TPU hosts 4 chips unless the profile says.
DEVICES_PER_NODE = {"h200": 8, "h100": 8, "b200": 8, "b300": 8, "mi355x": 8, "mi350x": 8, "mi300x": 8,
                    "gb200": 4, "gb300": 4}
ONE_HOST_BACKENDS = ("xeon", "reference")  # CPU ranks are processes on one host: they share its memory
LARGEST_PROPOSAL = 1024


def devices_per_node(profile: Any) -> Optional[int]:
    """How many devices one node of ``profile`` holds; None where every rank runs on the one host (CPU)."""
    own = getattr(profile, "devices_per_node", None)
    if own:
        return int(own)
    if profile.backend in ONE_HOST_BACKENDS:
        return None
    if profile.name in DEVICES_PER_NODE:
        return DEVICES_PER_NODE[profile.name]
    return 4 if profile.backend == "tpu" else 8


def mesh_label(mesh: Mesh) -> str:
    return f"TP{mesh.tp}/EP{mesh.ep}" + ("/SP" if mesh.sp else "")


def mesh_choices(config: Any, largest: int = LARGEST_PROPOSAL) -> str:
    """What to pass instead of a mesh that cannot split ``config``: the tp and ep values that can."""
    tps = [t for t in range(1, min(config.num_attention_heads, largest) + 1) if not Mesh(t, 1).problems(config)]
    eps = [e for e in range(1, min(config.num_local_experts, largest) + 1) if config.num_local_experts % e == 0]
    return (f"this model splits with tp in {{{', '.join(map(str, tps))}}} (1 or the number of ranks) and ep in "
            f"{{{', '.join(map(str, eps))}}} dividing the number of ranks; sp needs tp > 1")


# -- the bytes each collective moves ---------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveStep:
    """One ``Comm`` call of the schedule: ``times`` calls per forward, each sending ``rows x cols`` values
    of ``itemsize`` bytes from this rank (``rows`` may be an expectation: see :func:`collective_steps`)."""

    collective: str
    what: str
    rows: Fraction
    cols: int
    itemsize: int
    times: int

    @property
    def bytes(self) -> Fraction:
        return self.rows * self.cols * self.itemsize * self.times


def _shard_size(n: int, world: int, rank: int) -> int:
    start, stop = token_chunk(n, world, rank)
    return stop - start


def sequence_parallel(mesh: Mesh, tokens: int, batch: int = 1) -> bool:
    """Whether a forward of ``batch`` x ``tokens`` runs sequence parallel: a prefill (``tokens > 1``) of at
    least one token per rank, with ``mesh.sp`` (``MuseModel.forward``'s rule); never at decode."""
    return mesh.sp and tokens > 1 and batch * tokens >= mesh.world


def collective_steps(config: Any, mesh: Mesh, tokens: int, dtype_bytes: int, batch: int = 1, *,
                     rank: int = 0) -> list[CollectiveStep]:
    """The collective calls of one forward of ``batch`` sequences of ``tokens`` tokens, as rank ``rank`` makes them.

    The schedule of :mod:`musecore.distributed` as :class:`~musecore.model.MuseModel` runs it, each
    step sized as ``Comm`` counts it (the whole send buffer, padding included): ``N = batch * tokens``
    tokens, ``c = ceil(N / world)`` per token shard, ``n_r`` this rank's share
    (:func:`~musecore.distributed.token_chunk`); model-dtype activations unless a step says fp32 or
    int32. Sequence parallelism follows :func:`sequence_parallel`. With ``tp == 1`` attention,
    pooler, unpooler and lm_head are replicated: only the experts' dispatch/combine and the gather of
    their sums cross ranks.

    The dispatch sends all ``n_r * k`` routed rows of this rank's tokens (``Comm`` counts the rows a
    rank keeps for its own experts too, so this step does not depend on the routing); the combine
    sends back the rows this rank received, which does: that step is the expectation under uniform
    routing (each of the ``ep`` ranks of a replica group gets ``1/ep`` of the group's rows). Summed
    over all ranks the combine is exact whatever the routing (``N * k`` rows).
    """
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be >= 1, got tokens={tokens}, batch={batch}")
    W, tp, ep = mesh.world, mesh.tp, mesh.ep
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} is outside the mesh's {W} ranks")
    H, h, V, k = config.hidden_size, config.moe_hidden_size, config.vocab_size, config.num_experts_per_tok
    L, q_width, inter = config.num_hidden_layers, config.num_attention_heads * config.head_dim, config.intermediate_size
    sparse = sum(1 for i in range(L) if config.is_sparse(i))
    dense = L - sparse
    n = batch * tokens
    c = -(-n // W)
    mine = _shard_size(n, W, rank)
    base = (rank // ep) * ep  # the replica group this rank dispatches within (Comm.dispatch_combine)
    received = Fraction(sum(_shard_size(n, W, s) for s in range(base, base + ep)) * k, ep)
    sp, dt = sequence_parallel(mesh, tokens, batch), dtype_bytes
    steps: list[CollectiveStep] = []

    def add(collective: str, what: str, rows: Any, cols: int, itemsize: int, times: int) -> None:
        if times:
            steps.append(CollectiveStep(collective, what, Fraction(rows), cols, itemsize, times))

    def gathered_linear(what: str, in_width: int, times: int) -> None:  # model.gathered_linear
        add("all_gather", f"gather_cols: {what} input columns [N, {in_width // tp}]", n, in_width // tp, dt, times)
        if sp:
            add("all_to_all", f"cols_to_tokens: {what} output columns -> token shards [N, H/tp]", n, H // tp, dt, times)
        else:
            add("all_gather", f"gather_cols: {what} output columns [N, H/tp]", n, H // tp, dt, times)

    if W == 1:
        return steps
    if tp > 1:  # attention: heads split; o_proj by output rows (Attention.__call__)
        if sp:
            add("all_gather", "gather_tokens: a layer's normed input before QKV [c, H]", c, H, dt, L)
        gathered_linear("o_proj", q_width, L)
    # MoE layers (MoE.parallel)
    if not sp and n <= replicated_moe_limit():  # Comm.combine_replicated: every token everywhere, one all-reduce
        if tp > 1:
            add("all_gather", "gather_cols: pooler output columns [N, h/tp]", n, h // tp, dt, sparse)
        add("all_reduce", "combine_replicated: every slot's expert output, fp32 [N*k, h]", n * k, h, 4, sparse)
        if tp > 1:
            add("all_gather", "gather_cols: unpooler output columns [N, H/tp]", n, H // tp, dt, sparse)
    else:
        moe_all_to_all(add, sp, tp, n, c, mine, received, h, H, k, dt, sparse)
    if tp > 1:
        # dense-MLP layers (DenseMLP.__call__): gate/up by rows, the activation gathered, down by output rows
        if sp:
            add("all_gather", "gather_tokens: the dense MLP input [c, H]", c, H, dt, dense)
        gathered_linear("dense down_proj", inter, dense)
        if sp:  # MuseModel.forward
            add("all_gather", "gather_tokens: the final norm's output before lm_head [c, H]", c, H, dt, 1)
        add("all_gather", "gather_cols: logits by vocabulary, fp32 [N, V/tp]", n, V // tp, 4, 1)
    return steps


def moe_all_to_all(add: Callable[..., None], sp: bool, tp: int, n: int, c: int, mine: int, received: Fraction,
                   h: int, H: int, k: int, dt: int, sparse: int) -> None:
    """The MoE layers' steps on the all-to-all path (``Comm.dispatch_combine``)."""
    if sp:
        add("all_gather", "gather_tokens: the MoE input for the column-split pooler [c, H]", c, H, dt, sparse)
    if tp > 1:
        add("all_to_all", "cols_to_tokens: pooler output columns -> token shards [N, h/tp]", n, h // tp, dt, sparse)
    add("all_to_all", "dispatch: routed rows of this rank's tokens [n_r*k, h]", mine * k, h, dt, sparse)
    add("all_to_all", "dispatch: their local expert ids, int32 [n_r*k]", mine * k, 1, 4, sparse)
    add("all_to_all", "combine: expert outputs back to the tokens' ranks, fp32 [rows received, h] "
        "(expected, uniform routing)", received, h, 4, sparse)
    add("all_gather", "gather_tokens: the weighted expert sums [c, h]", c, h, dt, sparse)
    if tp > 1:
        if sp:
            add("all_to_all", "cols_to_tokens: unpooler output columns -> token shards [N, H/tp]", n, H // tp, dt,
                sparse)
        else:
            add("all_gather", "gather_cols: unpooler output columns [N, H/tp]", n, H // tp, dt, sparse)


def collective_bytes(config: Any, mesh: Mesh, tokens: int, dtype_bytes: int, batch: int = 1, *,
                     rank: int = 0) -> dict[str, int]:
    """Bytes rank ``rank`` sends through each collective in one forward of ``batch`` x ``tokens`` tokens.

    Every name of :data:`COLLECTIVES` is a key (0 when unused); compare with ``Comm.traffic`` as
    ``{name: traffic.get(name, 0) for name in COLLECTIVES}``. Rank 0, the default, holds the largest
    token shard: it is the busiest rank. All steps are exact except the combine's share of
    ``all_to_all`` (an expectation under uniform routing; :func:`collective_steps`);
    :func:`collective_bytes_total` is exact for any routing.

    Example::

        collective_bytes(config, Mesh(tp=8, ep=8), tokens=1, dtype_bytes=2)  # one decode token, batch 1
    """
    out = dict.fromkeys(COLLECTIVES, Fraction(0))
    for step in collective_steps(config, mesh, tokens, dtype_bytes, batch, rank=rank):
        out[step.collective] += step.bytes
    return {name: round(value) for name, value in out.items()}


def collective_bytes_total(config: Any, mesh: Mesh, tokens: int, dtype_bytes: int, batch: int = 1) -> dict[str, int]:
    """:func:`collective_bytes` summed over every rank: exact whatever the routing."""
    out = dict.fromkeys(COLLECTIVES, Fraction(0))
    for rank in range(mesh.world):
        for step in collective_steps(config, mesh, tokens, dtype_bytes, batch, rank=rank):
            out[step.collective] += step.bytes
    assert all(v.denominator == 1 for v in out.values()), out  # the combine's expectations sum to N*k rows
    return {name: int(value) for name, value in out.items()}


# -- what each rank keeps --------------------------------------------------------------------------

def kv_bytes_per_rank(config: Any, mesh: Mesh, context: int, kv_format: str) -> tuple[int, int]:
    """``(KV heads one rank caches, its KV bytes for context tokens at batch 1)``: every KV head when
    ``tp == 1`` (attention replicated), else the busiest rank's :func:`~musecore.distributed.head_shard`."""
    heads = (config.num_key_value_heads if mesh.tp == 1 else
             max(len(head_shard(config, mesh.tp, r).kv_heads) for r in range(mesh.tp)))
    return heads, kv_bytes_for_heads(config, context, kv_format, heads)


def kv_bytes_for_heads(config: Any, context: int, kv_format: str, heads: int) -> int:
    per_token_layer = int(2 * heads * config.head_dim * bytes_per_value(kv_format))
    return sum(per_token_layer * (min(context, config.sliding_window) if t == "sliding_attention" else context)
               for t in config.layer_types)


def max_context(config: Any, heads: int, kv_format: str, room: int) -> int:
    """The longest context (batch 1) whose KV cache of ``heads`` heads fits in ``room`` bytes (0 if none)."""
    if room <= 0:
        return 0
    lo, hi = 0, config.max_position_embeddings
    while lo < hi:  # kv bytes grow with the context: the last length that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if kv_bytes_for_heads(config, mid, kv_format, heads) <= room else (lo, mid - 1)
    return lo


Targets = dict[str, tuple[str, Optional[str]]]       # tensor -> (in-memory format, activation format)
ResidentBytes = Callable[[str, str, tuple[int, ...]], int]  # (tensor, format, shape) -> bytes (Resident.bytes)


def rank_weight_bytes(config: Any, shapes: dict[str, tuple[int, ...]], targets: Targets, mesh: Mesh, rank: int,
                      resident_bytes: ResidentBytes) -> dict[str, int]:
    """Rank ``rank``'s weight bytes per weight group: each tensor's piece in its in-memory format."""
    out: dict[str, int] = {}
    for name, shape in shapes.items():
        group = weight_group(name, config)[0]
        if group == TOWERS or name not in targets:
            continue
        if expert_key(name) is not None and not keeps_expert(name, config, mesh, rank):
            continue
        piece = piece_shape(shape, tensor_piece(name, config, mesh, rank))
        out[group] = out.get(group, 0) + resident_bytes(name, targets[name][0], piece)
    return out


@dataclass
class MeshPlan:
    """A mesh and what it means for one device kind: per-rank memory (the busiest rank) and traffic."""

    tp: int
    ep: int
    sp: bool
    world: int
    devices_per_node: Optional[int]  # None: every rank on one host, sharing its memory (CPU)
    nodes: int
    weight_bytes: int                # the busiest rank's
    weight_bytes_by_group: dict[str, int]
    kv_heads: int                    # KV heads one rank caches
    kv_replication: float            # copies of each KV head over the ranks (1.0: no KV head is held twice)
    kv_bytes: int                    # one rank's KV cache for kv_context tokens at batch 1
    kv_context: int
    usable_bytes: int                # what one rank may use (90% of a device; of the host where ranks share it)
    max_context: int                 # the longest batch-1 context whose KV cache still fits beside the weights
    max_position_embeddings: int
    dtype_bytes: int
    decode: dict[str, int]           # bytes rank 0 sends per decode token (batch 1), by collective
    prefill_tokens: int
    prefill: dict[str, int]          # bytes rank 0 sends for one prefill of prefill_tokens (kv_context) tokens
    moe_dispatch: str = field(default_factory=lambda: (
        f"one all-reduce up to {replicated_moe_limit()} tokens (decode), all-to-all of the routed rows above "
        "and in sequence-parallel prefill"))
    notes: list[str] = field(default_factory=list)

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.tp, self.ep, self.sp)

    @property
    def label(self) -> str:
        return mesh_label(self.mesh)

    @property
    def rank_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        shared = self.devices_per_node is None
        return (self.rank_bytes * (self.world if shared else 1)) <= self.usable_bytes

    def prefill_per_token(self) -> dict[str, float]:
        return {name: value / self.prefill_tokens for name, value in self.prefill.items()}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(label=self.label, rank_bytes=self.rank_bytes, fits=self.fits,
                    prefill_per_token=self.prefill_per_token())
        return data


def plan_mesh(config: Any, shapes: dict[str, tuple[int, ...]], targets: Targets, mesh: Mesh, profile: Any,
              resident_bytes: ResidentBytes, *, kv_format: str, kv_context: int, dtype_label: str,
              device_memory_bytes: int) -> MeshPlan:
    """What ``mesh`` means on ``profile``'s devices (``mesh`` already checked against ``config``); the
    prefill traffic is for a prompt of ``kv_context`` tokens."""
    per_node = devices_per_node(profile)
    by_rank = [rank_weight_bytes(config, shapes, targets, mesh, r, resident_bytes) for r in range(mesh.world)]
    busiest = max(by_rank, key=lambda groups: sum(groups.values()))
    heads, kv = kv_bytes_per_rank(config, mesh, kv_context, kv_format)
    nkv = config.num_key_value_heads
    replication = (mesh.world * heads if mesh.tp == 1 else mesh.tp * heads) / nkv
    usable = int(USABLE * device_memory_bytes)
    dt = DTYPE_BYTES[dtype_label]
    room = usable // (mesh.world if per_node is None else 1) - sum(busiest.values())
    prefill = max(1, kv_context)
    result = MeshPlan(mesh.tp, mesh.ep, mesh.sp, mesh.world, per_node,
                      1 if per_node is None else -(-mesh.world // per_node), sum(busiest.values()), busiest, heads,
                      replication, kv, kv_context, usable, max_context(config, heads, kv_format, room),
                      config.max_position_embeddings, dt,
                      collective_bytes(config, mesh, 1, dt), prefill, collective_bytes(config, mesh, prefill, dt))
    if mesh.tp == 1:
        result.notes.append(f"tp=1: attention, pooler/unpooler and lm_head are replicated, every rank caches all "
                            f"{nkv} KV heads ({replication:g}x the KV cache over the {mesh.world} ranks)")
    elif replication > 1:
        why = "exceeds" if mesh.tp > nkv else "does not divide"
        result.notes.append(f"tp={mesh.tp} {why} the {nkv} KV heads: each rank caches {heads} KV head(s), "
                            f"{replication:g}x the KV cache of one device over the {mesh.tp} ranks")
    if per_node is None:
        result.notes.append(f"{profile.name}: every rank is a process on one host and shares its memory: "
                            "the ranks' bytes together must fit")
    result.notes.append(f"all_to_all counts every routed row a rank dispatches, the ones it keeps for its own experts "
                        f"too (as Comm does); under uniform routing {mesh.ep - 1}/{mesh.ep} of them leave the rank. "
                        "The combine's bytes are that expectation")
    return result


# -- a mesh for a model that does not fit ----------------------------------------------------------

def candidate_meshes(config: Any, world: int) -> list[Mesh]:
    """Meshes of ``world`` ranks in the order the plan prefers them: TP=EP=world (the recipes' shape), then
    the widest expert split that divides the experts, then experts split with attention replicated."""
    out = [Mesh(world, world)]
    ep = max(e for e in range(1, world + 1) if world % e == 0 and config.num_local_experts % e == 0)
    out += [Mesh(world, ep), Mesh(1, world)]
    return [m for i, m in enumerate(out) if m not in out[:i] and not m.problems(config)]


PROPOSAL_WEIGHT_SHARE = 0.75  # a proposed mesh keeps each rank's weights within 75% of its device


def propose_mesh(fit: Callable[[Mesh], MeshPlan], config: Any, total_bytes: int, device_memory_bytes: int,
                 largest: int = LARGEST_PROPOSAL) -> tuple[Optional[MeshPlan], list[str]]:
    """The smallest power-of-two world whose mesh fits with headroom (``fit(mesh)`` plans one), and why
    others were passed over.

    Headroom: every rank fits (weights + the plan's KV context within 90% of a device) *and* its weights
    take at most :data:`PROPOSAL_WEIGHT_SHARE` of the device, so at least 25% is left for the KV cache
    and activations of real batches and contexts (what the published recipes buy with more devices:
    this rule gives their mesh for BF16 and NVFP4 on H200, NVFP4 on MI355X and on GB300; Quark
    MXFP4 on MI355X's TP8 is a throughput choice beyond it). The search starts at the power of two
    that the whole model's bytes need and takes, per world, the first of :func:`candidate_meshes`
    that qualifies. A fit with less than 10% of a rank's usable memory to spare gets a note on the
    next size up.
    """
    tried: list[str] = []
    need = max(2, math.ceil(total_bytes / (USABLE * device_memory_bytes)))
    world = 1 << (need - 1).bit_length()
    largest = min(largest, max(config.num_attention_heads, config.num_local_experts))  # world = max(tp, ep)
    while world <= largest:
        meshes = candidate_meshes(config, world)
        if not meshes:
            why = "; ".join(Mesh(world, world).problems(config))
            tried.append(f"{world} devices: no mesh splits this model ({why})")
        for mesh in meshes:
            planned = fit(mesh)
            share = planned.weight_bytes / device_memory_bytes
            if planned.fits and share > PROPOSAL_WEIGHT_SHARE:
                tried.append(f"{mesh_label(mesh)} on {world} devices fits, but its weights take {share:.0%} of each "
                             f"device (a proposal leaves at least {1 - PROPOSAL_WEIGHT_SHARE:.0%} for KV cache and "
                             "activations)")
                continue
            if planned.fits:
                spare = planned.usable_bytes - planned.rank_bytes
                bigger = candidate_meshes(config, 2 * world) if spare < 0.1 * planned.usable_bytes else []
                if bigger:
                    roomy = fit(bigger[0])
                    roomy_spare = roomy.usable_bytes - roomy.rank_bytes
                    planned.notes.insert(0, f"tight: {spare / 2**30:.1f} GiB of a rank's memory to spare (KV room "
                                         f"for {planned.max_context} tokens at batch 1); {roomy.label} on "
                                         f"{roomy.world} devices leaves {roomy_spare / 2**30:.1f} GiB per rank "
                                         f"({roomy.max_context} tokens)")
                return planned, tried
        world *= 2
    return None, tried + [f"no power-of-two mesh up to {largest} devices fits"]
