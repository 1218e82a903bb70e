"""Running one model across ranks: tensor, expert and sequence parallelism on ``torch.distributed``.

Every rank (a process started by ``torchrun``) runs the same :class:`~musecore.model.MuseModel`
graph on its pieces of the weights; the collectives between them all go through one small class,
:class:`Comm`, so every backend (CUDA/NCCL, ROCm/RCCL, CPU/gloo) shares them.

The layout (``Mesh(tp, ep, sp)`` over ``world`` ranks; ``tp`` is 1 or the world size, ``ep`` divides it):

- **attention**: each rank keeps ``num_attention_heads / tp`` query heads (q, gate rows) and the KV
  heads they read (:func:`head_shard`; replicated when ``tp`` exceeds the KV heads), with its KV
  cache; the heads' outputs are all-gathered and o_proj is split by output rows, its outputs
  all-gathered: every element is the single-device dot product rounded once (a row-parallel
  o_proj would add ``tp`` partial sums already rounded to BF16, which changed greedy tokens of
  muse-tiny in BF16);
- **MoE**: router replicated; the pooler (``pre_expert_proj``) and unpooler (``post_expert_proj``)
  split by output columns and put back together with an all-gather (an all-to-all where the result
  is wanted by token shard); the experts split into ``ep`` contiguous ranges; each rank dispatches
  the routed (token, expert) pairs of its own token shard with ``all_to_all_single``, the expert's
  rank applies the expert and the post-expert norm, and the token's rank sums the weighted outputs
  in fp32 in the single-device order (ascending expert id);
- **lm_head** split by vocabulary, logits all-gathered: every rank samples the same token;
- **dense MLP layers**: gate/up by rows, the activation all-gathered, down by output rows, gathered;
- **sequence parallel** (``sp=True``, prefill only): the residual stream lives in token shards:
  o_proj's outputs go to their token shards (all-to-all, where Megatron reduce-scatters partial
  sums), norms, routing and pooling run on the shard, all-gather before QKV.

A token shard is a contiguous chunk of the flattened ``B*T`` tokens: rank ``r`` holds tokens
``[r*c, min(N, (r+1)*c))`` with ``c = ceil(N / world)`` (:func:`token_chunk`).
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from musecore.names import PREFIX, expert_key, fused_expert_parts


class MeshError(ValueError):
    """A mesh that cannot run this model (does not divide its heads or experts, wrong world size)."""


class DistributedError(RuntimeError):
    """A rank failed (to start, to load, to answer): raised on every rank, naming the rank."""


DEFAULT_TIMEOUT_S = 600.0  # collectives (and the rendezvous) give up after this; MUSECORE_DIST_TIMEOUT overrides
STORE_CONNECT_S = 10.0  # reaching torchrun's store for the launch checks (launch_store)
STORE_POLL_S = 0.05  # how often a rank waiting for the others looks at that store


@dataclass(frozen=True)
class Mesh:
    """How a model is split: ``tp``-way tensor parallel, ``ep``-way expert parallel, ``sp`` for prefill.

    ``world`` is the number of ranks: ``max(tp, ep)``; ``tp`` is 1 (attention replicated) or the
    world size, ``ep`` divides the world size (experts replicated ``world / ep`` times).
    """

    tp: int = 1
    ep: int = 1
    sp: bool = False

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def options(self) -> str:
        """The mesh as the options that ask for it, as errors name it: ``tp=2 ep=2``, `` sp`` appended (plans show
        ``planning_mesh.mesh_label``'s ``TP2/EP2``)."""
        return f"tp={self.tp} ep={self.ep}{' sp' if self.sp else ''}"

    @property
    def replicas(self) -> int:
        """How many copies of each expert range there are (``world / ep``)."""
        return self.world // self.ep

    def size_problem(self) -> Optional[str]:
        """Why ``tp`` or ``ep`` is not a size at all (not a positive integer), whatever the model; None if both are."""
        for name, value in (("tp", self.tp), ("ep", self.ep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name} must be a positive integer, got {value!r}"
        return None

    def shape_problems(self) -> list[str]:
        """Every reason this mesh is not a mesh at all, whatever the model (empty when it is one)."""
        size = self.size_problem()
        if size is not None:
            return [size]
        out = []
        world = self.world
        if self.tp not in (1, world):
            out.append(f"tp={self.tp} must be 1 or the world size ({world})")
        if world % self.ep:
            out.append(f"ep={self.ep} does not divide the world size {world}")
        if not isinstance(self.sp, bool):
            out.append(f"sp must be True or False, got {self.sp!r}")
        elif self.sp and self.tp == 1:
            out.append("sp=True needs tp > 1 (sequence parallelism shards the tensor-parallel ranks' tokens)")
        return out

    def problems(self, config: Any) -> list[str]:
        """Every reason this mesh cannot split ``config`` (empty when it can)."""
        out = self.shape_problems()
        if self.size_problem() is not None:
            return out
        tp = self.tp
        if tp > 1:
            nq, nkv = config.num_attention_heads, config.num_key_value_heads
            for what, size in (("query heads (num_attention_heads)", nq),
                               ("hidden size (hidden_size)", config.hidden_size),
                               ("vocabulary (vocab_size)", config.vocab_size)):
                if size % tp:
                    out.append(f"tp={tp} does not divide the {size} {what}")
            if nq % tp == 0 and (nq // nkv) % math.gcd(nq // nkv, nq // tp):
                out.append(f"tp={tp} splits a KV head's query group unevenly")
            if any(config.is_sparse(i) for i in range(config.num_hidden_layers)) and config.moe_hidden_size % tp:
                out.append(f"tp={tp} does not divide the pooled width {config.moe_hidden_size} (moe_hidden_size)")
            if any(not config.is_sparse(i) for i in range(config.num_hidden_layers)) and config.intermediate_size % tp:
                out.append(f"tp={tp} does not divide the dense MLP width {config.intermediate_size} (intermediate_size)")
        if self.ep > 1 and config.num_local_experts % self.ep:
            out.append(f"ep={self.ep} does not divide the {config.num_local_experts} experts (num_local_experts)")
        return out

    def check(self, config: Any) -> None:
        problems = self.problems(config)
        if problems:
            raise MeshError(f"mesh {self.options} cannot split this model: "
                            + "; ".join(problems))


# -- which piece of each tensor a rank keeps ------------------------------------------------------

@dataclass(frozen=True)
class HeadShard:
    """Rank's attention heads: query heads ``[q_start, q_stop)`` and, per local KV slot, the global KV
    head it holds (local query head ``j`` reads slot ``j // (local query heads / len(kv_heads))``)."""

    q_start: int
    q_stop: int
    kv_heads: tuple[int, ...]


def head_shard(config: Any, tp: int, rank: int) -> HeadShard:
    """The heads rank ``rank`` of ``tp`` keeps. Local query heads are grouped ``g`` at a time onto one
    local KV slot with ``g = gcd(query heads per KV head, query heads per rank)``, so the local
    grouping is uniform even when ``tp`` does not divide the KV heads (a KV head then lives on two
    ranks, or twice on one: the KV cache grows by that factor, which the plan shows)."""
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    per_rank, group = nq // tp, nq // nkv
    g = math.gcd(group, per_rank)
    start = rank * per_rank
    return HeadShard(start, start + per_rank, tuple((start + s * g) // group for s in range(per_rank // g)))


def expert_range(config: Any, mesh: Mesh, rank: int) -> tuple[int, int]:
    """The experts ``[start, stop)`` rank ``rank`` holds."""
    per = config.num_local_experts // mesh.ep
    shard = rank % mesh.ep
    return shard * per, (shard + 1) * per


@dataclass(frozen=True)
class Piece:
    """What a rank keeps of one tensor: ``rows`` (list of ``(start, stop)`` output-row ranges),
    ``cols`` (one input-column range) or ``experts`` (a range of the stacked expert dimension)."""

    rows: Optional[tuple[tuple[int, int], ...]] = None
    cols: Optional[tuple[int, int]] = None
    experts: Optional[tuple[int, int]] = None


def tensor_piece(name: str, config: Any, mesh: Mesh, rank: int) -> Optional[Piece]:
    """The piece of checkpoint tensor ``name`` that ``rank`` keeps; None = the whole tensor."""
    tp, d = mesh.tp, config.head_dim
    if fused_expert_parts(name) is not None:
        return Piece(experts=expert_range(config, mesh, rank)) if mesh.ep > 1 else None
    if tp == 1:
        return None
    base = name[len(PREFIX):] if name.startswith(PREFIX) else name
    leaf = base.rsplit(".", 2)[-2] if base.endswith(".weight") else ""

    def share(size: int) -> tuple[int, int]:
        part = size // tp
        return rank * part, (rank + 1) * part

    if name == "lm_head.weight":
        return Piece(rows=(share(config.vocab_size),))
    if ".self_attn." in base:
        heads = head_shard(config, tp, rank)
        if leaf in ("q_proj", "gate_proj"):
            return Piece(rows=((heads.q_start * d, heads.q_stop * d),))
        if leaf in ("k_proj", "v_proj"):
            return Piece(rows=tuple((h * d, (h + 1) * d) for h in heads.kv_heads))
        if leaf == "o_proj":
            return Piece(rows=(share(config.hidden_size),))
        return None
    if ".mlp." in base:
        if leaf == "pre_expert_proj":
            return Piece(rows=(share(config.moe_hidden_size),))
        if leaf == "post_expert_proj":
            return Piece(rows=(share(config.hidden_size),))
        if leaf in ("gate_proj", "up_proj") and ".mlp.experts." not in base:  # dense MLP
            return Piece(rows=(share(config.intermediate_size),))
        if leaf == "down_proj" and ".mlp.experts." not in base:
            return Piece(rows=(share(config.hidden_size),))
    return None


def keeps_expert(name: str, config: Any, mesh: Mesh, rank: int) -> bool:
    """Whether a producer's per-expert tensor (``experts.{e}.*``) belongs on ``rank`` (others are not read)."""
    key = expert_key(name)
    if key is None or mesh.ep == 1:
        return True
    start, stop = expert_range(config, mesh, rank)
    return start <= key[1] < stop


def piece_shape(shape: Sequence[int], piece: Optional[Piece]) -> tuple[int, ...]:
    """The logical shape of ``piece`` of a tensor of ``shape``."""
    shape = list(shape)
    if piece is None:
        return tuple(shape)
    if piece.experts is not None:
        shape[0] = piece.experts[1] - piece.experts[0]
    if piece.rows is not None:
        shape[-2] = sum(b - a for a, b in piece.rows)
    if piece.cols is not None:
        shape[-1] = piece.cols[1] - piece.cols[0]
    return tuple(shape)


def leading_ranges(piece: Piece) -> tuple[tuple[int, int], ...]:
    """``piece`` as ranges of its tensor's first dimension (what a reader can cut while reading: a
    stacked tensor's experts, a 2-D weight's rows); empty when it also cuts elsewhere."""
    if piece.cols is not None or (piece.experts is not None and piece.rows is not None):
        return ()
    return (piece.experts,) if piece.experts is not None else tuple(piece.rows or ())


def take(value: Any, piece: Optional[Piece]) -> Any:
    """``piece`` of a plain tensor or a ``QTensor`` (codes and scales cut, never requantized)."""
    if piece is None:
        return value
    plain = isinstance(value, torch.Tensor)
    if piece.experts is not None:
        a, b = piece.experts
        if plain:
            value = value[a:b]
        else:
            from musecore_quant import slice_experts
            value = slice_experts(value, a, b)
    if piece.rows is not None:
        if plain:
            value = torch.cat([value[..., a:b, :] for a, b in piece.rows], dim=-2)
        else:
            from musecore_quant import slice_rows
            parts = [slice_rows(value, a, b) for a, b in piece.rows]
            value = parts[0] if len(parts) == 1 else _cat_rows(parts)
    if piece.cols is not None:
        a, b = piece.cols
        if plain:
            value = value[..., a:b]
        else:
            from musecore_quant import slice_cols
            value = slice_cols(value, a, b)
    return value.contiguous() if plain else value


def _cat_rows(parts: list[Any]) -> Any:
    """Row pieces of one QTensor joined again (they share its per-tensor scales)."""
    from dataclasses import replace
    first = parts[0]
    cat = lambda attr: None if getattr(first, attr) is None else torch.cat([getattr(p, attr) for p in parts], -2)  # noqa: E731
    scale = first.scale if first.format == "fp8" and first.scale.dim() == 0 else cat("scale")
    return replace(first, data=cat("data"), scale=scale, zero=cat("zero"),
                   shape=(*first.shape[:-2], sum(p.shape[-2] for p in parts), first.shape[-1]))


def token_chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous chunk ``[start, stop)`` of ``n`` tokens (``ceil(n / world)`` each, the last short)."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


# -- the running group ----------------------------------------------------------------------------

REPLICATED_MOE_TOKENS = 64  # MoE layers of at most this many tokens combine with one all-reduce (Comm.replicated_moe)


def weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[:, j] * per_slot[:, j]`` in fp32, over each token's experts in ascending id order:
    the order the single-device ``moe`` op adds them (``y.index_add_`` expert by expert)."""
    n, k, h = per_slot.shape
    by_expert = torch.argsort(ids, dim=-1)
    per_slot = per_slot.gather(1, by_expert[..., None].expand(n, k, h))
    wts = weights.gather(1, by_expert).float()
    y = torch.zeros(n, h, dtype=torch.float32, device=per_slot.device)
    for j in range(k):
        y = y + wts[:, j, None] * per_slot[:, j]
    return y


class Comm:
    """The collectives one rank runs, over one ``torch.distributed`` group; counts the bytes each moves.

    ``traffic[name]`` is the bytes this rank sent through collective ``name`` (what the plan predicts:
    :func:`musecore.planning` uses the same schedule), reset with :meth:`reset_traffic`.
    """

    def __init__(self, mesh: Mesh, rank: int, group: Any = None, device_mesh: Any = None) -> None:
        import torch.distributed as dist
        self.dist, self.mesh, self.rank, self.group, self.device_mesh = dist, mesh, rank, group, device_mesh
        # torch 2.13 renamed the tensor-in/tensor-out all-gather; the GPU hosts' torch 2.11 has the old name only
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.world = mesh.world
        self.traffic: dict[str, int] = defaultdict(int)
        # During a sequence-parallel prefill: how many tokens the batch has (the residual stream holds
        # this rank's token shard of them); 0 otherwise. Set by MuseModel.forward.
        self.sp_tokens = 0
        self.replicated_limit = replicated_moe_limit()

    def _collective(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a collective: its failure (a peer's connection closed, a wait past the
        timeout) becomes one :class:`DistributedError` line naming ``op``, the original kept as ``__cause__``."""
        try:
            return fn(*args, **kwargs)
        except DistributedError:
            raise
        except RuntimeError as e:  # torch.distributed.DistBackendError and gloo's errors are RuntimeErrors
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise DistributedError(f"rank {self.rank}: collective {op} failed ({first}): another rank probably died "
                                   f"or stalled (see its own error); collectives wait up to MUSECORE_DIST_TIMEOUT="
                                   f"{timeout_seconds():g} s") from e

    def reset_traffic(self) -> None:
        self.traffic.clear()

    def _count(self, name: str, t: torch.Tensor) -> None:
        self.traffic[name] += t.numel() * t.element_size()

    # token shards
    def chunk(self, n: int, rank: Optional[int] = None) -> tuple[int, int]:
        return token_chunk(n, self.world, self.rank if rank is None else rank)

    def my_tokens(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.chunk(x.shape[0])
        return x[a:b]

    def _padded(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x.contiguous()
        out = x.new_zeros((rows, *x.shape[1:]))
        out[:x.shape[0]] = x
        return out

    def gather_tokens(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Token shards ``[n_r, ...]`` -> every token ``[n, ...]`` on every rank."""
        c = -(-n // self.world)
        local = self._padded(x, c)
        out = local.new_empty((c * self.world, *x.shape[1:]))
        self._count("all_gather", local)
        self._collective("all_gather", self._all_gather, out, local, group=self.group)
        return out[:n]

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """Column shards ``[n, C/world]`` -> ``[n, C]`` (rank order) on every rank."""
        x = x.contiguous()
        out = x.new_empty((self.world * x.shape[0], x.shape[1]))
        self._count("all_gather", x)
        self._collective("all_gather", self._all_gather, out, x, group=self.group)
        return out.view(self.world, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], self.world * x.shape[1])

    def cols_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Column shards of every token ``[n, C/world]`` -> all columns of this rank's tokens ``[n_r, C]``."""
        n, w = x.shape[0], self.world
        sizes = [b - a for a, b in (self.chunk(n, r) for r in range(w))]
        mine = sizes[self.rank]
        out = x.new_empty((w * mine, x.shape[1]))
        x = x.contiguous()
        self._count("all_to_all", x)
        self._collective("all_to_all", self.dist.all_to_all_single, out, x, [mine] * w, sizes, group=self.group)
        return out.view(w, mine, x.shape[1]).permute(1, 0, 2).reshape(mine, w * x.shape[1])

    def dispatch_combine(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int,
                         run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed experts of this rank's tokens ``z [n,h]`` (``weights``/``ids [n,k]``), wherever they live.

        Each (token, slot) row travels to the rank holding its expert (in this rank's replica group),
        ``run(rows [m,h], local_ids [m]) -> [m,h] fp32`` applies expert and post-expert norm there, and
        the outputs come back; the token's rank sums ``weight * output`` in fp32 in ascending expert
        order, as the single-device op does. Returns ``[n,h]`` fp32.
        """
        dist, w = self.dist, self.world
        n, k = ids.shape
        h = z.shape[-1]
        flat = ids.reshape(-1)
        base = (self.rank // self.mesh.ep) * self.mesh.ep  # first rank of this rank's replica group
        dest = base + flat // experts_per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=w)
        recv_counts = torch.empty_like(send_counts)
        self._collective("all_to_all", dist.all_to_all_single, recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = z[order // k].contiguous()
        local_ids = (flat[order] % experts_per_rank).to(torch.int32)
        got_rows = rows.new_empty((sum(recv), h))
        got_ids = local_ids.new_empty((sum(recv),))
        self._count("all_to_all", rows)
        self._count("all_to_all", local_ids)
        self._collective("all_to_all", dist.all_to_all_single, got_rows, rows, recv, send, group=self.group)
        self._collective("all_to_all", dist.all_to_all_single, got_ids, local_ids, recv, send, group=self.group)
        out = run(got_rows, got_ids.long()) if got_rows.shape[0] else got_rows.new_zeros((0, h), dtype=torch.float32)
        back = out.new_empty((n * k, h))
        self._count("all_to_all", out)
        self._collective("all_to_all", dist.all_to_all_single, back, out.contiguous(), send, recv, group=self.group)
        per_slot = torch.empty_like(back)
        per_slot[order] = back
        return weighted_sum(per_slot.view(n, k, h), weights, ids)

    def combine_replicated(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int,
                           run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed experts of every token ``z [N,h]`` (every rank holds all tokens and their routing),
        with one collective: each rank fills the (token, slot) outputs of its own experts into a zeroed
        ``[N*k, h]`` fp32 buffer, one all-reduce adds the buffers (each slot has exactly one nonzero
        contributor: exact), and every rank sums ``weight * output`` in the single-device order.
        Fewer, fixed-size collectives than :meth:`dispatch_combine`: the decode path (small batches).
        With ``ep < world`` the copies of an expert range share the tokens (token ``t`` -> copy ``t % copies``).
        """
        n, k = ids.shape
        flat = ids.reshape(-1)
        slot_token = torch.arange(n * k, device=ids.device) // k
        owner = (slot_token % self.mesh.replicas) * self.mesh.ep + flat // experts_per_rank
        mine = (owner == self.rank).nonzero().squeeze(1)
        per_slot = torch.zeros(n * k, z.shape[-1], dtype=torch.float32, device=z.device)
        if mine.numel():
            per_slot[mine] = run(z[mine // k], flat[mine] % experts_per_rank)
        self._count("all_reduce", per_slot)
        self._collective("all_reduce", self.dist.all_reduce, per_slot, group=self.group)
        return weighted_sum(per_slot.view(n, k, -1), weights, ids)

    def replicated_moe(self, tokens: int) -> bool:
        """Whether a MoE layer over ``tokens`` tokens takes :meth:`combine_replicated` (one all-reduce, every
        token everywhere) rather than :meth:`dispatch_combine` (all-to-all of the routed rows): outside a
        sequence-parallel prefill, up to ``MUSECORE_MOE_REPLICATED_TOKENS`` tokens (default
        :data:`REPLICATED_MOE_TOKENS`), where the latency of the all-to-all path's six collectives beats its
        smaller volume (``musecore.distributed_bench`` measures both)."""
        return not self.sp_tokens and tokens <= self.replicated_limit

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (e.g. a sampling seed)."""
        t = torch.tensor([value], dtype=torch.long, device=self._object_device())
        self._collective("broadcast", self.dist.broadcast, t, 0, group=self.group)
        return int(t.item())

    def _object_device(self) -> torch.device:
        backend = self.dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Every rank learns whether any rank failed ``what``; all raise :class:`DistributedError` naming
        the failed ranks (instead of the healthy ranks waiting in the next collective until the timeout)."""
        message = None if error is None else (str(error).splitlines()[0] if str(error) else type(error).__name__)
        everyone: list[Optional[str]] = [None] * self.world
        self._collective("all_gather_object", self.dist.all_gather_object, everyone, message, group=self.group)
        failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
            raise DistributedError(f"{what} failed on {len(failed)} of {self.world} ranks: {detail}") from error

    def agree_on(self, fields: dict[str, Any], what: str) -> None:
        """Every rank compares ``fields`` (name -> value, or a :class:`Shown` value whose label is what the error
        shows) with the other ranks'; the first field that differs raises :class:`DistributedError` on every rank,
        naming it and each rank's value. Ranks given different options would otherwise run mismatched collectives:
        wrong output, a gloo error or a wait until the timeout.

        Example::

            comm.agree_on({"device": "cpu", "kv_format": "bf16"}, "loading muse-tiny")
        """
        mine = {name: (repr(v.value), v.label) if isinstance(v, Shown) else (repr(v), repr(v))
                for name, v in fields.items()}
        everyone: list[Optional[dict]] = [None] * self.world
        self._collective("all_gather_object", self.dist.all_gather_object, everyone, mine, group=self.group)
        for name in mine:
            seen = [ranks.get(name, (None, "(missing)")) if ranks is not None else (None, "(missing)")
                    for ranks in everyone]
            if any(key != seen[0][0] for key, _label in seen):
                values = ", ".join(f"rank {r}: {label}" for r, (_key, label) in enumerate(seen))
                raise DistributedError(f"{what}: the ranks were given different {name} ({values}); every rank "
                                       "must get the same options")


class Shown(NamedTuple):
    """A :meth:`Comm.agree_on` field compared by ``value`` and shown by ``label`` (a digest with a readable name)."""
    value: Any
    label: str


def digest(value: Any) -> str:
    """A short stable hash of ``value``'s ``repr`` (what ranks compare of a checkpoint, a plan, a prompt)."""
    import hashlib
    return hashlib.sha256(repr(value).encode("utf-8", "surrogatepass")).hexdigest()[:12]


def agree_request(comm: Optional[Comm], prompt_ids: Any, max_new_tokens: int, temperature: float, top_p: float,
                  top_k: int, seed: Optional[int], stop: Any, kv_format: Optional[str] = None) -> None:
    """Before a distributed generation's first collective: every rank must have been asked the same thing
    (the prompts' token ids and the sampling options); the first that differs raises :class:`DistributedError`
    on every rank. Nothing to do without ``comm`` (one device).

    Example (in ``musecore.generate.generate``, once the prompts are token ids)::

        agree_request(model.comm, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop, kv_format)
    """
    if comm is None:
        return
    ids = [list(map(int, p)) for p in prompt_ids]
    key = digest(ids)
    comm.agree_on({"prompt": Shown(key, f"{len(ids)} prompt(s) of {[len(p) for p in ids]} tokens, ids digest {key}"),
                   "max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_p": float(top_p),
                   "top_k": top_k, "seed": seed, "stop": stop if stop is None or isinstance(stop, (str, int)) else
                   sorted(map(repr, stop)), "kv_format": kv_format}, "generating")


def replicated_moe_limit() -> int:
    """``MUSECORE_MOE_REPLICATED_TOKENS`` (default :data:`REPLICATED_MOE_TOKENS`; 0: always all-to-all)."""
    return int(env_number("MUSECORE_MOE_REPLICATED_TOKENS", REPLICATED_MOE_TOKENS, int, 0,
                          "a whole number of tokens >= 0 (0: always all-to-all)"))


def timeout_seconds() -> float:
    """``MUSECORE_DIST_TIMEOUT`` in seconds (default :data:`DEFAULT_TIMEOUT_S`)."""
    return env_number("MUSECORE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S, float, 1e-9, "a number of seconds > 0")


def env_number(name: str, default: float, kind: type, least: float, wanted: str) -> float:
    """The environment variable ``name`` read as ``kind``, at least ``least``; ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value >= least:
        raise MeshError(f"{name}={raw!r}: set it to {wanted}, or unset it (default {default})")
    return value


def launched_world() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from the launcher's environment (torchrun sets them); (0, 1, 0) alone."""
    try:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise MeshError(f"RANK / WORLD_SIZE / LOCAL_RANK are not integers ({e}); start the ranks with torchrun") from None


def process_group_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend for ranks whose tensors live on ``device_type``: NCCL on CUDA
    (RCCL on ROCm builds), TorchTPU's ``tpu`` on TPU hosts (torch_tpu registers it with c10d when it
    loads; never run here: no TPU was reachable), gloo on the CPU and anything else."""
    import torch.distributed as dist

    if device_type == "cuda":
        return "nccl"
    if device_type == "tpu":
        if "tpu" not in dist.Backend.backend_list:
            raise DistributedError("tensors on the 'tpu' device need TorchTPU's 'tpu' process group, which is not "
                                   "registered: torch_tpu did not load its distributed runtime (check `import "
                                   "torch_tpu` and libtpu on this host)")
        return "tpu"
    return "gloo"


def connect(mesh: Mesh, device_type: str) -> Comm:
    """Join (or reuse) the process group of this ``torchrun`` launch and return this rank's :class:`Comm`.

    The process-group backend is :func:`process_group_backend`'s (NCCL/RCCL, TorchTPU's ``tpu``, gloo);
    a ``DeviceMesh`` of ``world`` ranks. Raises :class:`MeshError` when the launch does not match ``mesh``
    (every rank raises the same).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, local_rank = launched_world()
    if world != mesh.world:
        how = (f"start it with: torchrun --nproc-per-node {mesh.world} -m musecore ..." if world == 1 else
               f"pass tp/ep whose larger is {world}, or launch {mesh.world} ranks")
        raise MeshError(f"mesh tp={mesh.tp} ep={mesh.ep} needs {mesh.world} ranks but this launch has {world} "
                        f"(WORLD_SIZE): {how}")
    backend = process_group_backend(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    elif device_type == "tpu" and torch.accelerator.device_count() > local_rank:
        torch.accelerator.set_device_index(local_rank)  # one chip per rank when this host shows several
    if not dist.is_initialized():
        wait_for_the_other_ranks(mesh, rank, world)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds()))
            # Leave the group before the interpreter tears down: a gloo group destroyed with its threads
            # still running aborts the process ("terminate called without an active exception"), and
            # torchrun then kills the healthy ranks.
            atexit.register(_leave)
        except Exception as e:  # rendezvous timeout, refused connection...
            raise DistributedError(f"rank {rank}: could not join the process group ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); check MASTER_ADDR/MASTER_PORT "
                                   "and that every rank started") from None
    device_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("model",))
    return Comm(mesh, rank, device_mesh.get_group("model"), device_mesh)


def launch_store() -> Any:
    """A client of the key-value store ``torchrun``'s agent keeps for this launch (``TORCHELASTIC_USE_AGENT_STORE``),
    under a prefix of its own per run and restart; None outside ``torchrun`` or when the store does not answer
    within :data:`STORE_CONNECT_S` (the checks that use it are then skipped: the rendezvous still bounds the wait)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=STORE_CONNECT_S), wait_for_workers=False)
    except (KeyError, ValueError, RuntimeError):
        return None
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"musecore/{run}/", store)


def announce_alone() -> None:
    """This rank of a ``torchrun`` launch of several loads a model on its own (no tp/ep/sp: independent replicas,
    e.g. data parallel). It never waits for the other ranks; it leaves a note in the launch's store, so that a rank
    given a mesh (:func:`wait_for_the_other_ranks`) refuses at once instead of waiting for this one until the
    rendezvous timeout."""
    rank, world, _local = launched_world()
    store = launch_store() if world > 1 else None
    if store is not None:
        try:
            store.set(f"alone/{rank}", "1")
            store.add("alone", 1)
        except RuntimeError:  # the store went away: the others' rendezvous timeout still ends their wait
            pass


def wait_for_the_other_ranks(mesh: Mesh, rank: int, world: int) -> None:
    """Under ``torchrun``, before the rendezvous: wait until every rank of the launch has come to join a mesh, and
    raise :class:`MeshError` at once if one loads its model alone (:func:`announce_alone`: started without the
    ``--tp``/``--ep`` this rank was given), or :class:`DistributedError` after ``MUSECORE_DIST_TIMEOUT``."""
    store = launch_store()
    if store is None:
        return
    limit = timeout_seconds()
    try:
        _wait_for_the_other_ranks(store, mesh, rank, world, limit)
    except DistributedError:
        raise
    except RuntimeError as e:  # a store error (DistStoreError is a RuntimeError)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DistributedError(f"rank {rank}: torchrun's store stopped answering while the ranks gathered ({first}); "
                               "did torchrun stop?") from None


def _wait_for_the_other_ranks(store: Any, mesh: Mesh, rank: int, world: int, limit: float) -> None:
    store.add("meshed", 1)
    deadline = time.monotonic() + limit
    while True:
        if store.add("alone", 0) > 0:
            alone = [r for r in range(world) if store.check([f"alone/{r}"])]
            many = len(alone) > 1
            raise MeshError(f"rank {rank} was given mesh {mesh.options} but rank{'s' if many else ''} "
                            f"{', '.join(map(str, alone))} of this launch load{'' if many else 's'} the model alone "
                            "(no tp/ep/sp): give every rank the same --tp/--ep/--sp")
        arrived = store.add("meshed", 0)
        if arrived >= world:
            return
        if time.monotonic() > deadline:
            raise DistributedError(f"rank {rank}: could not join the process group (only {arrived} of {world} ranks "
                                   f"came within MUSECORE_DIST_TIMEOUT={limit:g} s); check that every rank started")
        time.sleep(STORE_POLL_S)


def _leave() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
