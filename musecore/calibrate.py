"""Calibration on the Muse graph: what the router sends each expert, AutoRound INT4 from it, and
the static activation scales of W4A4 (NVFP4) checkpoints.

``musecore_quant.convert(..., method="autoround")`` tunes weights on activations, which needs the
model graph; ``musecore_quant`` knows no graph (DESIGN.md), so it takes a
``calibrated_quantizer(name, fp32 weight) -> QTensor`` and this module provides one.

An expert only ever sees the pooled latents ``z`` (``pre_expert_norm(pre_expert_proj(m))``, width
``moe_hidden_size``) of the tokens the router picked for it; its output goes through the layer's
shared post-expert norm and is weighted by its routing weight (MODEL.md section 1). So that is
what each expert is calibrated on:

1. :class:`LayerwiseRun` runs ``MuseModel.forward``'s own stages (``embed``, then per layer
   ``attention_sublayer`` and ``feedforward_sublayer``, then ``logits``) one decoder layer at a time
   (a test checks it gives ``model.forward``'s logits, bit for bit on the same batch), so calibration
   can act between layers and later layers see earlier layers' (quantized) outputs.
2. At each sparse (MoE) layer the routing is observed through the model's ``observer`` argument
   (:data:`musecore.model.MoEObserver`; the model is not modified): the ``z``, routing weights and
   expert ids that ``MoE.__call__`` computed are recorded, and each expert keeps at most ``max_tokens`` of its routed rows
   (:func:`routed_inputs`, a seeded random subset when it got more; up to as many of the rows left
   out measure the tuned expert off its tuning set, in the report).
3. :class:`AutoRoundQuantizer` tunes each routed expert of the quantized layers (the sparse layers
   but ``config.bf16_expert_layers``, by default) with auto-round
   (``musecore/autoround.py``), then continues with the quantized experts in place, as auto-round
   does with its own blocks (``propagate_quantized``). An expert that received no calibration token
   is quantized with RTN and counted in the report (``rtn_fallback``).

The quantizer answers for the names ``convert`` hands it: transformers' fused
``experts.gate_up_proj [E, 2I, h]`` / ``experts.down_proj [E, h, I]`` (a stacked INT4 QTensor; the
AutoRound writer stores it as per-expert keys, as auto-round exports) or producers' per-expert
``experts.{e}.{gate,up,down}_proj.weight``.

W4A4 checkpoints also need activation ranges: a real NVFP4 checkpoint carries, beside each expert
weight, an ``input_scale`` (the activation global scale, ``amax / (6*448)``) that ModelOpt
calibrates on sample text before export; Blackwell's W4A4 kernels scale the activations' E4M3 block
scales under it. ``musecore_quant.convert`` quantizes weights alone, so
:func:`calibrate_expert_inputs` runs ``MuseModel.forward`` with an observer that records each
expert's input amax (the pooled latent ``z`` for gate/up, ``silu(gate) * up`` for down) and keeps a
sample of those activations (:func:`activation_sqnr_db` states what activation quantization
costs); :func:`write_with_input_scales` writes them into a converted checkpoint.

Example::

    import musecore, torch
    from musecore.calibrate import autoround_quantizer, convert_autoround
    from musecore_quant.convert import convert

    model = musecore.load("Muse-BF16", device="cpu", dtype=torch.float32)
    quantizer = autoround_quantizer(model, ids, iters=200)          # ids: LongTensor [B, T]
    convert("Muse-BF16", "Muse-INT4-AR", to="int4", method="autoround",
            include=quantizer.include_patterns(), calibrated_quantizer=quantizer)

    # or in one call, from text or token ids:
    convert_autoround("Muse-BF16", "Muse-INT4-AR", open("calib.txt").read())

Command line (``musecore-quant convert --method autoround`` has no way to receive a quantizer)::

    python -m musecore.calibrate SRC DST --calibration calib.txt [--iters 200] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from musecore_quant import QTensor, concat_qtensors, dequantize, quantize, stack_qtensors

from musecore.autoround import (AUTO_ROUND_INT_MULTIPLE, PROJECTIONS, AutoRoundOptions, ExpertTuner, auto_round_version, relative_gain,
                                rtn_expert)
from musecore.model import MoEObserver, MuseModel
from musecore.names import expert_patterns, expert_weight, quantized_expert_layers

REPORT_FILE = "calibration_report.json"
DENSE_REPORT_FILE = "dense_calibration_report.json"


# ---------------------------------------------------------------------------------------------------------------
# Running the graph one layer at a time, observing the router


class LayerwiseRun:
    """``MuseModel.forward`` (no KV cache) cut at every decoder layer, over calibration ids ``[B, T]``:
    the model's own stages, run chunk by chunk (``batch_size`` sequences at a time).

    Per layer: ``attention(i)`` gives ``(h, m)`` per chunk (the residual after attention and the
    feed-forward input), ``feedforward(i, hm)`` runs the feed-forward sublayer (the MoE of a sparse
    layer, the dense MLP otherwise; ``experts`` stands in for the layer's own, ``observer`` sees the
    routing) and advances the residual stream. ``logits()`` after the last layer equals
    ``model.forward(ids)``.
    """

    def __init__(self, model: MuseModel, ids: torch.Tensor, batch_size: int = 8) -> None:
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(f"calibration ids must be a LongTensor [B, T]; got {ids.dtype} {list(ids.shape)}")
        self.model = model
        self.streams = [model.embed(chunk) for chunk in ids.split(batch_size)]  # (x, a, positions, rope) each
        self.next_layer = 0

    def attention(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(h, m) per chunk: the residual after attention and the feed-forward input of layer ``i``."""
        if i != self.next_layer:
            raise RuntimeError(f"layers run in order: expected layer {self.next_layer}, got {i}")
        return [self.model.attention_sublayer(i, x, a, positions, rope) for x, a, positions, rope in self.streams]

    def feedforward(self, i: int, hm: list[tuple[torch.Tensor, torch.Tensor]], *, experts: Any = None,
                    observer: Optional[MoEObserver] = None, advance: bool = True) -> None:
        """The feed-forward sublayer of layer ``i`` on ``hm`` (from :meth:`attention`); ``advance=False``
        only runs it (e.g. to observe the router)."""
        results = [self.model.feedforward_sublayer(i, h, m, observer=observer, experts=experts) for h, m in hm]
        if advance:
            self.streams = [(x, a, positions, rope) for (x, a), (_, _, positions, rope) in zip(results, self.streams)]
            self.next_layer = i + 1

    def logits(self) -> torch.Tensor:
        if self.next_layer != len(self.model.layers):
            raise RuntimeError(f"logits() needs every layer run; {self.next_layer} of {len(self.model.layers)} done")
        return torch.cat([self.model.logits(a) for _, a, _, _ in self.streams])


