"""The Muse Spark Open text decoder, as transformers 5.24's ``muse_spark`` computes it (MODEL.md section 1).

Every computation goes through ``self.ops`` (the operator interface, bound to backends by the
plan); nothing here knows which device runs it. Weights are filled in by the loader
(``musecore/loader.py``) through :meth:`MuseModel.weight_slots`, already in each backend's
resident layout. Read :class:`MoE.__call__` for the MoE order of operations.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Optional

import torch

from musecore.backends.base import Backend
from musecore.config import MuseConfig
from musecore.distributed import Comm, head_shard
from musecore.generate import _is_token_id, check_input_ids
from musecore.kv_cache import KVCache
from musecore.names import (ATTENTION_INPUTS, DENSE_MLP_INPUTS, FP32_TENSORS, FUSED_EXPERT_TENSORS,  # noqa: F401
                            PREFIX, is_fp32_tensor)
from musecore.ops import Ops
from musecore.rope import RotaryTable
from musecore.towers import AUDIO, VISION, MediaCountError
from musecore.towers.audio import AudioTower
from musecore.towers.vision import VisionTower

# ``media`` of ``MuseModel.forward``: placeholder token id -> the feature rows that replace its placeholders.
Media = Mapping[int, torch.Tensor]

# ``observer(layer, z [N,h], weights [N,k] fp32, ids [N,k])``: what a MoE layer's router chose and the
# pooled latents its experts receive, handed to calibration before the experts run (MuseModel.forward).
MoEObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class FusedLinear:
    """Linears that read one input, run as one: ``weight`` is their weights stacked along the output
    dimension (prepared by the backend like any linear), ``widths`` splits the output back.

    The loader builds one for an ``INPUT_PROJECTIONS`` group when one backend prepares every member
    and they join row-wise unchanged (unquantized, or MXFP4/INT4; see :func:`musecore.loader.fuse_group`):
    one weight pass and one launch instead of several small ones, which was most of a decode step's
    linear time on small models. Every output element is the same dot product as before; the pieces
    come back as views of one tensor (backends' ops accept such strided slices).
    """

    weight: Any
    widths: tuple[int, ...]

    def __call__(self, ops: Ops, x: torch.Tensor, head_dim: Optional[int] = None) -> tuple[torch.Tensor, ...]:
        y = ops.linear(x, self.weight)  # split_with_sizes: Tensor.split's Python wrapper cost ~5 us per call (decode)
        if head_dim is None:
            return y.split_with_sizes(self.widths, -1)
        return y.view(*y.shape[:-1], -1, head_dim).split_with_sizes([w // head_dim for w in self.widths], -2)


def project(owner: Any, ops: Ops, x: torch.Tensor, head_dim: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """``owner.INPUT_PROJECTIONS`` applied to ``x``: through the fused weight when the loader made one. With
    ``head_dim`` each output comes back as ``[..., heads, head_dim]`` (from the fused output: one view, split)."""
    if owner.in_proj is not None:
        return owner.in_proj(ops, x, head_dim)
    outs = tuple(ops.linear(x, getattr(owner, name)) for name in owner.INPUT_PROJECTIONS)
    return outs if head_dim is None else tuple(y.view(*y.shape[:-1], -1, head_dim) for y in outs)


class Attention:
    """GQA with weightless q/k norms (q scaled), RoPE or NoPE, sliding or full window, then a weightless
    per-head output norm times an element-wise sigmoid gate."""

    INPUT_PROJECTIONS = ATTENTION_INPUTS  # all read the normed input ``a``

    def __init__(self, config: MuseConfig, layer: int, ops: Ops, comm: Optional[Comm] = None) -> None:
        self.ops, self.layer, self.comm = ops, layer, comm
        self.nq, self.nkv, self.d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if comm is not None and comm.mesh.tp > 1:  # this rank's heads (musecore.distributed.head_shard)
            heads = head_shard(config, comm.mesh.tp, comm.rank)
            self.nq, self.nkv = heads.q_stop - heads.q_start, len(heads.kv_heads)
        self.window, self.eps, self.scale = config.window(layer), config.rms_norm_eps, config.head_dim ** -0.5
        self.q_scale, self.rope = config.qk_scale_factor, config.uses_rope(layer)
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = self.gate_proj = None
        self.in_proj: Optional[FusedLinear] = None  # q/k/v/gate as one linear, when the loader fused them
        self.fused: Optional[Callable[..., Optional[torch.Tensor]]] = None  # MuseModel.fuse_blocks

    def fused_projection_problem(self) -> Optional[str]:
        """Why ``in_proj`` is not the loader's fused q/k/v/gate weight (in that order, full widths), or None when it
        is: what a backend's one-call block (``Backend.fuse_block``) needs to split its output."""
        if self.in_proj is None:
            return "q/k/v/gate are separate weights (the loader did not fuse them)"
        nq, nkv, d = self.nq, self.nkv, self.d
        if tuple(self.in_proj.widths) != (nq * d, nkv * d, nkv * d, nq * d):
            return f"the fused projection's widths {tuple(self.in_proj.widths)} are not q, k, v, gate"
        return None

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 cache: Optional[KVCache]) -> torch.Tensor:
        if self.fused is not None:
            out = self.fused(a, positions, rope, cache)  # the backend's one-call block (decode), or None: the ops
            if out is not None:
                return out
        ops, comm = self.ops, self.comm
        B, T = positions.shape
        if comm is not None and comm.sp_tokens:  # sequence parallel: this rank holds a token shard of ``a``
            a = comm.gather_tokens(a.reshape(-1, a.shape[-1]), B * T).view(B, T, -1)
        q, k, v, gate = project(self, ops, a, self.d)  # [B,T,heads,d]; gate: one per output element
        cos, sin = rope if self.rope else (None, None)  # NoPE on the full-attention layers
        q, k = ops.qk_norm_rope(q, k, cos, sin, self.eps, self.q_scale)
        if cache is None:
            keys, values, key_pos, k_scale, v_scale = k, v, positions, None, None
        else:
            layer_cache = cache[self.layer]
            k, v = layer_cache.encode(k, v)
            view = layer_cache.update(k, v, positions)
            keys, values, key_pos, k_scale, v_scale = view.k, view.v, view.positions, view.k_scale, view.v_scale
        o = ops.attention(q, keys, values, positions, key_pos, self.window, self.scale, k_scale, v_scale)
        o = ops.head_norm_gate(o, gate, self.eps)  # [B,T,nq,d], one gate per output element
        if comm is None or comm.mesh.tp == 1:
            return ops.linear(o.reshape(B, T, self.nq * self.d), self.o_proj)  # [B,T,H]
        return gathered_linear(ops, comm, o.reshape(B * T, self.nq * self.d), self.o_proj, (B, T))


