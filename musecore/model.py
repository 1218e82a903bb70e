"""The Muse Spark Open text backbone, exactly as MODEL.md section 1 defines it.

Every computation goes through ``self.ops`` (the operator interface, bound to backends by the
plan); nothing here knows which device runs it. Weights are filled in by the loader
(``musecore/loader.py``) through :meth:`MuseModel.weight_slots`, already in each backend's
resident layout. Read :class:`MoE.__call__` for the MoE order of operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from musecore.config import FULL, SLIDING, MuseConfig
from musecore.kv_cache import KVCache
from musecore.ops import Ops
from musecore.rope import RotaryTable

PREFIX = "model.language_model."


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

    def __call__(self, ops: Ops, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ops.linear(x, self.weight).split(self.widths, dim=-1)


def project(owner: Any, ops: Ops, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``owner.INPUT_PROJECTIONS`` applied to ``x``: through the fused weight when the loader made one."""
    if owner.in_proj is not None:
        return owner.in_proj(ops, x)
    return tuple(ops.linear(x, getattr(owner, name)) for name in owner.INPUT_PROJECTIONS)


class Attention:
    """GQA with q/k norm + RoPE, sliding or full window, per-head output norm and sigmoid gate."""

    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj")  # all read the normed input ``a``

    def __init__(self, config: MuseConfig, layer: int, ops: Ops) -> None:
        self.ops, self.layer = ops, layer
        self.nq, self.nkv, self.d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.window, self.eps, self.scale = config.window(layer), config.rms_norm_eps, config.head_dim ** -0.5
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = self.gate_proj = None
        self.q_norm = self.k_norm = self.o_norm = None
        self.in_proj: Optional[FusedLinear] = None  # q/k/v/gate as one linear, when the loader fused them

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 cache: Optional[KVCache]) -> torch.Tensor:
        ops = self.ops
        B, T, _ = a.shape
        q, k, v, gate = project(self, ops, a)  # gate: [B,T,nq], one gate per head
        q, k, v = q.view(B, T, self.nq, self.d), k.view(B, T, self.nkv, self.d), v.view(B, T, self.nkv, self.d)
        q, k = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, rope[0], rope[1], self.eps)
        if cache is None:
            keys, values, key_pos, k_scale, v_scale = k, v, positions, None, None
        else:
            layer_cache = cache[self.layer]
            k, v = layer_cache.encode(k, v)
            view = layer_cache.update(k, v, positions)
            keys, values, key_pos, k_scale, v_scale = view.k, view.v, view.positions, view.k_scale, view.v_scale
        o = ops.attention(q, keys, values, positions, key_pos, self.window, self.scale, k_scale, v_scale)
        o = ops.head_norm_gate(o, self.o_norm, gate, self.eps)  # [B,T,nq,d]
        return ops.linear(o.reshape(B, T, self.nq * self.d), self.o_proj)  # [B,T,H]