@dataclass
class RoutedInputs:
    """What the router sent one expert: rows of ``z`` and their routing weights, capped."""

    z: torch.Tensor          # [n, h] fp32, pooled + normed latents (pre_expert_norm(pre_expert_proj(m)))
    weights: torch.Tensor    # [n] fp32, renormalised top-k routing weights
    tokens: torch.Tensor     # [n] long, flat calibration token index (row of ids.reshape(-1))
    routed: int              # tokens the router picked for this expert before the cap
    rest: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (z, weights) of up to n routed tokens left out


@dataclass
class RouterRecord:
    """One layer's routing over all calibration tokens, as ``MoE.__call__`` computed it."""

    z: torch.Tensor = None        # [N, h]
    weights: torch.Tensor = None  # [N, k]
    ids: torch.Tensor = None      # [N, k]
    parts: list = field(default_factory=list)

    def __call__(self, layer: int, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
        self.parts.append((z.detach().float().cpu(), weights.detach().float().cpu(), ids.detach().cpu()))

    def finish(self) -> "RouterRecord":
        self.z, self.weights, self.ids = (torch.cat(t) for t in zip(*self.parts))
        self.parts = []
        return self


def record_routing(run: LayerwiseRun, i: int, hm: list) -> RouterRecord:
    """The router's choices and the pooled latents of layer ``i`` for every calibration token."""
    record = RouterRecord()
    run.feedforward(i, hm, observer=record, advance=False)
    return record.finish()


def routed_inputs(record: RouterRecord, expert: int, max_tokens: int, seed: int = 0) -> RoutedInputs:
    """Expert ``expert``'s routed rows of ``record``; a seeded random subset (in token order) when
    the router picked more than ``max_tokens``."""
    tokens, slot = (record.ids == expert).nonzero(as_tuple=True)
    routed, rest = len(tokens), None
    if routed > max_tokens:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + expert)
        order = torch.randperm(routed, generator=gen)
        keep, left = order[:max_tokens].sort().values, order[max_tokens:2 * max_tokens].sort().values
        rest = (record.z[tokens[left]], record.weights[tokens[left], slot[left]])
        tokens, slot = tokens[keep], slot[keep]
    return RoutedInputs(record.z[tokens], record.weights[tokens, slot], tokens, routed, rest)


def capture_routed_inputs(model: MuseModel, ids: torch.Tensor, max_tokens: int = 2048,
                          layers: Optional[Sequence[int]] = None, seed: int = 0,
                          batch_size: int = 8) -> dict[int, list[RoutedInputs]]:
    """For every sparse (MoE) layer (or ``layers``, all sparse), what the router sends each expert on
    ``ids [B, T]``, with the unquantized model: ``{layer: [RoutedInputs per expert]}``.

    Example::

        routed = capture_routed_inputs(musecore.load(ckpt, device="cpu"), ids)
        routed[1][5].z.shape        # [n, h]: the pooled latents expert 5 of layer 1 received
    """
    cfg = model.config
    wanted = set(cfg.sparse_layers if layers is None else _sparse(cfg, layers))
    run, out = LayerwiseRun(model, ids, batch_size), {}
    for i in range(cfg.num_hidden_layers):
        hm = run.attention(i)
        if i in wanted:
            record = record_routing(run, i, hm)
            out[i] = [routed_inputs(record, e, max_tokens, seed) for e in range(cfg.num_local_experts)]
        run.feedforward(i, hm)
    return out


def _sparse(cfg: Any, layers: Sequence[int]) -> list[int]:
    """``layers`` sorted, checked to be sparse (MoE) layers of ``cfg``."""
    layers = sorted(set(layers))
    outside = [i for i in layers if not 0 <= i < cfg.num_hidden_layers]
    if outside:
        raise ValueError(f"layers {outside} are outside 0..{cfg.num_hidden_layers - 1}")
    dense = [i for i in layers if not cfg.is_sparse(i)]
    if dense:
        raise ValueError(f"layers {dense} are dense-MLP layers (mlp_layer_types) and have no routed experts; "
                         f"choose among the sparse layers {cfg.sparse_layers}")
    return layers


# ---------------------------------------------------------------------------------------------------------------
# AutoRound per expert, as a calibrated_quantizer for musecore_quant.convert


@dataclass
class ExpertReport:
    layer: int
    expert: int
    method: str            # "autoround", or "rtn" (no calibration token reached it)
    routed_tokens: int     # tokens the router picked for it in the calibration set
    tuned_tokens: int      # tokens it was tuned on (capped)
    loss_rtn: Optional[float] = None        # routed-output MSE on the tuning tokens
    loss_autoround: Optional[float] = None
    heldout_tokens: int = 0                 # routed tokens beyond the cap, not tuned on
    heldout_loss_rtn: Optional[float] = None
    heldout_loss_autoround: Optional[float] = None


