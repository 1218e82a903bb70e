"""The conformance cases: every op x weight format x shapes taken from the model presets.

A case is a small frozen description (op, preset size, variant, formats, dimensions); its inputs
are built from it deterministically (``musecore.testing.inputs``), seeded by the case id, so a
backend package, the reference and the accuracy matrix all see the same numbers.

Shapes come from the presets, not from a list typed here: ``tiny`` is ``muse-tiny``, ``small`` is
``muse-small`` and ``816b`` is the full model's layer (q and the attention gate 8192->8192, k/v
8192->1024, o 8192->8192, router 8192->256, pooler 8192->4096, unpooler 4096->8192, experts'
gate_up 4096->8192 and down 4096->4096), always at small token counts. Tensors that would be large without testing anything
more (an lm_head or embedding with the full vocabulary, all 256 experts) keep their real widths
with fewer rows or experts; the case's ``note`` says so. The ``816b`` cases need a few GiB of
memory and seconds each on a CPU; select sizes with ``MUSECORE_CONFORMANCE_SIZES`` or ``sizes=``.

The towers' ops (``musecore.ops.TOWER_OPS``) take their sizes from the preset's ``vision_config`` and
``audio_config`` (:func:`tower_cases`; ``816b`` = transformers' defaults: vision hidden 1536, 16 heads of
96, a 1024-token 32x32-patch window and packed segments of odd, one-token and empty lengths; audio
widths 256..2048, kernel 7, odd lengths and streaming chunks with a state).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence

import torch

from musecore.config import MuseConfig
from musecore.ops import OPS, OpSpec

SIZES: dict[str, str] = {"tiny": "muse-tiny", "small": "muse-small", "816b": "muse-spark-open-816b-a42b"}
SIZES_ENV = "MUSECORE_CONFORMANCE_SIZES"

# (weight format, activation format) pairs that linear and moe are checked in: every weight format
# weight-only, plus the activation quantization the catalog's targets apply (W8A8 FP8 static and per
# token, W8A8 INT8 per token, W4A4 FP4).
MATMUL_FORMATS: tuple[tuple[str, Optional[str]], ...] = (
    ("bf16", None), ("fp8", None), ("fp8", "fp8"), ("fp8", "fp8-token"), ("int8", None), ("int8", "int8-token"),
    ("nvfp4", None), ("nvfp4", "nvfp4"), ("mxfp4", None), ("mxfp4", "mxfp4"), ("int4", None))

# How many experts a moe case holds, and how many of a preset's vocabulary rows an embedding /
# lm_head / sample case uses: the real widths with fewer rows, so a CPU run stays in memory.
MAX_EXPERTS = {"tiny": None, "small": 8, "816b": 3}
MAX_TOP_K = {"tiny": None, "small": 4, "816b": 2}
MAX_VOCAB_ROWS = {"tiny": None, "small": 8192, "816b": 2048}


@dataclass(frozen=True)
class ConformanceCase:
    """One op on one shape in one format; ``id`` names it in test ids and reports.

    ``dims`` holds the op's sizes (e.g. ``in``, ``out``, ``tokens`` for linear); ``options`` the
    variant's switches (window, padding, KV scales...). Both are tuples of pairs so a case hashes.
    """

    op: str
    size: str
    variant: str
    weight_format: str = "bf16"
    act_format: Optional[str] = None
    kv_format: str = "bf16"
    dims: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    @property
    def id(self) -> str:
        fmt = ""
        if self.op in ("linear", "moe"):
            fmt = f"-{self.weight_format}" + (f"-a{self.act_format}" if self.act_format else "")
        elif self.op == "attention":
            fmt = f"-kv{self.kv_format}"
        return f"{self.op}-{self.size}-{self.variant}{fmt}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def spec(self, dtype: torch.dtype = torch.bfloat16, device: str = "") -> OpSpec:
        """The :class:`~musecore.ops.OpSpec` a backend's ``supports`` is asked about."""
        return OpSpec(self.op, weight_format=self.weight_format, act_format=self.act_format, dtype=dtype,
                      kv_format=self.kv_format, shape=self.dims, device=device)