class MoE:
    """Router over the full width; pooler H->l; SwiGLU experts; per-expert norm; unpooler l->H."""

    INPUT_PROJECTIONS = ("router", "fc1_latent_proj")  # both read the MoE input ``m``

    def __init__(self, config: MuseConfig, layer: int, ops: Ops) -> None:
        self.ops, self.layer = ops, layer
        self.top_k, self.renormalize, self.eps = config.num_experts_per_tok, config.norm_topk_prob, config.rms_norm_eps
        self.router = self.fc1_latent_proj = self.fc2_latent_proj = None
        self.latent_norm = None
        self.in_proj: Optional[FusedLinear] = None  # router + pooler as one linear, when the loader fused them
        self.experts = None       # ExpertWeights: stacked gate/up/down in the backend's layout
        self.output_norm = None   # [E, l]: each expert's own RMSNorm weight

    def __call__(self, m: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        B, T, H = m.shape
        m = m.reshape(B * T, H)
        weights, ids, z = self.route(m)
        y = ops.moe(z, weights, ids, self.experts, self.output_norm, self.eps)  # [N,l] fp32: norm, weight, sum
        u = ops.linear(y.to(m.dtype), self.fc2_latent_proj)  # [N,H] unpooler
        return u.view(B, T, H)

    def route(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``m [N,H]`` -> routing weights ``[N,k]`` fp32, expert ids ``[N,k]``, pooled and normed latents ``[N,l]``."""
        logits, pooled = project(self, self.ops, m)
        weights, ids = self.ops.router_topk(logits, self.top_k, self.renormalize)
        return weights, ids, self.ops.rms_norm(pooled, self.latent_norm, self.eps)


class DecoderLayer:
    def __init__(self, config: MuseConfig, layer: int, ops: Ops) -> None:
        self.layer_type = config.layer_types[layer]
        self.self_attn, self.mlp = Attention(config, layer, ops), MoE(config, layer, ops)
        self.input_layernorm = self.post_attention_layernorm = self.pre_feedforward_layernorm = None
        self.post_feedforward_layernorm = self.attn_residual_gate = self.ffn_residual_gate = None


@dataclass
class Slot:
    """Where a checkpoint tensor goes: ``owner.attr``, and how the backend must prepare it."""

    owner: Any
    attr: str
    role: str   # "linear", "embedding", "vector" (norms, gates), "expert" (collected, then stacked)
    layer: int = -1
    fused: bool = False  # one of ``owner.INPUT_PROJECTIONS``: the loader may fuse it into ``owner.in_proj``


class MuseModel:
    """The text backbone. ``model.forward(ids)`` -> logits ``[B,T,V]`` fp32.

    Example::

        model = musecore.load("muse-tiny")
        logits = model.forward(torch.tensor([[1, 2, 3]]))
    """

    def __init__(self, config: MuseConfig, ops: Ops, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        self.config, self.ops, self.dtype, self.device = config, ops, dtype, torch.device(device)
        self.layers = [DecoderLayer(config, i, ops) for i in range(config.num_hidden_layers)]
        self.rope = {kind: RotaryTable(config.head_dim, config.rope_parameters[kind], config.max_position_embeddings,
                                       device=self.device) for kind in (SLIDING, FULL)}
        self.backend = None    # the plan's main backend; it may offer a faster decode step
        self.embed_tokens = self.norm = self.lm_head = None
        self.plan = None       # set by musecore.load
        self.tokenizer = None  # set by musecore.load when the checkpoint has tokenizer.json
        self.conversion_report: list = []  # per-tensor error of every conversion done while loading
        self.kv_format = "bf16"
        self.last_generation_stats = None  # set by generate()
        # The last static generation cache and the decode step captured on it, kept for the next
        # generate() call of the same shape: (batch, capacity, kv_format), cache, step or None.
        self._generation_cache: Optional[tuple[tuple, KVCache, Optional[Callable]]] = None

    # -- the computation --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        """Logits for every position. ``positions [B,T]`` default to ``0..T-1`` after what the
        cache holds; ``-1`` marks a padding token (it attends to nothing and nothing attends to it)."""
        ops, cfg = self.ops, self.config
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if positions is None:
            start = cache.next_position[:, None] if cache is not None else 0
            positions = start + torch.arange(T, device=self.device)[None, :].expand(B, T)
        positions = positions.to(self.device)
        if cache is not None:  # in place: a captured decode step keeps updating the same tensor
            last = positions[:, 0] if T == 1 else positions.max(-1).values  # (no reduction kernel at decode)
            cache.next_position.copy_(torch.maximum(cache.next_position, last + 1))
        rope = {kind: table(positions) for kind, table in self.rope.items()}

        x = ops.embedding(input_ids, self.embed_tokens).to(self.dtype)  # [B,T,H], not scaled
        a = ops.rms_norm(x, self.layers[0].input_layernorm, cfg.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            attn_out = layer.self_attn(a, positions, rope[layer.layer_type], cache)
            h, m = ops.residual_norm(x, attn_out, layer.post_attention_layernorm, layer.attn_residual_gate,
                                     layer.pre_feedforward_layernorm, cfg.rms_norm_eps)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, a = ops.residual_norm(h, layer.mlp(m), layer.post_feedforward_layernorm, layer.ffn_residual_gate,
                                     next_norm, cfg.rms_norm_eps)
        return ops.linear(a, self.lm_head).float()  # a = final RMSNorm(x); lm_head is untied

    __call__ = forward

    def decode_step(self, cache: KVCache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``step(ids [B,1], positions [B,1]) -> logits [B,1,V]`` for one decode step through ``cache``.

        A backend may replace the plain ``forward`` with something faster for repeated steps of one
        batch shape (the CUDA backend replays a captured CUDA graph); the numbers are the same.
        """
        make = getattr(self.backend, "make_decode_step", None)
        if make is not None and cache.static:
            kept = self._generation_cache
            if kept is not None and kept[1] is cache:
                if kept[2] is None:  # captured once, replayed by every later generate() of this shape
                    self._generation_cache = (kept[0], cache, make(self, cache))
                return self._generation_cache[2]
            return make(self, cache)
        return lambda ids, positions: self.forward(ids, positions=positions, cache=cache)

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
        self._generation_cache = (key, cache, None)
        return cache

    def release_generation_cache(self) -> None:
        """Free the KV cache (and captured decode step) kept between ``generate()`` calls."""
        self._generation_cache = None

    @property
    def wants_static_cache(self) -> bool:
        return bool(getattr(self.backend, "wants_static_cache", False))

    def new_cache(self, batch: int, max_length: int, kv_format: str = "bf16", static: bool = False) -> KVCache:
        return KVCache(self.config, batch, max_length, kv_format=kv_format, dtype=self.dtype, device=self.device,
                       static=static, writer=getattr(self.backend, "kv_write", None))

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """str -> str, list[int] -> list[int], or a batch of either; see :func:`musecore.generate.generate`."""
        from musecore.generate import generate
        return generate(self, prompt, **kwargs)

    # -- where checkpoint tensors go --------------------------------------------------------------

    def weight_slots(self) -> dict[str, Slot]:
        """Checkpoint tensor name (MODEL.md section 3) -> slot. Expert tensors are listed per expert."""
        slots = {PREFIX + "embed_tokens.weight": Slot(self, "embed_tokens", "embedding"),
                 PREFIX + "norm.weight": Slot(self, "norm", "vector"),
                 "lm_head.weight": Slot(self, "lm_head", "linear")}
        for i, layer in enumerate(self.layers):
            p, attn, mlp = f"{PREFIX}layers.{i}.", layer.self_attn, layer.mlp
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                slots[f"{p}{name}.weight"] = Slot(layer, name, "vector", i)
            for name in ("attn_residual_gate", "ffn_residual_gate"):
                slots[f"{p}{name}"] = Slot(layer, name, "vector", i)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"):
                slots[f"{p}self_attn.{name}.weight"] = Slot(attn, name, "linear", i, name in attn.INPUT_PROJECTIONS)
            for name in ("q_norm", "k_norm", "o_norm"):
                slots[f"{p}self_attn.{name}.weight"] = Slot(attn, name, "vector", i)
            for name in ("router", "fc1_latent_proj", "fc2_latent_proj"):
                slots[f"{p}mlp.{name}.weight"] = Slot(mlp, name, "linear", i, name in mlp.INPUT_PROJECTIONS)
            slots[f"{p}mlp.latent_norm.weight"] = Slot(mlp, "latent_norm", "vector", i)
            for e in range(self.config.num_experts):
                for name in ("gate_proj", "up_proj", "down_proj", "output_norm"):
                    slots[f"{p}mlp.experts.{e}.{name}.weight"] = Slot(mlp, name, "expert", i)
        return slots


def checkpoint_shapes(config: MuseConfig) -> dict[str, tuple[int, ...]]:
    """The logical shape of every tensor of a Muse checkpoint (MODEL.md section 3)."""
    H, V, d = config.hidden_size, config.vocab_size, config.head_dim
    nq, nkv, E = config.num_attention_heads, config.num_key_value_heads, config.num_experts
    l, inter = config.moe_latent_size, config.moe_intermediate_size
    shapes = {PREFIX + "embed_tokens.weight": (V, H), PREFIX + "norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        p = f"{PREFIX}layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "attn_residual_gate",
                     "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", "ffn_residual_gate"):
            shapes[p + name] = (H,)
        shapes.update({p + "self_attn.q_proj.weight": (nq * d, H), p + "self_attn.k_proj.weight": (nkv * d, H),
                       p + "self_attn.v_proj.weight": (nkv * d, H), p + "self_attn.o_proj.weight": (H, nq * d),
                       p + "self_attn.gate_proj.weight": (nq, H), p + "self_attn.q_norm.weight": (d,),
                       p + "self_attn.k_norm.weight": (d,), p + "self_attn.o_norm.weight": (d,),
                       p + "mlp.router.weight": (E, H), p + "mlp.fc1_latent_proj.weight": (l, H),
                       p + "mlp.latent_norm.weight": (l,), p + "mlp.fc2_latent_proj.weight": (H, l)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (inter, l), q + "up_proj.weight": (inter, l),
                           q + "down_proj.weight": (l, inter), q + "output_norm.weight": (l,)})
    return shapes


def init_weights(config: MuseConfig, seed: int = 0, std: float = 0.02,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights for a checkpoint written from MODEL.md alone: norms and residual gates are
    ones (their initialisation), projections normal(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * std).to(dtype)
    return tensors