@dataclass
class CalibrationReport:
    """What :class:`AutoRoundQuantizer` did, expert by expert; ``to_dict()`` is the JSON written beside
    the converted checkpoint."""

    layers: list[int]
    calibration_tokens: int
    options: dict
    auto_round_version: Optional[str]
    propagate_quantized: bool
    experts: list[ExpertReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rtn_fallback(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert quantized with RTN because no calibration token reached it."""
        return [(r.layer, r.expert) for r in self.experts if r.method == "rtn"]

    def summary(self) -> dict:
        tuned = [r for r in self.experts if r.method == "autoround"]
        gains = [relative_gain(r.loss_rtn, r.loss_autoround) for r in tuned]
        checked = [r for r in tuned if r.heldout_loss_rtn is not None]
        heldout = [relative_gain(r.heldout_loss_rtn, r.heldout_loss_autoround) for r in checked]
        return {"experts": len(self.experts), "autoround": len(tuned), "rtn_fallback": len(self.rtn_fallback),
                "rtn_fallback_experts": [f"layer {l} expert {e}" for l, e in self.rtn_fallback],
                "mean_routed_error_reduction": sum(gains) / len(gains) if gains else None,
                "experts_worse_than_rtn": sum(r.loss_autoround > r.loss_rtn for r in tuned),
                "heldout_experts": len(checked),
                "mean_heldout_routed_error_reduction": sum(heldout) / len(heldout) if heldout else None,
                "experts_worse_than_rtn_heldout": sum(r.heldout_loss_autoround > r.heldout_loss_rtn for r in checked),
                "seconds": self.seconds}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["summary"] = self.summary()
        return d


class AutoRoundQuantizer:
    """``calibrated_quantizer(name, fp32 weight) -> QTensor`` for ``musecore_quant.convert``: every
    routed expert projection of ``layers`` tuned with auto-round on its routed calibration tokens.

    Tuning runs when the quantizer is built (layer by layer, see the module doc); calling it only
    looks the result up, after checking that the converted checkpoint's weight is the one that was
    tuned. It answers a per-expert name (``experts.{e}.up_proj.weight``: that expert's ``[I, h]``
    INT4) or a fused one (``experts.gate_up_proj``: ``[E, 2I, h]``, each expert's gate rows then its
    up rows, stacked without requantizing; ``experts.down_proj``: ``[E, h, I]``). Names it did not
    tune raise, naming the layers it covers (no silent RTN).
    """

    def __init__(self, model: MuseModel, calibration_ids: torch.Tensor, *, layers: Optional[Sequence[int]] = None,
                 options: AutoRoundOptions = AutoRoundOptions(), propagate_quantized: bool = True,
                 sequences_per_pass: int = 8, progress: bool = False) -> None:
        cfg = model.config
        self.model, self.options = model, options
        self.layers = quantized_expert_layers(cfg) if layers is None else _sparse(cfg, layers)
        for i in self.layers:
            _dense_experts(model, i)
        started = time.perf_counter()
        self.report = CalibrationReport(self.layers, int(calibration_ids.numel()), options.as_dict(),
                                        auto_round_version(), propagate_quantized)
        self.results: dict[int, list[dict[str, QTensor]]] = {}  # layer -> per expert {projection: INT4}
        tuner = (ExpertTuner(cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.post_norm_eps, options)
                 if self.layers else None)
        self.results = quantize_layerwise(model, calibration_ids, self.layers,
                                          lambda i, record: self._quantize_layer(i, record, tuner, progress),
                                          sequences_per_pass, propagate_quantized)
        self.report.seconds = time.perf_counter() - started
        digest = hashlib.sha256(calibration_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        # convert()'s resume key reads __qualname__: make it name this calibration, not just the class.
        self.__qualname__ = (f"musecore.calibrate.AutoRoundQuantizer(ids={digest}, layers={self.layers}, "
                             f"options={json.dumps(options.as_dict(), sort_keys=True)})")

    def _quantize_layer(self, i: int, record: RouterRecord, tuner: ExpertTuner, progress: bool) -> list[dict]:
        experts, mlp = self.model.layers[i].mlp.experts, self.model.layers[i].mlp
        per_expert = []
        for e in range(self.model.config.num_local_experts):
            gate, up, down = experts.gate[e].float(), experts.up[e].float(), experts.down[e].float()
            routed = routed_inputs(record, e, self.options.max_tokens, self.options.seed)
            if len(routed.tokens) == 0:
                qts = rtn_expert(gate, up, down, self.options)
                entry = ExpertReport(i, e, "rtn", 0, 0)
            else:
                result = tuner.tune(gate, up, down, mlp.post_expert_norm, routed.z, routed.weights,
                                    seed=self.options.seed + 1000 * i + e, heldout=routed.rest)
                qts = result.qtensors
                entry = ExpertReport(i, e, "autoround", routed.routed, result.tokens, result.loss_rtn,
                                     result.loss_autoround, result.heldout_tokens, result.heldout_loss_rtn,
                                     result.heldout_loss_autoround)
            self.report.experts.append(entry)
            if progress:
                gain = "" if entry.loss_rtn is None else \
                    f"  routed-output MSE rtn {entry.loss_rtn:.3e} -> autoround {entry.loss_autoround:.3e}"
                if entry.heldout_loss_rtn is not None:
                    gain += (f"; on {entry.heldout_tokens} routed tokens not tuned on: rtn {entry.heldout_loss_rtn:.3e}"
                             f" -> autoround {entry.heldout_loss_autoround:.3e}")
                print(f"layer {i} expert {e}: {entry.method} on {entry.tuned_tokens}/{entry.routed_tokens} "
                      f"tokens{gain}", file=sys.stderr, flush=True)
            per_expert.append(qts)
        return per_expert

    def include_patterns(self) -> list[str]:
        """``include`` regexes for ``convert`` that select exactly the weights this quantizer tuned
        (fused or per-expert names)."""
        return expert_patterns(self.layers)

    def __call__(self, name: str, weight: torch.Tensor) -> QTensor:
        match = expert_weight(name)
        if match is None:
            raise ValueError(f"{name!r} is not a routed expert projection; the AutoRound quantizer tunes only those. "
                             f"Restrict include to {self.include_patterns()}")
        layer = match.layer
        per_expert = self.results.get(layer)
        if per_expert is None:
            raise ValueError(f"{name!r}: layer {layer} was not calibrated (layers {self.layers}); pass "
                             f"layers=... to autoround_quantizer or restrict include to {self.include_patterns()}")
        experts = self.model.layers[layer].mlp.experts
        if match.proj == "gate_up_proj":  # [E, 2I, h]: each expert's gate rows, then its up rows
            qt = stack_qtensors([concat_qtensors([q["gate_proj"], q["up_proj"]]) for q in per_expert])
            tuned = torch.cat([experts.gate, experts.up], dim=1).float()
        elif match.fused:                      # down_proj [E, h, I]
            qt = stack_qtensors([q["down_proj"] for q in per_expert])
            tuned = experts.down.float()
        else:
            expert, proj = match.expert, match.proj
            if expert >= len(per_expert):
                raise ValueError(f"{name!r} names expert {expert}; layer {layer} has {len(per_expert)} experts")
            qt = per_expert[expert][proj]
            tuned = getattr(experts, proj.split("_")[0])[expert].float()
        if tuple(weight.shape) != tuple(tuned.shape) or not torch.equal(weight.float(), tuned):
            diff = f"shape {list(weight.shape)}, not {list(tuned.shape)}" if tuple(weight.shape) != tuple(tuned.shape) \
                else f"max |diff| {(weight.float() - tuned).abs().max().item():.3g}"
            raise ValueError(f"{name!r} differs from the weight that was calibrated ({diff}): load the calibration "
                             "model from the checkpoint being converted (dtype=torch.float32 for an fp32 checkpoint)")
        return qt


def _dense_experts(model: MuseModel, layer: int) -> Any:
    experts, cfg = model.layers[layer].mlp.experts, model.config
    want = (cfg.num_local_experts, cfg.moe_intermediate_size, cfg.moe_hidden_size)
    if not isinstance(experts.gate, torch.Tensor) or tuple(experts.gate.shape) != want:
        raise ValueError(f"layer {layer}: calibration needs dense reference experts [E, I, h] = {list(want)}; load the "
                         "model with musecore.load(checkpoint, device='cpu', dtype=torch.float32)")
    return experts


def quantize_layerwise(model: MuseModel, calibration_ids: torch.Tensor, layers: Sequence[int],
                       quantize_layer: Callable[[int, RouterRecord], list[dict]], sequences_per_pass: int,
                       propagate_quantized: bool = True) -> dict[int, list[dict]]:
    """Run the model layer by layer on the calibration ids; for each layer of ``layers`` record the routing and
    ``quantize_layer(i, record) -> per expert {projection: QTensor}``, then (``propagate_quantized``) run that
    layer's MoE with the quantized experts so later layers see their error. Returns ``{layer: per-expert dicts}``."""
    results: dict[int, list[dict]] = {}
    run = LayerwiseRun(model, calibration_ids, sequences_per_pass)
    for i in range(model.config.num_hidden_layers):
        hm = run.attention(i)
        if i not in layers:
            run.feedforward(i, hm)
            continue
        results[i] = quantize_layer(i, record_routing(run, i, hm))
        run.feedforward(i, hm, experts=quantized_experts(model.layers[i].mlp.experts, results[i])
                        if propagate_quantized else None)
    return results


def quantized_experts(experts: Any, quantized: list[dict]) -> Any:
    """``experts`` (a layer's dense reference experts) holding the dequantized INT4 weights instead, for
    ``MuseModel.feedforward_sublayer(..., experts=)`` (the model is untouched)."""
    dtype = experts.gate.dtype
    stacked = {p: torch.stack([dequantize(q[p], torch.float32) for q in quantized]).to(dtype) for p in PROJECTIONS}
    return dataclasses.replace(experts, gate=stacked["gate_proj"], up=stacked["up_proj"], down=stacked["down_proj"])


def autoround_quantizer(model: MuseModel, calibration_ids: torch.Tensor, *, layers: Optional[Sequence[int]] = None,
                        iters: int = 200, nsamples: int = 128, tokens_per_sample: int = 16,
                        batch_size: Optional[int] = None, group_size: int = AutoRoundOptions.group_size, sym: bool = True,
                        lr: Optional[float] = None, seed: int = 42, propagate_quantized: bool = True,
                        progress: bool = False, verbose: bool = False) -> AutoRoundQuantizer:
    """Tune every routed expert of ``layers`` (default: the sparse layers but ``config.bf16_expert_layers``)
    with auto-round on ``calibration_ids [B, T]``; returns the ``calibrated_quantizer`` for
    ``musecore_quant.convert(..., to="int4", method="autoround")``. Options: see
    :class:`~musecore.autoround.AutoRoundOptions` (each expert sees at most
    ``nsamples * tokens_per_sample`` of its routed tokens)."""
    options = AutoRoundOptions(iters=iters, nsamples=nsamples, tokens_per_sample=tokens_per_sample,
                               batch_size=batch_size, group_size=group_size, sym=sym, lr=lr, seed=seed, verbose=verbose)
    return AutoRoundQuantizer(model, calibration_ids, layers=layers, options=options,
                              propagate_quantized=propagate_quantized, progress=progress)


# ---------------------------------------------------------------------------------------------------------------
# AutoRound for the dense groups a device quantizes (attention, pooler/unpooler, lm_head, dense MLP)


class LinearInputRecorder:
    """The model's op set, unchanged, except that ``linear`` also keeps (up to ``max_rows`` of) the
    input rows of the weights in ``names_by_weight`` (``id(prepared weight) -> checkpoint names``).
    :func:`capture_linear_inputs` binds it in place of the model's ops for one calibration pass."""

    def __init__(self, ops: Any, names_by_weight: dict[int, list[str]], max_rows: int) -> None:
        self._ops, self._names, self.max_rows = ops, names_by_weight, max_rows
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.count: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def linear(self, x: torch.Tensor, weight: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        for name in self._names.get(id(weight), ()):
            room = self.max_rows - self.count[name]
            if room > 0:
                rows = x.reshape(-1, x.shape[-1])[:room].float().clone()
                self.rows[name].append(rows)
                self.count[name] += len(rows)
        return self._ops.linear(x, weight, *args, **kwargs)


def dense_linear_names(model: MuseModel, groups: Sequence[str]) -> list[str]:
    """Checkpoint names of the model's Linears in the dense ``groups`` (labels of
    :data:`musecore.names.DENSE_QUANTIZABLE`), in model order."""
    from musecore.names import weight_group
    slots = model.weight_slots()
    return [name for name, slot in slots.items() if slot.role == "linear" and weight_group(name, model.config)[0] in groups]


def capture_linear_inputs(model: MuseModel, ids: torch.Tensor, names: Sequence[str], max_rows: int = 2048,
                          sequences_per_pass: int = 4) -> dict[str, torch.Tensor]:
    """The input rows ``[n, in]`` (fp32, at most ``max_rows``) that each Linear of ``names`` receives
    while ``model.forward`` runs on ``ids [B, T]``. Fused input projections (q/k/v/gate) share one input.

    The model's op set is swapped for a :class:`LinearInputRecorder` on the model and its blocks
    during the pass and restored after; the numbers computed are the model's own."""
    slots = model.weight_slots()
    names_by_weight: dict[int, list[str]] = defaultdict(list)
    for name in names:
        slot = slots[name]
        fused = getattr(slot.owner, "in_proj", None) if slot.fused else None
        weight = fused.weight if fused is not None else getattr(slot.owner, slot.attr)
        names_by_weight[id(weight)].append(name)
    holders = [model] + [obj for layer in model.layers for obj in (layer, layer.self_attn, layer.mlp)]
    original = model.ops
    holders = [obj for obj in holders if getattr(obj, "ops", None) is original]
    recorder = LinearInputRecorder(original, names_by_weight, max_rows)
    try:
        for obj in holders:
            obj.ops = recorder
        with torch.inference_mode():
            for chunk in ids.split(sequences_per_pass):
                model.forward(chunk)
    finally:
        for obj in holders:
            obj.ops = original
    missing = [n for n in names if not recorder.rows.get(n)]
    if missing:
        raise RuntimeError(f"no input reached {missing[:3]} during the calibration pass (the model ran "
                           "them through a path the recorder does not see)")
    return {name: torch.cat(recorder.rows[name]) for name in names}


@dataclass
class LinearReport:
    name: str
    method: str                  # "autoround", or "rtn" (a width auto-round leaves in 16 bits)
    tuned_tokens: int
    loss_rtn: Optional[float] = None          # output MSE on the tuning rows
    loss_autoround: Optional[float] = None
    heldout_tokens: int = 0
    heldout_loss_rtn: Optional[float] = None  # the same on calibration rows not tuned on
    heldout_loss_autoround: Optional[float] = None


class CalibratedDense:
    """What the dense-group quantizers (:class:`DenseAutoRoundQuantizer`,
    :class:`musecore.calibrate_gptq.DenseGPTQQuantizer`) share: the Linears of ``groups`` they calibrate, the
    include patterns for ``convert``, and the look-up ``quantizer(name, fp32 weight) -> QTensor`` that refuses a
    name it did not calibrate or a weight other than the one it calibrated. Subclasses fill ``results`` and
    ``calibrated`` and call :meth:`_finish`."""

    method = "calibrated"  # how a subclass's error messages name its work

    def _select(self, model: MuseModel, groups: Sequence[str], names: Optional[Sequence[str]]) -> None:
        self.groups = tuple(groups)
        self.names = dense_linear_names(model, self.groups)
        if names is not None:  # a subset (tests, or a partial re-tune)
            unknown = sorted(set(names) - set(self.names))
            if unknown:
                raise ValueError(f"{unknown} are not Linears of the groups {list(groups)}; choose from {self.names}")
            self.names = [n for n in self.names if n in names]
        if not self.names:
            raise ValueError(f"the model has no Linear in the groups {list(groups)}")
        self.results: dict[str, QTensor] = {}
        self.calibrated: dict[str, torch.Tensor] = {}

    def _finish(self, started: float, calibration_ids: torch.Tensor, options: Any) -> None:
        """The run's time, and a ``__qualname__`` naming the calibration (convert's resume key)."""
        self.seconds = time.perf_counter() - started
        digest = hashlib.sha256(calibration_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        self.__qualname__ = (f"{type(self).__module__}.{type(self).__name__}(ids={digest}, groups={list(self.groups)}, "
                             f"options={json.dumps(options.as_dict(), sort_keys=True)})")

    def include_patterns(self) -> list[str]:
        import re
        return ["^" + re.escape(name) + "$" for name in self.names]

    def __call__(self, name: str, weight: torch.Tensor) -> QTensor:
        if name not in self.results:
            raise ValueError(f"{name!r} was not {self.method} (groups {list(self.groups)}); restrict include to "
                             "include_patterns()")
        if not torch.equal(weight.float(), self.calibrated[name]):
            raise ValueError(f"{name!r} differs from the weight that was calibrated: load the calibration model "
                             "from the checkpoint being converted (dtype=torch.float32)")
        return self.results[name]


class DenseAutoRoundQuantizer(CalibratedDense):
    """``calibrated_quantizer(name, fp32 weight) -> QTensor`` for the dense Linears of ``groups``
    (the groups a device such as xeon6 quantizes at load: attention, pooler/unpooler, lm_head):
    each tuned with auto-round on the inputs it receives in the BF16 model on the calibration
    ids (one pass, no propagation of earlier quantization), its own output MSE as the loss. A Linear
    with a dimension auto-round does not tune (not a multiple of 32) is rounded to nearest and
    listed as ``rtn_fallback`` in :meth:`report`.

    ``heldout_fraction`` of each Linear's captured rows is kept out of tuning and measures RTN and
    AutoRound there (the report). Tuning runs when it is built; calling it looks the result up.

    Example::

        model = musecore.load("muse-bf16", device="cpu", dtype=torch.float32)
        dense = DenseAutoRoundQuantizer(model, "muse-bf16", ids, ("attention", "pooler/unpooler", "lm_head"))
        dense("lm_head.weight", w)              # canonical INT4 QTensor
    """

    method = "tuned"

    def __init__(self, model: MuseModel, source: Union[str, Path], calibration_ids: torch.Tensor,
                 groups: Sequence[str], *, options: AutoRoundOptions = AutoRoundOptions(),
                 heldout_fraction: float = 0.25, names: Optional[Sequence[str]] = None, progress: bool = False) -> None:
        from musecore_quant.checkpoint import open_checkpoint

        from musecore.autoround import LinearTuner
        reader = open_checkpoint(source)
        started = time.perf_counter()
        self.options = options
        self._select(model, groups, names)
        inputs = capture_linear_inputs(model, calibration_ids, self.names, max_rows=options.max_tokens)
        self.reports: list[LinearReport] = []
        tuners: dict[tuple[int, int], LinearTuner] = {}
        for k, name in enumerate(self.names):
            weight = reader.read(name).float()  # the weight convert() will hand over, fp32
            x = inputs[name]
            cut = max(1, int(len(x) * (1 - heldout_fraction)))
            shape = (weight.shape[1], weight.shape[0])
            if any(dim % AUTO_ROUND_INT_MULTIPLE for dim in shape):  # auto-round would leave it in 16 bits
                self.results[name] = quantize(weight, "int4", group_size=options.group_size, sym=options.sym)
                self.calibrated[name] = weight
                self.reports.append(LinearReport(name, "rtn", 0))
                if progress:
                    print(f"{name}: RTN ({list(weight.shape)}: auto-round tunes only multiples of "
                          f"{AUTO_ROUND_INT_MULTIPLE})", file=sys.stderr, flush=True)
                continue
            if shape not in tuners:
                tuners[shape] = LinearTuner(*shape, options)
            result = tuners[shape].tune(weight, x[:cut], seed=options.seed + k, heldout=x[cut:])
            self.results[name], self.calibrated[name] = result.qtensor, weight
            report = LinearReport(name, "autoround", result.tokens, result.loss_rtn, result.loss_autoround,
                                  result.heldout_tokens, result.heldout_loss_rtn, result.heldout_loss_autoround)
            self.reports.append(report)
            if progress:
                print(f"{name}: output MSE rtn {report.loss_rtn:.3e} -> autoround {report.loss_autoround:.3e} on "
                      f"{report.tuned_tokens} rows; held out ({report.heldout_tokens}): rtn "
                      f"{report.heldout_loss_rtn:.3e} -> autoround {report.heldout_loss_autoround:.3e}",
                      file=sys.stderr, flush=True)
        self._finish(started, calibration_ids, options)

    def report(self) -> dict:
        held = [r for r in self.reports if r.heldout_loss_rtn]
        rtn = [r.name for r in self.reports if r.method == "rtn"]
        gains = [relative_gain(r.heldout_loss_rtn, r.heldout_loss_autoround) for r in held]
        return {"groups": list(self.groups), "options": self.options.as_dict(), "seconds": self.seconds,
                "auto_round_version": auto_round_version(),
                "mean_heldout_output_error_reduction": sum(gains) / len(gains) if gains else None,
                "linears_worse_than_rtn_heldout": sum(r.heldout_loss_autoround > r.heldout_loss_rtn for r in held),
                "rtn_fallback": rtn,
                "linears": [dataclasses.asdict(r) for r in self.reports]}


class ExpertsFromCheckpoint:
    """``calibrated_quantizer`` answering routed-expert names from an INT4 AutoRound checkpoint already
    made from the same source (per-expert keys, as :func:`convert_autoround` writes them), so that
    adding tuned dense groups does not tune the experts again. The caller vouches for the source
    (the accuracy matrix keys its cache by the source's content hash)."""

    def __init__(self, folder: Union[str, Path]) -> None:
        from musecore_quant.checkpoint import open_checkpoint
        self.reader = open_checkpoint(folder)

    def __call__(self, name: str, weight: torch.Tensor) -> QTensor:
        from musecore.names import experts_prefix, per_expert_name
        match = expert_weight(name)
        if match is None:
            raise ValueError(f"{name!r} is not a routed expert projection")
        prefix = experts_prefix(match.layer)
        if not match.fused:
            qt = self.reader.read(name)
        elif match.proj == "gate_up_proj":
            qt = stack_qtensors([concat_qtensors([self.reader.read(per_expert_name(prefix, e, "gate_proj")),
                                                  self.reader.read(per_expert_name(prefix, e, "up_proj"))])
                                 for e in range(weight.shape[0])])
        else:
            qt = stack_qtensors([self.reader.read(per_expert_name(prefix, e, "down_proj"))
                                 for e in range(weight.shape[0])])
        if tuple(qt.shape) != tuple(weight.shape):
            raise ValueError(f"{name!r}: the expert checkpoint holds {list(qt.shape)}, the source {list(weight.shape)}")
        return qt


class CombinedQuantizer:
    """Routes each name to the quantizer that tuned it: experts to one, dense Linears to the other."""

    def __init__(self, experts: Any, dense: DenseAutoRoundQuantizer) -> None:
        self.experts, self.dense = experts, dense
        self.__qualname__ = f"{getattr(experts, '__qualname__', type(experts).__name__)}+{dense.__qualname__}"

    def __call__(self, name: str, weight: torch.Tensor) -> QTensor:
        return self.experts(name, weight) if expert_weight(name) is not None else self.dense(name, weight)


# ---------------------------------------------------------------------------------------------------------------
# Static activation scales for W4A4 (NVFP4) checkpoints


class ActivationStats:
    """Per (layer, expert): amax of the gate/up input and of the down input; a sample of each."""

    def __init__(self, sample_rows: int = 256) -> None:
        self.gate_up_amax: dict[tuple[int, int], float] = defaultdict(float)
        self.down_amax: dict[tuple[int, int], float] = defaultdict(float)
        self.samples: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = defaultdict(list)  # (expert, z, h)
        self.sample_rows = sample_rows

    def record(self, layer: int, expert: int, z: torch.Tensor, h: torch.Tensor) -> None:
        key = (layer, expert)
        self.gate_up_amax[key] = max(self.gate_up_amax[key], float(z.abs().max()))
        self.down_amax[key] = max(self.down_amax[key], float(h.abs().max()))
        held = sum(s[1].shape[0] for s in self.samples[layer])
        if held < self.sample_rows:
            keep = self.sample_rows - held
            self.samples[layer].append((expert, z[:keep].clone(), h[:keep].clone()))

    def amax(self, layer: int, expert: int, projection: str) -> float:
        """The expert's calibrated amax; an expert no calibration token reached takes its layer's largest."""
        table = self.down_amax if projection == "down_proj" else self.gate_up_amax
        if (layer, expert) in table:
            return table[(layer, expert)]
        layer_values = [v for (lyr, _), v in table.items() if lyr == layer]
        if not layer_values:
            raise ValueError(f"no calibration token reached any expert of layer {layer}; calibrate on more text")
        return max(layer_values)


def calibrate_expert_inputs(model: MuseModel, batches: list[tuple[torch.Tensor, torch.Tensor]],
                            sample_rows: int = 256) -> ActivationStats:
    """Run ``model.forward`` (a loaded BF16 :class:`~musecore.model.MuseModel`) on ``batches`` with an
    observer that records every routed expert's input ranges: ``z`` (gate/up) and ``silu(gate) * up`` (down)."""
    stats = ActivationStats(sample_rows)

    def observe(layer: int, z: torch.Tensor, _weights: torch.Tensor, ids: torch.Tensor) -> None:
        experts, zf = model.layers[layer].mlp.experts, z.float()
        for e in ids.unique().tolist():
            ze = zf[(ids == e).any(-1)]
            h = F.silu(ze @ experts.gate[e].float().T) * (ze @ experts.up[e].float().T)
            stats.record(layer, e, ze, h)

    with torch.inference_mode():
        for inputs, _ in batches:
            model.forward(inputs, observer=observe)
    return stats


_NOT_COPIED = {"config.json", "hf_quant_config.json", "model.safetensors.index.json"}
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth"}


def write_with_input_scales(src: Union[str, Path], dst: Union[str, Path], stats: ActivationStats) -> int:
    """Copy the NVFP4 checkpoint ``src`` to ``dst`` with each quantized expert projection's static
    ``input_scale`` (ModelOpt: ``amax / (6*448)``) from ``stats``; returns how many were set.

    The writer is musecore_quant's (atomic, sha256 per shard); other files are copied as they are.
    """
    from musecore_quant.checkpoint import CheckpointWriter, open_checkpoint
    from musecore_quant.formats.nvfp4 import nvfp4_input_scale

    src, dst = Path(src), Path(dst)
    reader = open_checkpoint(src)
    count = 0
    with reader, CheckpointWriter(dst, config=reader.config, format="nvfp4") as writer:
        for _, weights in reader.iter_shards():
            for name, value in weights.items():
                key = expert_weight(name)
                if key is not None and not key.fused and isinstance(value, QTensor) and value.format == "nvfp4":
                    amax = stats.amax(key.layer, key.expert, key.proj)
                    value = dataclasses.replace(value, input_scale=nvfp4_input_scale(
                        max(amax, torch.finfo(torch.float32).tiny)))
                    count += 1
                writer.add(name, value)
        for path in sorted(src.iterdir()):
            if (path.is_file() and not path.name.startswith(".") and path.name not in _NOT_COPIED
                    and path.suffix not in _WEIGHT_SUFFIXES):
                writer.add_file(path)
    if not count:
        raise ValueError(f"{src} holds no NVFP4 expert projections to give an input_scale; convert the experts "
                         "to nvfp4 first")
    return count


def activation_sqnr_db(stats: ActivationStats, act_format: str, layers: Optional[list[int]] = None) -> Optional[float]:
    """SQNR (dB) of fake-quantizing the sampled expert inputs to ``act_format`` (with the calibrated
    static scale for NVFP4, dynamic block scales for MXFP4), over the given layers' samples."""
    from musecore_quant import fake_quantize_activation, quant_error
    from musecore_quant.formats.nvfp4 import nvfp4_input_scale

    refs, approx = [], []
    for layer, samples in stats.samples.items():
        if layers is not None and layer not in layers:
            continue
        for expert, z, h in samples:
            for x, projection in ((z, "gate_proj"), (h, "down_proj")):
                scale = nvfp4_input_scale(stats.amax(layer, expert, projection)) if act_format == "nvfp4" else None
                refs.append(x.reshape(-1))
                approx.append(fake_quantize_activation(x, act_format, input_scale=scale).reshape(-1))
    if not refs:
        return None
    return quant_error(torch.cat(refs), torch.cat(approx)).sqnr_db


# ---------------------------------------------------------------------------------------------------------------
# One call and a command line


def calibration_windows(stream: Union[Sequence[int], torch.Tensor], tokens: int, seq_len: int) -> torch.Tensor:
    """The first ``tokens`` ids of ``stream`` as ``[tokens // seq_len, seq_len]`` windows."""
    stream = torch.as_tensor(stream, dtype=torch.long).flatten()[:tokens]
    if len(stream) < seq_len:
        raise ValueError(f"calibration has {len(stream)} tokens; it needs at least seq_len={seq_len}")
    n = len(stream) // seq_len
    return stream[:n * seq_len].view(n, seq_len)


def calibration_model(src: Union[str, Path], calibration: Union[str, Sequence[int], torch.Tensor], tokens: int,
                      seq_len: int) -> tuple[Any, torch.Tensor]:
    """``src`` loaded on the CPU in fp32 as the calibrators run it, and ``calibration`` (text, tokenized with its
    tokenizer, or token ids) as :func:`calibration_windows`."""
    import musecore
    model = musecore.load(src, device="cpu", dtype=torch.float32, progress=False, quantize_dense=False)
    if isinstance(calibration, str):
        if model.tokenizer is None:
            raise ValueError(f"{src} has no tokenizer.json; pass calibration token ids instead of text")
        calibration = model.tokenizer.encode(calibration)
    return model, calibration_windows(calibration, tokens, seq_len)


def read_calibration(path: Union[str, Path], tokenizer: Any) -> torch.Tensor:
    """Token ids from a calibration file: ``.txt`` (text), ``.jsonl`` (one ``{"text": ...}`` per line,
    each framed with the tokenizer's BOS/EOS like training) or ``.i16`` (raw int16 ids, the training
    corpus format)."""
    path = Path(path)
    if path.suffix == ".i16":
        import numpy as np
        return torch.from_numpy(np.fromfile(path, dtype=np.int16).astype(np.int64))
    if tokenizer is None:
        raise ValueError(f"{path}: text calibration needs the checkpoint's tokenizer.json; pass token ids (.i16)")
    if path.suffix == ".jsonl":
        ids: list[int] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
                text = tokenizer.encode(json.loads(line)["text"], add_special_tokens=False)
                ids += bos + text + list(tokenizer.eos_ids[:1])
        return torch.tensor(ids)
    if path.suffix == ".txt":
        return torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")))
    raise ValueError(f"{path}: unknown calibration file type {path.suffix!r}; use .txt, .jsonl or .i16")


def convert_autoround(src: Union[str, Path], dst: Union[str, Path],
                      calibration: Union[str, Sequence[int], torch.Tensor], *, tokens: int = 16384,
                      seq_len: int = 512, layers: Optional[Sequence[int]] = None,
                      dense_groups: Sequence[str] = (), expert_checkpoint: Optional[Union[str, Path]] = None,
                      progress: bool = True, resume: bool = True, **options: Any) -> tuple[Any, CalibrationReport]:
    """BF16 checkpoint ``src`` -> INT4 AutoRound checkpoint ``dst`` (routed experts of ``layers``).

    ``calibration`` is text (tokenized with the checkpoint's tokenizer) or token ids; its first
    ``tokens`` ids are cut into windows of ``seq_len``. ``options`` go to :func:`autoround_quantizer`.
    ``dense_groups`` (labels of ``musecore.names.DENSE_QUANTIZABLE``, e.g. ``("attention",
    "pooler/unpooler", "lm_head")``, what xeon6 quantizes at load) are tuned too
    (:class:`DenseAutoRoundQuantizer`; its report goes to ``dst/dense_calibration_report.json``), so a
    device loading ``dst`` keeps them as tuned instead of rounding them to nearest.
    ``expert_checkpoint``: take the experts from this INT4 AutoRound checkpoint of the same ``src``
    instead of tuning them again (the experts' calibration report is then the one in that folder).
    Returns ``(conversion report, calibration report)``; the latter is also written to
    ``dst/calibration_report.json``.

    Example::

        conv, calib = convert_autoround("muse-bf16", "muse-int4-ar", text, iters=200)
        calib.summary()["rtn_fallback"]
    """
    from musecore_quant.convert import convert
    model, ids = calibration_model(src, calibration, tokens, seq_len)
    if expert_checkpoint is None:
        quantizer: Any = autoround_quantizer(model, ids, layers=layers, progress=progress, **options)
        opts, calib_report, include = quantizer.options, quantizer.report, quantizer.include_patterns()
    else:
        report_path = Path(expert_checkpoint) / REPORT_FILE
        if not report_path.is_file():
            raise FileNotFoundError(f"{expert_checkpoint} has no {REPORT_FILE}: pass a folder convert_autoround wrote")
        saved = json.loads(report_path.read_text())
        opts = AutoRoundOptions(**saved["options"])
        calib_report = CalibrationReport(saved["layers"], saved["calibration_tokens"], saved["options"],
                                         saved["auto_round_version"], saved["propagate_quantized"],
                                         [ExpertReport(**e) for e in saved["experts"]], saved["seconds"])
        quantizer, include = ExpertsFromCheckpoint(expert_checkpoint), expert_patterns(saved["layers"])
    dense = None
    if dense_groups:
        dense_opts = {k: v for k, v in options.items() if k in ("iters", "nsamples", "tokens_per_sample", "seed")}
        dense = DenseAutoRoundQuantizer(model, src, ids, dense_groups, options=AutoRoundOptions(**dense_opts),
                                        progress=progress)
        quantizer, include = CombinedQuantizer(quantizer, dense), include + dense.include_patterns()
    report = convert(src, dst, to="int4", method="autoround", include=include, exclude=convert_exclude(dense_groups),
                     quantize_options={"group_size": opts.group_size, "sym": opts.sym}, progress=progress,
                     resume=resume, calibrated_quantizer=quantizer)
    (Path(dst) / REPORT_FILE).write_text(json.dumps(calib_report.to_dict(), indent=2) + "\n")
    if dense is not None:
        (Path(dst) / DENSE_REPORT_FILE).write_text(json.dumps(dense.report(), indent=2) + "\n")
    return report, calib_report


def convert_exclude(dense_groups: Sequence[str]) -> tuple[str, ...]:
    """``convert``'s ``exclude`` for a calibrated checkpoint: its default (embeddings, lm_head, norms) less
    lm_head when ``dense_groups`` names it, so a tuned lm_head is written instead of silently left BF16."""
    from musecore_quant.convert import DEFAULT_EXCLUDE
    from musecore.names import LM_HEAD
    return tuple(p for p in DEFAULT_EXCLUDE if not (LM_HEAD in dense_groups and "lm_head" in p))


def run_calibrated_convert(convert_fn: Any, src: Union[str, Path], dst: Union[str, Path], *,
                           calibration: Union[str, Path], progress: bool, resume: bool, **options: Any) -> Any:
    """``convert_fn(folder, dst, calibration_ids, progress=, resume=, **options)`` (:func:`convert_autoround`,
    ``calibrate_gptq.convert_gptq``) on ``src`` resolved to its folder, the calibration read with the
    checkpoint's tokenizer; returns the conversion report (what ``musecore-quant convert`` prints)."""
    from musecore.api import resolve_model
    from musecore.tokenizer import load_tokenizer
    _, folder = resolve_model(src)
    if folder is None:
        raise ValueError(f"{src} is a preset without weights; pass a checkpoint folder")
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    conversion, _ = convert_fn(folder, dst, read_calibration(calibration, tokenizer), progress=progress, resume=resume,
                               **options)
    return conversion


def cli_calibrator(src: Union[str, Path], dst: Union[str, Path], *, calibration: Union[str, Path],
                   progress: bool = True, resume: bool = True) -> Any:
    """``musecore-quant convert SRC DST --to int4 --method autoround --calibration FILE``: the calibrator
    that musecore registers under the ``musecore_quant.calibrators`` entry point (default options)."""
    return run_calibrated_convert(convert_autoround, src, dst, calibration=calibration, progress=progress,
                                  resume=resume)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musecore.calibrate",
                                description="BF16 Muse checkpoint -> INT4 (group 128, symmetric) with AutoRound "
                                            "tuned per routed expert on the tokens the router sends it.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--calibration", required=True, type=Path, help=".txt, .jsonl ({'text'} per line) or .i16 ids")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens used (default 16384)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layers", type=int, nargs="+", default=None, help="layers whose experts are quantized "
                   "(default: the sparse layers but config.bf16_expert_layers)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--nsamples", type=int, default=128, help="auto-round samples per expert (of --tokens-per-sample "
                   "tokens each; default 128, so at most 2048 routed tokens per expert)")
    p.add_argument("--tokens-per-sample", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=None, help="samples per tuning step (default: all of "
                   "the expert's samples; fewer is faster and noisier)")
    p.add_argument("--group-size", type=int, default=AutoRoundOptions.group_size)
    p.add_argument("--asym", action="store_true", help="asymmetric INT4 (default symmetric)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--json", action="store_true", help="print the calibration report as JSON")
    args = p.parse_args(argv)
    from musecore.api import resolve_model
    from musecore.tokenizer import load_tokenizer
    from musecore_quant.checkpoint import CheckpointError
    try:
        _, folder = resolve_model(args.src)
        if folder is None:
            raise ValueError(f"{args.src} is a preset without weights; pass a checkpoint folder")
        tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
        stream = read_calibration(args.calibration, tokenizer)
        conv, calib = convert_autoround(folder, args.dst, stream, tokens=args.tokens, seq_len=args.seq_len,
                                        layers=args.layers, progress=not args.json, resume=not args.no_resume,
                                        iters=args.iters, nsamples=args.nsamples,
                                        tokens_per_sample=args.tokens_per_sample, batch_size=args.batch_size,
                                        group_size=args.group_size, sym=not args.asym, seed=args.seed)
    except (ValueError, ImportError, FileNotFoundError, CheckpointError) as e:
        print(f"python -m musecore.calibrate: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(calib.to_dict(), indent=2))
        return 0
    s, c = calib.summary(), conv.summary()
    fallback = ": " + ", ".join(s["rtn_fallback_experts"]) if s["rtn_fallback"] else ""
    print(f"wrote {conv.dst}: {s['autoround']} experts tuned with auto-round {calib.auto_round_version}, "
          f"{s['rtn_fallback']} RTN fallback (no calibration token){fallback}")
    if s["mean_routed_error_reduction"] is not None:
        print(f"routed-output MSE vs RTN on the tuning tokens: {100 * s['mean_routed_error_reduction']:.1f}% lower "
              f"on average, {s['experts_worse_than_rtn']} experts worse; weight SQNR min {c['min_sqnr_db']:.2f} dB "
              f"mean {c['mean_sqnr_db']:.2f} dB; {calib.seconds:.0f} s calibration")
    if s["mean_heldout_routed_error_reduction"] is not None:
        print(f"on routed tokens left out of tuning ({s['heldout_experts']} experts): "
              f"{100 * s['mean_heldout_routed_error_reduction']:.1f}% lower on average, "
              f"{s['experts_worse_than_rtn_heldout']} experts worse than RTN")
    return 0


if __name__ == "__main__":
    sys.exit(main())