def gathered_linear(ops: Ops, comm: Comm, x: torch.Tensor, weight: Any, shape: tuple[int, int]) -> torch.Tensor:
    """A tensor-parallel linear whose input ``x [N, K/tp]`` is split by columns (heads, MLP width): the
    input is gathered whole, each rank computes its ``H/tp`` output columns, and those are gathered
    (``[B,T,H]`` everywhere) or sent to their token shards (``[1,n_r,H]``, sequence-parallel prefill).
    Every output element is the single-device dot product, rounded once (a row-parallel split would
    round ``tp`` partial sums to the model dtype before adding them)."""
    out = ops.linear(comm.gather_cols(x), weight)  # [N, H/tp]
    if comm.sp_tokens:
        return comm.cols_to_tokens(out).unsqueeze(0)
    return comm.gather_cols(out).view(*shape, -1)


class MoE:
    """Sigmoid router over the full width; pooler H->h and its centred norm; SwiGLU experts, each
    output through the shared post-expert norm, weighted and summed; unpooler h->H."""

    def __init__(self, config: MuseConfig, layer: int, ops: Ops, comm: Optional[Comm] = None) -> None:
        self.ops, self.layer, self.comm = ops, layer, comm
        self.num_experts = config.num_local_experts
        self.top_k, self.eps, self.post_eps = config.num_experts_per_tok, config.rms_norm_eps, config.post_norm_eps
        self.multiplier, self.scaling = config.output_multiplier, config.routed_scaling_factor
        self.router = self.correction_bias = None  # [E,H] fp32, [E] fp32
        self.pre_expert_proj = self.post_expert_proj = None
        self.pre_expert_norm = None   # [h], 1 + w (centred)
        self.experts = None           # ExpertWeights: gate/up/down stacked in the backend's layout
        self.post_expert_norm = None  # [h], 1 + w: one weight shared by every expert, applied scale-first
        self.fused: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None  # MuseModel.fuse_blocks

    def __call__(self, m: torch.Tensor, observer: Optional[MoEObserver] = None, experts: Any = None) -> torch.Tensor:
        """``observer`` sees the routing before the experts run; ``experts`` replaces the layer's own
        for this call (calibration runs later layers on already-quantized experts)."""
        if self.comm is not None:
            return self.parallel(m, observer, experts)
        if self.fused is not None and observer is None and experts is None:
            y = self.fused(m)  # the backend's one-call block (decode sizes), or None: the ops below
            if y is not None:
                return y
        ops = self.ops
        B, T, H = m.shape
        m = m.reshape(B * T, H)
        weights, ids = ops.router_topk(m, self.router, self.correction_bias, self.top_k, self.multiplier,
                                       self.scaling)  # [N,k] fp32, [N,k]
        z = ops.rms_norm(ops.linear(m, self.pre_expert_proj), self.pre_expert_norm, self.eps)  # [N,h]
        if observer is not None:
            observer(self.layer, z, weights, ids)
        experts = self.experts if experts is None else experts
        y = ops.moe(z, weights, ids, experts, self.post_expert_norm, self.post_eps)  # [N,h] fp32
        return ops.linear(y.to(m.dtype), self.post_expert_proj).view(B, T, H)  # unpooler

    def parallel(self, m: torch.Tensor, observer: Optional[MoEObserver], experts: Any) -> torch.Tensor:
        """The same layer across ranks (``musecore.distributed``). Small batches (decode): every token on
        every rank, pooler by columns, one all-reduce for the experts, unpooler by columns. Otherwise:
        routing on this rank's token shard, pooler by columns then back to token shards, experts
        wherever they live (all-to-all), unpooler by columns."""
        ops, comm = self.ops, self.comm
        if observer is not None:
            raise ValueError("calibration observes routing on one device; run it without tp/ep")
        shape, H, tp = m.shape, m.shape[-1], comm.mesh.tp
        m = m.reshape(-1, H)
        n = comm.sp_tokens or m.shape[0]  # every token of the batch
        experts = self.experts if experts is None else experts

        def run(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:  # on the expert's rank
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)  # contiguous, as kernels read
            return ops.moe(rows, ones, local_ids[:, None].contiguous(), experts, self.post_expert_norm,
                           self.post_eps)  # weight 1: the expert's output after the post-expert norm, fp32

        if comm.replicated_moe(n):  # every token on every rank, one all-reduce for the experts (decode)
            weights, ids = ops.router_topk(m, self.router, self.correction_bias, self.top_k, self.multiplier,
                                           self.scaling)
            pooled = ops.linear(m, self.pre_expert_proj)  # [N, h/tp]
            z = ops.rms_norm(comm.gather_cols(pooled) if tp > 1 else pooled, self.pre_expert_norm, self.eps)
            y = comm.combine_replicated(z, weights, ids, self.num_experts // comm.mesh.ep, run).to(m.dtype)
            out = ops.linear(y, self.post_expert_proj)  # [N, H/tp]
            return (comm.gather_cols(out) if tp > 1 else out).view(shape)
        full = comm.gather_tokens(m, n) if comm.sp_tokens else m
        mine = m if comm.sp_tokens else comm.my_tokens(m)
        weights, ids = ops.router_topk(mine, self.router, self.correction_bias, self.top_k, self.multiplier,
                                       self.scaling)  # [n_r,k]
        pooled = ops.linear(full, self.pre_expert_proj)  # [N, h/tp]
        z = comm.cols_to_tokens(pooled) if tp > 1 else comm.my_tokens(pooled)
        z = ops.rms_norm(z, self.pre_expert_norm, self.eps)  # [n_r,h]
        y = comm.dispatch_combine(z, weights, ids, self.num_experts // comm.mesh.ep, run).to(m.dtype)
        out = ops.linear(comm.gather_tokens(y, n), self.post_expert_proj)  # [N, H/tp]
        if tp > 1:
            out = comm.cols_to_tokens(out) if comm.sp_tokens else comm.gather_cols(out)
        return out.view(shape)


class DenseMLP:
    """``down(silu(gate(m)) * up(m))``: the MLP of the ``"dense"`` layers."""

    INPUT_PROJECTIONS = DENSE_MLP_INPUTS

    def __init__(self, config: MuseConfig, layer: int, ops: Ops, comm: Optional[Comm] = None) -> None:
        self.ops, self.layer, self.comm = ops, layer, comm
        self.gate_proj = self.up_proj = self.down_proj = None
        self.in_proj: Optional[FusedLinear] = None

    def __call__(self, m: torch.Tensor, observer: Optional[MoEObserver] = None, experts: Any = None) -> torch.Tensor:
        """The same call as :meth:`MoE.__call__`; a dense layer has no router to observe, no experts to replace."""
        if experts is not None:
            raise ValueError(f"layer {self.layer} is a dense-MLP layer (mlp_layer_types): it has no experts to replace")
        comm = self.comm
        if comm is None or comm.mesh.tp == 1:
            gate, up = project(self, self.ops, m)
            return self.ops.linear(self.ops.silu_mul(gate, up), self.down_proj)
        if comm.sp_tokens:  # every token's input, the result back to token shards
            m = comm.gather_tokens(m.reshape(-1, m.shape[-1]), comm.sp_tokens)
        B, T = (1, comm.sp_tokens) if comm.sp_tokens else m.shape[:2]
        gate, up = project(self, self.ops, m)  # this rank's I/tp columns
        act = self.ops.silu_mul(gate, up)
        return gathered_linear(self.ops, comm, act.reshape(B * T, -1), self.down_proj, (B, T))


@dataclass
class ResidualGate:
    """``alpha * residual + beta * h``; the fp32 coefficients are computed from the gate once at load."""

    alpha: torch.Tensor  # [H] fp32
    beta: torch.Tensor   # [H] fp32


class DecoderLayer:
    def __init__(self, config: MuseConfig, layer: int, ops: Ops, comm: Optional[Comm] = None) -> None:
        self.layer_type = config.layer_types[layer]
        self.self_attn = Attention(config, layer, ops, comm)
        self.mlp = MoE(config, layer, ops, comm) if config.is_sparse(layer) else DenseMLP(config, layer, ops, comm)
        self.input_layernorm = self.pre_feedforward_layernorm = None  # 1 + w (centred)
        self.post_feedforward_layernorm = None                       # 1 + w, applied scale-first
        self.post_attention_residual_gate: Optional[ResidualGate] = None
        self.post_feedforward_residual_gate: Optional[ResidualGate] = None


# How the loader places each kind of tensor: "linear"/"embedding" (prepared by a backend), "vector"
# (a norm weight, model dtype), "centered" (a norm weight stored centred at 0: placed as ``1 + w``),
# "residual_gate" (fp32 gate -> ResidualGate coefficients), "router" / "router_bias" (kept fp32),
# "experts" (fused ``gate_up_proj [E,2I,h]`` / ``down_proj [E,h,I]``, or per-expert keys).
SLOT_ROLES = ("linear", "embedding", "vector", "centered", "residual_gate", "router", "router_bias", "experts")


@dataclass
class Slot:
    """Where a checkpoint tensor goes: ``owner.attr``, and how the backend must prepare it."""

    owner: Any
    attr: str
    role: str   # one of SLOT_ROLES
    layer: int = -1
    fused: bool = False  # one of ``owner.INPUT_PROJECTIONS``: the loader may fuse it into ``owner.in_proj``


@dataclass(frozen=True)
class DeferredNorm:
    """The ``residual_norm`` op after a sublayer, not yet run: ``residual_norm(residual, out, *norm)``.

    A backend's fused block hands it on (its ``sublayer(..., defer=True)``, asked only where the fused block after
    it ``takes_deferred``), and that block's first launch runs the op in its own programs, so the block before ends
    without it (``Backend.fuse_block``). :meth:`resolve` runs the op wherever the next block does not take it after
    all."""

    residual: torch.Tensor
    out: torch.Tensor
    norm: tuple  # residual_norm's arguments after out: post_weight, alpha, beta, next_weight, post_eps, eps

    def resolve(self, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual', normed)``: the op run by ``ops``."""
        return ops.residual_norm(self.residual, self.out, *self.norm)


@contextlib.contextmanager
def separate_ops(model: "MuseModel") -> Iterator[None]:
    """Every attention and MoE block of ``model`` (and its embedding stage) through the separate ops inside the
    ``with`` (A/B measurements, the per-op profile, the tests' reference), the backend's fused forms
    (``MuseModel.fuse_blocks``) back afterwards."""
    saved = [(b, b.fused) for layer in model.layers for b in (layer.self_attn, layer.mlp) if hasattr(b, "fused")]
    embed, model.fused_embed = model.fused_embed, None
    for b, _ in saved:
        b.fused = None
    try:
        yield
    finally:
        model.fused_embed = embed
        for b, f in saved:
            b.fused = f


class MuseModel:
    """The text backbone. ``model.forward(ids)`` -> logits ``[B,T,V]`` fp32.

    Example::

        model = musecore.load("muse-tiny")
        logits = model.forward(torch.tensor([[1, 2, 3]]))
    """

    def __init__(self, config: MuseConfig, ops: Ops, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", backend: Optional[Backend] = None,
                 comm: Optional[Comm] = None, towers: Collection[str] = ()) -> None:
        self.config, self.ops, self.dtype, self.device = config, ops, dtype, torch.device(device)
        # The vision and audio towers the plan loads (musecore.planning.plan_towers), or None.
        self.vision = VisionTower(config, ops, dtype, self.device) if VISION in towers else None
        self.audio = AudioTower(config, ops, dtype, self.device) if AUDIO in towers else None
        self.comm = comm  # this rank's collectives when the model runs across ranks (musecore.distributed)
        self.layers = [DecoderLayer(config, i, ops, comm) for i in range(config.num_hidden_layers)]
        # One table (the global theta): transformers 5.24 switches RoPE on per layer, never changes its theta.
        self.rope = RotaryTable(config.head_dim, config.rope_parameters, config.max_position_embeddings,
                                device=self.device)
        self.multimodal_ids = torch.tensor([config.image_token_id, config.video_token_id, config.audio_token_id],
                                           device=self.device)
        if backend is None:
            from musecore.backends.reference import ReferenceBackend
            backend = ReferenceBackend(self.device)
        # The plan's main backend: its hooks (static caches, a faster decode step, the KV write) apply.
        self.backend: Backend = backend
        self.embed_tokens = self.norm = self.lm_head = None
        self.fused_embed: Optional[Callable[..., Optional[tuple]]] = None  # the backend's decode embed (fuse_blocks)
        self.plan = None       # set by musecore.load
        self.tokenizer = None  # set by musecore.load when the checkpoint has tokenizer.json
        self.conversion_report: list = []  # per-tensor error of every conversion done while loading
        self.kv_format = "bf16"
        self.last_generation_stats = None  # set by generate()
        # The last static generation cache and the decode steps captured on it, kept for the next
        # generate() call of the same shape: (batch, capacity, kv_format), cache, {kind: step or None}.
        self._generation_cache: Optional[tuple[tuple, KVCache, dict[str, Any]]] = None

    # -- the computation --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, observer: Optional[MoEObserver] = None,
                media: Optional[Media] = None, last_only: bool = False) -> torch.Tensor:
        """Logits for every position (``last_only``: for the last position only, ``[B,1,V]``: a prefill
        that samples one token skips the lm_head and softcap over the rest of the prompt). ``positions [B,T]`` default to ``0..T-1`` after what the
        cache holds; ``-1`` marks a padding token (it attends to nothing and nothing attends to it).
        ``observer`` is called by every MoE layer with its routing (calibration; see :data:`MoEObserver`).
        ``media`` maps a placeholder id (``config.image_token_id`` / ``video_token_id`` /
        ``audio_token_id``) to feature rows ``[n, H]`` (``encode_images`` / ``encode_videos`` /
        ``encode_audio``, concatenated) that replace that id's ``n`` placeholders, in order, row-major
        over the batch (transformers' ``masked_scatter``); see :meth:`splice`.

        Bad ``input_ids`` (not an integer tensor ``[B,T]``, empty, ids outside the vocabulary) raise a
        TypeError / ValueError naming the problem."""
        # The type, dtype and shape checks read metadata only: free on every call, inside a CUDA graph capture too.
        # The id-range check reads the values, so check_input_ids runs it only on ids the host holds (a tensor a
        # user built, generate's prefill, the serve engine's eager steps): microseconds, no device sync. Ids already
        # on an accelerator are not range-checked: the check would wait for the device at every decode step
        # (generate's and the serve engine's steps feed back the device's own samples, always in range) and cannot
        # run inside a graph capture at all.
        check_input_ids(input_ids, self.config.vocab_size)
        x, a, positions, rope = self.embed(input_ids, positions, cache, media)
        comm = self.comm
        tokens = positions.numel()
        if comm is not None and comm.mesh.sp and positions.shape[1] > 1 and tokens >= comm.world:
            comm.sp_tokens = tokens  # sequence-parallel prefill: the residual stream in token shards
            x, a = (comm.my_tokens(t.reshape(tokens, -1)).unsqueeze(0) for t in (x, a))
        try:
            defer = observer is None  # the residual norms handed between fused blocks (DeferredNorm)
            for i in range(len(self.layers)):
                h, m = self.attention_sublayer(i, x, a, positions, rope, cache, defer=defer)
                x, a = self.feedforward_sublayer(i, h, m, observer=observer, defer=defer)
            if comm is not None and comm.sp_tokens:
                a = comm.gather_tokens(a.reshape(-1, a.shape[-1]), tokens).view(*positions.shape, -1)
        finally:
            if comm is not None:
                comm.sp_tokens = 0
        return self.logits(a[:, -1:].contiguous() if last_only else a)  # contiguous: kernels may assume dense rows

    # The stages of forward, in order. Calibration (musecore.calibrate) runs them one layer at a
    # time so that it can act between layers; forward is exactly embed, then per layer the two
    # sublayers, then logits.

    def embed(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
              cache: Optional[KVCache] = None, media: Optional[Media] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``(x, a, positions, rope)``: the residual stream ``x [B,T,H]`` (media features spliced in),
        the first layer's normed input ``a``, the positions and the rotary table for them."""
        ops, cfg = self.ops, self.config
        if self.fused_embed is not None and not media:
            fused = self.fused_embed(input_ids, positions, cache)  # the backend's one launch (decode), or None
            if fused is not None:
                return fused
        if input_ids.device != self.device:  # the check costs less than a no-op .to() (decode: per token)
            input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if positions is None:
            start = cache.next_position[:, None] if cache is not None else 0
            positions = start + torch.arange(T, device=self.device)[None, :].expand(B, T)
        if positions.device != self.device:
            positions = positions.to(self.device)
        if cache is not None:  # in place: a captured decode step keeps updating the same tensor
            last = positions[:, 0] if T == 1 else positions.max(-1).values  # (no reduction kernel at decode)
            cache.next_position.copy_(torch.maximum(cache.next_position, last + 1))
        rope = self.rope(positions)  # (cos, sin) [B,T,d]; NoPE layers ignore it

        # Multimodal placeholders embed as token 0 (their rows are replaced by features when there are any).
        token_ids = input_ids.masked_fill(torch.isin(input_ids, self.multimodal_ids), 0)
        x = ops.embedding(token_ids, self.embed_tokens).to(self.dtype)  # [B,T,H]
        x = ops.rms_norm(x, None, cfg.rms_norm_eps)  # the embedding's weightless norm
        if media:
            x = self.splice(x, input_ids, media)
        a = ops.rms_norm(x, self.layers[0].input_layernorm, cfg.rms_norm_eps)
        return x, a, positions, rope

    # -- media ----------------------------------------------------------------------------------

    def splice(self, x: torch.Tensor, input_ids: torch.Tensor, media: Media) -> torch.Tensor:
        """``x [B,T,H]`` with each placeholder id's rows replaced by its features, in order (row-major
        over the batch, as transformers' ``masked_scatter``). Raises :class:`MediaCountError` naming
        both counts when a kind's placeholders and rows differ in number."""
        cfg = self.config
        kinds = {cfg.image_token_id: "image", cfg.video_token_id: "video", cfg.audio_token_id: "audio"}
        for token_id, rows in media.items():
            token_id = int(token_id)
            if token_id not in kinds:
                raise ValueError(f"media key {token_id} is not a placeholder id of this model (image "
                                 f"{cfg.image_token_id}, video {cfg.video_token_id}, audio {cfg.audio_token_id})")
            kind = kinds[token_id]
            mask = input_ids == token_id  # [B,T]
            count = int(mask.sum())
            if rows.dim() != 2 or rows.shape[0] != count:
                given = (f"{rows.shape[0]} {kind} feature rows were given" if rows.dim() == 2 else
                         f"{kind} features of shape {list(rows.shape)} were given (expected [rows, {x.shape[-1]}])")
                raise MediaCountError(f"the prompt has {count} {kind} placeholders ({self.token_label(token_id)}) "
                                      f"but {given}")
            if rows.shape[1] != x.shape[-1]:
                raise ValueError(f"{kind} features have width {rows.shape[1]} but the model's hidden size is "
                                 f"{x.shape[-1]}: they come from another model")
            x = x.masked_scatter(mask[..., None].to(x.device), rows.to(x.device, x.dtype))
        return x

    def token_label(self, token_id: int) -> str:
        """``"<|image|>, id 4"``: a placeholder as the tokenizer writes it and its id (the id alone without one)."""
        if self.tokenizer is not None:
            try:
                return f"{self.tokenizer.decode([token_id])}, id {token_id}"
            except Exception:  # an id the tokenizer cannot decode: the id says enough  # noqa: BLE001
                pass
        return f"id {token_id}"

    def missing_tower(self, tower: str, inputs: str) -> ValueError:
        """The error for media that needs a tower this model does not have, with the plan's reason."""
        plan = self.plan
        name = plan.model if plan is not None else "this checkpoint"
        why = getattr(plan, "towers_skipped", {}).get(tower) if plan is not None else None
        if why is None:
            why = f"the checkpoint has no {tower} tower tensors (model.{tower}_tower.*)"
        return ValueError(f"{name} cannot take {inputs}: {why}")

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Images -> feature rows ``[t*h*w/4, H]`` per image (model dtype and device): the vision tower,
        adapter, projection and weightless norm (transformers' ``get_image_features``). ``pixel_values
        [P, 3*2*14*14]`` and ``grid_thw [n, 3]`` as the image processor (``musecore.media``) makes them."""
        if self.vision is None:
            raise self.missing_tower(VISION, "images or video")
        return self.vision.features(pixel_values, grid_thw)

    def encode_videos(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Videos -> feature rows per video: the image path (transformers' ``get_video_features``)."""
        return self.encode_images(pixel_values, grid_thw)

    def encode_audio(self, input_values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Clips ``[n, L]`` of 24 kHz samples (right-padded; ``mask [n, L]`` True on real samples) ->
        ``[ceil(len_i / 1920), H]`` per clip: the audio tower, each clip's real tokens, then the text
        embedding's weightless norm (transformers' ``get_audio_features``). ``L`` that is not a multiple
        of 1920 is zero-padded to one first, as the feature extractor pads."""
        if self.audio is None:
            raise self.missing_tower(AUDIO, "audio")
        if input_values.dim() != 2:
            raise ValueError(f"input_values has shape {list(input_values.shape)}; encode_audio takes [clips, samples]")
        if mask is not None and tuple(mask.shape) != tuple(input_values.shape):
            raise ValueError(f"mask has shape {list(mask.shape)} but input_values has {list(input_values.shape)}")
        step = self.audio.samples_per_token
        pad = -input_values.shape[1] % step
        if pad:
            input_values = torch.nn.functional.pad(input_values, (0, pad))
        feats, _state = self.audio(input_values)  # [n, L/1920, H]
        if mask is None:
            counts = [feats.shape[1]] * feats.shape[0]
        else:
            counts = ((mask.sum(-1) + step - 1) // step).tolist()
        rows = torch.cat([f[:c] for f, c in zip(feats, counts)])
        rows = self.ops.rms_norm(rows, None, self.config.rms_norm_eps)  # the text embedding's weightless norm
        return list(rows.split(counts))

    def attention_sublayer(self, i: int, x: Any, a: Optional[torch.Tensor], positions: torch.Tensor, rope: Any,
                           cache: Optional[KVCache] = None, *, defer: bool = False) -> tuple[Any, Any]:
        """Layer ``i``'s attention: ``(h, m)``, the residual after it and the feed-forward input. ``x`` may be the
        layer before's :class:`DeferredNorm` (``a`` None). With ``defer``, where the backend's fused blocks hand the
        residual norm on (:class:`DeferredNorm`), ``(DeferredNorm, None)``, which :meth:`feedforward_sublayer` takes
        as its ``h`` (``forward`` defers; a caller that reads ``h`` and ``m`` does not)."""
        layer, cfg = self.layers[i], self.config
        gate = layer.post_attention_residual_gate  # weightless post-attention norm, then the gated residual
        norm = (None, gate.alpha, gate.beta, layer.pre_feedforward_layernorm, cfg.post_norm_eps, cfg.rms_norm_eps)
        return self._sublayer(layer.self_attn.fused, x, a, norm, (positions, rope, cache), defer and layer.mlp,
                              lambda a: layer.self_attn(a, positions, rope, cache))

    def feedforward_sublayer(self, i: int, h: Any, m: Optional[torch.Tensor], *,
                             observer: Optional[MoEObserver] = None, experts: Any = None, defer: bool = False
                             ) -> tuple[Any, Any]:
        """Layer ``i``'s MoE (or dense MLP): ``(x, a)``, the residual and the next layer's normed input
        (the final norm's after the last layer). ``experts`` stands in for the layer's own for this call.
        ``h`` may be :meth:`attention_sublayer`'s :class:`DeferredNorm` (``m`` None); with ``defer``, this
        sublayer's norm may be handed on to the next layer's attention the same way (``(DeferredNorm, None)``)."""
        layer, cfg = self.layers[i], self.config
        last = i + 1 == len(self.layers)
        next_norm = self.norm if last else self.layers[i + 1].input_layernorm
        gate = layer.post_feedforward_residual_gate
        norm = (layer.post_feedforward_layernorm, gate.alpha, gate.beta, next_norm, cfg.post_norm_eps, cfg.rms_norm_eps)
        fused = getattr(layer.mlp, "fused", None) if observer is None and experts is None else None
        return self._sublayer(fused, h, m, norm, (), defer and not last and self.layers[i + 1].self_attn,
                              lambda m: layer.mlp(m, observer, experts))

    def _sublayer(self, fused: Any, residual: Any, x: Optional[torch.Tensor], norm: tuple, args: tuple, then: Any,
                  block: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, Any]:
        """A sublayer: the block on ``x``, then ``residual_norm(residual, out, *norm)``, through the backend's fused
        form's ``sublayer`` where it has one (``Backend.fuse_block``). ``residual`` may be a :class:`DeferredNorm`
        (``x`` None), which a fused form that ``takes_deferred`` runs in its own first launch and anything else
        resolves first; ``then``, the block after this one (or a falsy value), is handed this sublayer's norm unrun
        where both fused forms agree."""
        sublayer = getattr(fused, "sublayer", None)
        deferred = isinstance(residual, DeferredNorm)
        if sublayer is not None and (not deferred or getattr(fused, "takes_deferred", False)):
            if then and getattr(getattr(then, "fused", None), "takes_deferred", False):
                out = sublayer(residual, norm, x, *args, defer=True)
            else:
                out = sublayer(residual, norm, x, *args)
            if out is not None:
                return (out, None) if isinstance(out, DeferredNorm) else out
        if deferred:
            residual, x = residual.resolve(self.ops)
        return self.ops.residual_norm(residual, block(x), *norm)

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """``a`` = the final RMSNorm of the residual -> soft-capped fp32 logits ``[B,T,V]``."""
        cfg = self.config
        logits = self.ops.linear(a, self.lm_head)  # lm_head is untied
        logits = self.ops.logit_softcap(logits, cfg.output_multiplier, cfg.final_logit_softcapping)  # fp32
        if self.comm is not None and self.comm.mesh.tp > 1:  # vocabulary shards -> every rank the same logits
            logits = self.comm.gather_cols(logits.reshape(-1, logits.shape[-1])).view(*logits.shape[:-1], -1)
        return logits

    __call__ = forward

    def fuse_blocks(self) -> int:
        """Ask the backend for a fused form of each attention and MoE block (``Backend.fuse_block``;
        single-process models only) and of the decode step's embedding stage (``Backend.fuse_embed``), and
        return how many blocks got one. ``api.assemble`` calls it after loading; call it again after replacing
        a block's weights (a fused block or embed whose weights were replaced falls back to the ops by itself)."""
        fuse_embed = getattr(self.backend, "fuse_embed", None)
        self.fused_embed = fuse_embed(self) if fuse_embed is not None and self.comm is None else None
        count = 0
        for layer in self.layers:
            for block in (layer.self_attn, layer.mlp):
                if isinstance(block, (Attention, MoE)):
                    block.fused = self.backend.fuse_block(block) if self.comm is None else None
                    count += block.fused is not None
        return count

    def decode_step(self, cache: KVCache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``step(ids [B,1], positions [B,1]) -> logits [B,1,V]`` for one decode step through ``cache``.

        A backend may replace the plain ``forward`` with something faster for repeated steps of one
        batch shape (the CUDA backend replays a captured CUDA graph); the numbers are the same.
        """
        step = self._static_step(cache, "decode", self.backend.make_decode_step)
        if step is not None:
            return step
        return lambda ids, positions: self.forward(ids, positions=positions, cache=cache)

    def greedy_decode_step(self, cache: KVCache) -> Optional[Any]:
        """The backend's decode step that takes its argmax tokens on the device (``Backend.make_greedy_decode_step``:
        one graph for the position update, the step and the sampling), on a static ``cache``; None where the backend
        has none (``generate()`` then samples after :meth:`decode_step`)."""
        make = getattr(self.backend, "make_greedy_decode_step", None)
        return None if make is None else self._static_step(cache, "greedy", make)

    def _static_step(self, cache: KVCache, kind: str, make: Callable[[Any, KVCache], Any]) -> Optional[Any]:
        """``make(self, cache)`` on a static cache, kept with the generation cache: captured once per kind, replayed
        by every later ``generate()`` of this shape. None on a dynamic cache or a distributed model."""
        if not cache.static or self.comm is not None:
            return None
        kept = self._generation_cache
        if kept is None or kept[1] is not cache:
            return make(self, cache)
        if kind not in kept[2]:
            kept[2][kind] = make(self, cache)
        return kept[2][kind]

    def prefill_step(self, cache: KVCache, tokens: int
                     ) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """``step(ids [B,tokens], positions [B,tokens]) -> logits [B,1,V]`` (the last position's) for a prefill of
        left-padded prompts into the rows of the static ``cache``, replayed where the backend captures it (CUDA and
        HIP graphs); None elsewhere: the caller runs ``forward(..., last_only=True)``."""
        make = getattr(self.backend, "make_prefill_step", None)
        if not cache.static or self.comm is not None or make is None:
            return None
        return make(self, cache, tokens)

    GENERATION_CACHE_ROUND = 256  # static generation caches are sized in multiples of this many tokens

    def generation_cache(self, batch: int, max_length: int, kv_format: str = "bf16") -> KVCache:
        """The KV cache for one ``generate()`` call.

        When the backend wants static caches (CUDA graphs), the cache is sized up to a multiple of
        ``GENERATION_CACHE_ROUND`` tokens and kept, with the decode step captured on it, for the next
        call of the same batch size, rounded length and KV format: that call resets it in place and
        replays the same graph instead of capturing a new one (a capture costs hundreds of decode
        steps' time). Only the last such cache is kept; ``release_generation_cache()`` frees it.
        """
        if not self.wants_static_cache:
            return self.new_cache(batch, max_length, kv_format=kv_format)
        capacity = -(-max_length // self.GENERATION_CACHE_ROUND) * self.GENERATION_CACHE_ROUND
        key = (batch, capacity, kv_format)
        kept = self._generation_cache
        if kept is not None and kept[0] == key:
            kept[1].reset()
            return kept[1]
        self._generation_cache = None  # the old cache and graph go before the new cache is allocated
        cache = self.new_cache(batch, capacity, kv_format=kv_format, static=True)
        self._generation_cache = (key, cache, {})  # the steps captured on it, by kind (decode_step and the like)
        return cache

    def generation_rows(self, batch: int) -> int:
        """The rows a ``generate()`` call of ``batch`` sequences runs: the backend's batch bucket when it compiles
        its decode step per batch shape (``batch_bucket``, e.g. TPU: a server whose batch varies then compiles a
        handful of steps, not one per batch size), else ``batch``. Extra rows are padding (position -1)."""
        bucket = getattr(self.backend, "batch_bucket", None)
        return int(bucket(batch)) if self.wants_static_cache and bucket is not None else batch

    def release_generation_cache(self) -> None:
        """Free the KV cache (and captured decode step) kept between ``generate()`` calls."""
        self._generation_cache = None

    @property
    def wants_static_cache(self) -> bool:
        return self.backend.wants_static_cache and self.comm is None  # no captured graphs across ranks yet

    def new_cache(self, batch: int, max_length: int, kv_format: str = "bf16", static: bool = False) -> KVCache:
        """A KV cache for ``batch`` sequences of up to ``max_length`` tokens each (``kv_format``: bf16 or fp8)."""
        for name, value in (("batch", batch), ("max_length", max_length)):
            if not _is_token_id(value) or value < 1:
                raise ValueError(f"new_cache: {name} must be an int >= 1; got {value!r}")
        batch, max_length = operator.index(batch), operator.index(max_length)
        return KVCache(self.config, batch, max_length, kv_format=kv_format, dtype=self.dtype, device=self.device,
                       static=static, writer=self.backend.kv_write, num_kv_heads=self.layers[0].self_attn.nkv,
                       row_writer=getattr(self.backend, "kv_write_row", None))

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """str -> str, list[int] -> list[int], or a batch of either; see :func:`musecore.generate.generate`."""
        from musecore.generate import generate
        if self.comm is not None and kwargs.get("seed") is None:
            # Every rank must draw the same samples: rank 0's seed. Broadcast whatever the temperature (a greedy
            # step ignores it): a broadcast on some ranks only would pair with another collective on the rest,
            # before generate's check that the ranks were asked the same thing could say so.
            import random
            kwargs["seed"] = self.comm.broadcast_int(random.getrandbits(62))
        return generate(self, prompt, **kwargs)

    def chat(self, messages: Any, **kwargs: Any) -> str:
        """The assistant's reply to ``messages`` through the checkpoint's chat template; ``stream=fn``
        gets the text as it comes; see :func:`musecore.chat.chat`."""
        from musecore.chat import chat
        return chat(self, messages, **kwargs)

    def chat_stream(self, messages: Any, **kwargs: Any) -> Any:
        """``chat`` as an iterator of text pieces; see :func:`musecore.chat.chat_stream`."""
        from musecore.chat import chat_stream
        return chat_stream(self, messages, **kwargs)

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds for its weights (not the KV cache), found by walking its
        layers: what one rank of a distributed model really keeps, for comparison with its plan."""
        seen, total, stack = set(), 0, [self.embed_tokens, self.norm, self.lm_head, *self.layers, self.vision, self.audio]
        while stack:
            obj = stack.pop()
            if obj is None or id(obj) in seen or isinstance(obj, (int, float, str, bool)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                total += obj.numel() * obj.element_size()
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif hasattr(obj, "__dict__"):
                stack.extend(v for k, v in vars(obj).items() if k not in ("ops", "comm", "inv_freq"))
        return total

    # -- where checkpoint tensors go --------------------------------------------------------------

    def weight_slots(self) -> dict[str, Slot]:
        """Checkpoint tensor name (transformers' layout, MODEL.md section 3) -> slot.

        Routed experts are listed under their fused names (``experts.gate_up_proj`` / ``down_proj``);
        the loader also takes producers' per-expert keys for them (:func:`musecore.loader.expert_key`).
        The vision and audio towers' tensors are listed when the plan loaded them (``self.vision`` /
        ``self.audio``); the loader skips the tensors of a tower that was not loaded.
        """
        slots = {PREFIX + "embed_tokens.weight": Slot(self, "embed_tokens", "embedding"),
                 PREFIX + "norm.weight": Slot(self, "norm", "vector"),
                 "lm_head.weight": Slot(self, "lm_head", "linear")}
        for i, layer in enumerate(self.layers):
            p, attn, mlp = f"{PREFIX}layers.{i}.", layer.self_attn, layer.mlp
            for name in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                slots[f"{p}{name}.weight"] = Slot(layer, name, "centered", i)
            for name in ("post_attention_residual_gate", "post_feedforward_residual_gate"):
                slots[f"{p}{name}.gate"] = Slot(layer, name, "residual_gate", i)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"):
                slots[f"{p}self_attn.{name}.weight"] = Slot(attn, name, "linear", i, name in attn.INPUT_PROJECTIONS)
            if isinstance(mlp, DenseMLP):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    slots[f"{p}mlp.{name}.weight"] = Slot(mlp, name, "linear", i, name in mlp.INPUT_PROJECTIONS)
                continue
            slots[f"{p}mlp.gate.weight"] = Slot(mlp, "router", "router", i)
            slots[f"{p}mlp.gate.e_score_correction_bias"] = Slot(mlp, "correction_bias", "router_bias", i)
            for name in ("pre_expert_proj", "post_expert_proj"):
                slots[f"{p}mlp.{name}.weight"] = Slot(mlp, name, "linear", i)
            slots[f"{p}mlp.pre_expert_norm.weight"] = Slot(mlp, "pre_expert_norm", "centered", i)
            slots[f"{p}mlp.experts.post_expert_norm.weight"] = Slot(mlp, "post_expert_norm", "centered", i)
            for name in FUSED_EXPERT_TENSORS:
                slots[f"{p}mlp.experts.{name}"] = Slot(mlp, name, "experts", i)
        for tower in (self.vision, self.audio):
            if tower is not None:
                slots.update({name: Slot(owner, attr, role) for name, (owner, attr, role) in tower.weights().items()})
        return slots


def checkpoint_shapes(config: MuseConfig) -> dict[str, tuple[int, ...]]:
    """The logical shape of every text-decoder tensor of a Muse Spark checkpoint (transformers' layout)."""
    H, V, d = config.hidden_size, config.vocab_size, config.head_dim
    nq, nkv, E = config.num_attention_heads, config.num_key_value_heads, config.num_local_experts
    h, inter = config.moe_hidden_size, config.moe_intermediate_size
    shapes = {PREFIX + "embed_tokens.weight": (V, H), PREFIX + "norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        p = f"{PREFIX}layers.{i}."
        for name in ("input_layernorm.weight", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                     "post_attention_residual_gate.gate", "post_feedforward_residual_gate.gate"):
            shapes[p + name] = (H,)
        shapes.update({p + "self_attn.q_proj.weight": (nq * d, H), p + "self_attn.k_proj.weight": (nkv * d, H),
                       p + "self_attn.v_proj.weight": (nkv * d, H), p + "self_attn.o_proj.weight": (H, nq * d),
                       p + "self_attn.gate_proj.weight": (nq * d, H)})
        if not config.is_sparse(i):
            I = config.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
            continue
        shapes.update({p + "mlp.gate.weight": (E, H), p + "mlp.gate.e_score_correction_bias": (E,),
                       p + "mlp.pre_expert_proj.weight": (h, H), p + "mlp.pre_expert_norm.weight": (h,),
                       p + "mlp.experts.gate_up_proj": (E, 2 * inter, h), p + "mlp.experts.down_proj": (E, h, inter),
                       p + "mlp.experts.post_expert_norm.weight": (h,), p + "mlp.post_expert_proj.weight": (H, h)})
    return shapes


def initial_value(name: str, shape: tuple[int, ...], generator: torch.Generator, std: float = 0.02,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor initialised as transformers' ``_init_weights`` does, in fp32: projections, experts,
    router and residual gates normal(0, std), centred norms 0, the final norm 1, the correction bias 0."""
    if name == PREFIX + "norm.weight":
        return torch.ones(shape, device=device)
    if name.endswith("e_score_correction_bias") or (len(shape) == 1 and name.endswith("norm.weight")):
        return torch.zeros(shape, device=device)
    return torch.randn(shape, generator=generator, device=device) * std


def init_weights(config: MuseConfig, seed: int = 0, std: float = 0.02,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random text-decoder weights (:func:`initial_value`); the residual gates, router and correction
    bias in fp32, as transformers keeps them, everything else in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return {name: initial_value(name, shape, gen, std).to(torch.float32 if is_fp32_tensor(name) else dtype)
            for name, shape in checkpoint_shapes(config).items()}