@lru_cache(maxsize=None)
def preset(size: str) -> MuseConfig:
    if size not in SIZES:
        raise ValueError(f"unknown conformance size {size!r}; choose from {list(SIZES)}")
    return MuseConfig.from_name(SIZES[size])


def projection_shapes(size: str) -> dict[str, tuple[int, int]]:
    """Every linear projection of one layer of the preset: role -> (in_features, out_features)."""
    c = preset(size)
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, inter = c.moe_hidden_size, c.moe_intermediate_size
    shapes = {"q_proj": (H, q), "kv_proj": (H, kv), "o_proj": (q, H), "gate_proj": (H, q),
              "pooler": (H, h), "unpooler": (h, H), "expert_gate_up": (h, 2 * inter), "expert_down": (inter, h)}
    if MAX_VOCAB_ROWS[size] is None:
        shapes["lm_head"] = (H, c.vocab_size)
    return shapes


def _dims(**kw: int) -> tuple[tuple[str, int], ...]:
    return tuple(kw.items())


def _opts(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(kw.items())


def _vocab(size: str) -> tuple[int, str]:
    V, cap = preset(size).vocab_size, MAX_VOCAB_ROWS[size]
    if cap is None or V <= cap:
        return V, ""
    return cap, f"{cap} of the preset's {V} vocabulary rows"


def linear_cases(size: str) -> list[ConformanceCase]:
    out = []
    for role, (k, n) in projection_shapes(size).items():
        for fmt, act in MATMUL_FORMATS:
            out.append(ConformanceCase("linear", size, role, fmt, act, dims=_dims(tokens=5, **{"in": k, "out": n})))
            if role in ("q_proj", "expert_down"):  # decode: one token, the GEMV path of most kernels
                out.append(ConformanceCase("linear", size, f"{role}-decode", fmt, act,
                                           dims=_dims(tokens=1, **{"in": k, "out": n})))
    return out


def moe_cases(size: str) -> list[ConformanceCase]:
    c = preset(size)
    E = min(c.num_experts, MAX_EXPERTS[size] or c.num_experts)
    k = min(c.num_experts_per_tok, MAX_TOP_K[size] or c.num_experts_per_tok, E)
    note = f"{E} of the preset's {c.num_experts} experts, top-{k}" if E < c.num_experts else ""
    dims = dict(experts=E, top_k=k, moe_hidden=c.moe_hidden_size, intermediate=c.moe_intermediate_size)
    out = [ConformanceCase("moe", size, "prefill", fmt, act, dims=_dims(tokens=6, **dims), note=note)
           for fmt, act in MATMUL_FORMATS]
    out += [ConformanceCase("moe", size, "decode", fmt, act, dims=_dims(tokens=1, **dims), note=note)
            for fmt, act in (("bf16", None), ("nvfp4", None), ("mxfp4", "mxfp4"), ("int4", None))]
    return out


def attention_cases(size: str) -> list[ConformanceCase]:
    """Prefill and decode, full and sliding windows, GQA as in the preset, left padding, empty
    (-1) cache slots, ring-buffer order, BF16 and FP8 KV with non-unit per-tensor scales."""
    c = preset(size)
    heads = dict(q_heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
    window = 8  # short enough that 12-token prefills and 24-position decodes cross it
    variants = [  # cache: none (keys are the new tokens), linear (full layer), ring (sliding layer)
        ("prefill-full", dict(batch=2, tokens=12, cached=0), dict(window=None)),
        ("prefill-sliding", dict(batch=2, tokens=12, cached=0), dict(window=window)),
        ("prefill-leftpad", dict(batch=2, tokens=12, cached=0), dict(window=None, left_pad=(0, 4))),
        ("prefill-leftpad-sliding", dict(batch=2, tokens=12, cached=0), dict(window=window, left_pad=(3, 0))),
        ("decode-full-emptyslots", dict(batch=2, tokens=1, cached=24),
         dict(window=None, cache="linear", next_position=(19, 24))),
        ("decode-sliding-ring", dict(batch=2, tokens=1, cached=window),
         dict(window=window, cache="ring", next_position=(4, 29))),
        ("prefill-chunk-sliding", dict(batch=1, tokens=4, cached=window),
         dict(window=window, cache="ring", next_position=(13,))),
    ]
    out = []
    for kv_format in ("bf16", "fp8"):
        for name, dims, opts in variants:
            if kv_format == "fp8":
                opts = {**opts, "k_scale": 0.5, "v_scale": 0.25}
            out.append(ConformanceCase("attention", size, name, kv_format=kv_format,
                                       dims=_dims(**dims, **heads), options=_opts(**opts)))
    return out


def elementwise_cases(size: str) -> list[ConformanceCase]:
    c = preset(size)
    H, d, nq, nkv, h = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.moe_hidden_size
    V, vnote = _vocab(size)
    out = [ConformanceCase("rms_norm", size, name, dims=_dims(batch=2, tokens=5, width=w), options=_opts(**opts))
           for name, w, opts in (("hidden", H, dict(weight=True)), ("hidden-weightless", H, dict(weight=False)),
                                 ("moe_hidden", h, dict(weight=True)),
                                 ("moe_hidden-scale_first", h, dict(weight=True, scale_first=True)))]
    out += [ConformanceCase("residual_norm", size, name, dims=_dims(batch=2, tokens=5, width=H),
                            options=_opts(post_weight=post)) for name, post in (("post_attention", False),
                                                                                ("post_feedforward", True))]
    for name, rope in (("rope", True), ("nope", False)):
        out.append(ConformanceCase("qk_norm_rope", size, name,
                                   dims=_dims(batch=2, tokens=5, q_heads=nq, kv_heads=nkv, head_dim=d),
                                   options=_opts(rope=rope, start=1000)))
    out.append(ConformanceCase("head_norm_gate", size, "heads", dims=_dims(batch=2, tokens=5, q_heads=nq, head_dim=d)))
    out.append(ConformanceCase("embedding", size, "table", dims=_dims(batch=2, tokens=7, vocab=V, width=H), note=vnote))
    for name, bias in (("bias", True), ("tiebreak_only", False)):
        out.append(ConformanceCase("router_topk", size, name,
                                   dims=_dims(tokens=6, width=H, experts=c.num_experts, top_k=c.num_experts_per_tok),
                                   options=_opts(bias=bias, scaling=2.5)))
    out.append(ConformanceCase("silu_mul", size, "experts", dims=_dims(tokens=5, width=c.moe_intermediate_size)))
    out.append(ConformanceCase("logit_softcap", size, "logits", dims=_dims(batch=2, tokens=3, vocab=V), note=vnote))
    for name, opts in (("greedy", dict(temperature=0.0, top_k=0, top_p=1.0)),
                       ("top_k1", dict(temperature=0.8, top_k=1, top_p=1.0)),
                       ("top_p-min", dict(temperature=1.0, top_k=0, top_p=1e-9))):
        out.append(ConformanceCase("sample", size, name, dims=_dims(batch=3, vocab=c.vocab_size), options=_opts(**opts)))
    return out


# Packed segment lengths of the varlen_attention cases: odd lengths, a one-patch segment and an empty one
# around real images (a 224x224 image is 16x16 = 256 patches); "window" is one 32x32-patch window
# (448x448 pixels, 1024 tokens), the unit of the towers' window attention, at the presets that run big.
PACKED_SEGMENTS = {"tiny": (64, 1, 37, 0, 23), "small": (256, 1, 0, 77, 130), "816b": (256, 1, 0, 77, 130, 513)}
WINDOW_SEGMENTS = {"tiny": None, "small": (1024,), "816b": (1024,)}


def tower_cases(size: str) -> list[ConformanceCase]:
    """The vision and audio towers' ops (``musecore.ops.TOWER_OPS``) at the preset's tower sizes: vision
    hidden, heads and head dim (816b: 1536, 16, 96), its MLP, adapter and projector widths; every audio
    stage width (816b: 256..2048) with the conv kernel, odd lengths and streaming chunks with a state."""
    c = preset(size)
    vc, ac = c.vision_config, c.audio_config
    H, heads = vc["hidden_size"], vc["num_attention_heads"]
    d = H // heads
    audio_mlp = int(ac["hidden_sizes"][-1] * ac["mlp_ratio"])
    out = [ConformanceCase("layer_norm", size, name, dims=_dims(tokens=37, width=H),
                           options=_opts(affine=affine, eps=vc["layer_norm_eps"]))
           for name, affine in (("vision", True), ("vision-plain", False))]
    out += [ConformanceCase("gelu", size, name, dims=_dims(tokens=9, width=w), options=_opts(approximate=approx))
            for name, w, approx in (("vision_mlp", vc["intermediate_size"], "none"),
                                    ("adapter", c.projector_hidden_size, "none"),
                                    ("audio_mlp", audio_mlp, "none"),
                                    ("vision_mlp-tanh", vc["intermediate_size"], "tanh"))]
    segments = [("packed", PACKED_SEGMENTS[size])]
    if WINDOW_SEGMENTS[size]:
        segments.append(("window", WINDOW_SEGMENTS[size]))
    for name, lengths in segments:
        out.append(ConformanceCase("varlen_attention", size, name,
                                   dims=_dims(tokens=sum(lengths), heads=heads, head_dim=d),
                                   options=_opts(segments=lengths)))
    K = ac["conv_kernel_size"]
    for C in sorted(set(ac["hidden_sizes"])):
        out.append(ConformanceCase("causal_conv1d", size, f"w{C}", dims=_dims(batch=2, channels=C, time=37, kernel=K),
                                   options=_opts(layout="btc", state=False)))
    widest = max(ac["hidden_sizes"])
    for name, T in (("stream-chunk", max(1, K - 2)), ("stream-token", 1), ("stream-long", 29)):
        out.append(ConformanceCase("causal_conv1d", size, f"w{widest}-{name}",
                                   dims=_dims(batch=2, channels=widest, time=T, kernel=K),
                                   options=_opts(layout="btc", state=True)))
    out.append(ConformanceCase("causal_conv1d", size, f"w{widest}-bct-nobias",
                               dims=_dims(batch=1, channels=widest, time=11, kernel=K),
                               options=_opts(layout="bct", state=True, bias=False)))
    for name, table in (("vision", "fp32"), ("vision-table16", "activation")):  # transformers hands bf16 tables
        out.append(ConformanceCase("rope", size, name, dims=_dims(tokens=37, heads=heads, head_dim=d),
                                   options=_opts(theta=vc["rope_parameters"]["rope_theta"], table=table)))
    return out


def selected_sizes(sizes: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """``sizes`` if given, else ``$MUSECORE_CONFORMANCE_SIZES`` (comma-separated), else all."""
    if sizes is None:
        env = os.environ.get(SIZES_ENV, "").strip()
        sizes = [s.strip() for s in env.split(",") if s.strip()] if env else list(SIZES)
    sizes = tuple(sizes)
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise ValueError(f"unknown conformance size(s) {unknown} (from sizes= or ${SIZES_ENV}); "
                         f"choose from {list(SIZES)}")
    return sizes


def conformance_cases(sizes: Optional[Iterable[str]] = None, ops: Optional[Sequence[str]] = None,
                      formats: Optional[Sequence[str]] = None) -> list[ConformanceCase]:
    """Every case for the given preset ``sizes`` (default: ``selected_sizes()``), optionally only
    some ``ops`` and, for linear/moe, some weight ``formats``.

    Example::

        cases = conformance_cases(sizes=["tiny"], ops=["linear"], formats=["nvfp4"])
    """
    unknown = sorted(set(ops or ()) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; the operator interface has {list(OPS)}")
    out: list[ConformanceCase] = []
    for size in selected_sizes(sizes):
        out += (elementwise_cases(size) + attention_cases(size) + linear_cases(size) + moe_cases(size)
                + tower_cases(size))
    if ops is not None:
        out = [c for c in out if c.op in ops]
    if formats is not None:
        out = [c for c in out if c.op not in ("linear", "moe") or c.weight_format in formats]
    return out
