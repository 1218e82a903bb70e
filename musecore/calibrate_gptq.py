"""GPTQ on the Muse graph: Hessians from the calibration tokens, 4-bit weights in the checkpoint's codec.

``musecore_quant.gptq`` rounds one weight against its input Hessian; this module gathers those
inputs from the model on the calibration ids, through the same calibration path as AutoRound
(``musecore/calibrate.py``), and hands ``musecore_quant.convert`` a ``calibrated_quantizer``:

- Dense groups (:class:`DenseGPTQQuantizer`; attention, pooler/unpooler, lm_head: what xeon6
  quantizes at load): each Linear's input rows in the BF16 model (:func:`capture_linear_inputs`,
  one pass, as the dense AutoRound does), ``H = X^T X`` on the first ``1 - heldout_fraction`` of
  them; the rest measure output MSE against RTN (the report).
- Routed experts (:class:`ExpertGPTQQuantizer`): layer by layer (:class:`LayerwiseRun`, later layers
  see the quantized earlier ones), each expert on the pooled latents ``z`` the router sent it. The
  expert's output enters the layer through the shared post-expert RMS norm and its routing weight,
  so each token's row is weighted by ``(routing weight / rms(expert output))^2`` in the Hessian.
  gate/up first (Hessian of ``z``), then down on ``silu(gate z) * up z`` computed with the quantized
  gate/up. For W4A4 targets (``act_format="mxfp4"``) the inputs are fake-quantized as the device
  quantizes them before the Hessian is formed, so the weights are fitted to the inputs they will see.

The codes are the target format's canonical layout (INT4 symmetric g128 with fp16 scales, MXFP4 with
E8M0 scales): a GPTQ checkpoint is read by every INT4/MXFP4 reader unchanged.

Example::

    from musecore.calibrate_gptq import convert_gptq
    conv, report = convert_gptq("muse-bf16", "muse-int4-gptq", text, dense_groups=("attention", "lm_head"))
    report["dense"]["mean_heldout_output_error_reduction"]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from musecore_quant import QTensor, dequantize, fake_quantize_activation, quantize
from musecore_quant.gptq import GPTQ_FORMATS, gptq_quantize, input_hessian

from musecore.calibrate import (AutoRoundQuantizer, CalibratedDense, _dense_experts, _sparse, calibration_model,
                                capture_linear_inputs, convert_exclude, quantize_layerwise, routed_inputs,
                                run_calibrated_convert)
from musecore.model import MuseModel
from musecore.names import expert_patterns, expert_weight, quantized_expert_layers

GPTQ_REPORT_FILE = "gptq_report.json"
EXPERT_SOURCES = ("gptq", "rtn")


@dataclass(frozen=True)
class GPTQOptions:
    """How GPTQ rounds (``musecore_quant.gptq.gptq_quantize``) and on how many rows.

    ``act_order``: the largest-Hessian-diagonal columns first (static groups keep the layout).
    ``scale_mode``: each group's scale by the producer rule (``"producer"``) or the least-error search
    (``"mse"``). ``max_rows``: calibration rows per Linear / expert. ``heldout_fraction``: of a dense
    Linear's rows, kept out of its Hessian to measure output error against RTN."""

    group_size: int = 128
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    scale_mode: str = "producer"
    max_rows: int = 8192
    heldout_fraction: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1); got {self.heldout_fraction}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1; got {self.max_rows}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor, fmt: str) -> tuple[QTensor, Any]:
        return gptq_quantize(weight, hessian, fmt, group_size=self.group_size, act_order=self.act_order,
                             damp=self.damp, block_size=self.block_size, scale_mode=self.scale_mode)


def _rtn(weight: torch.Tensor, fmt: str, group_size: int) -> QTensor:
    return quantize(weight, "int4", group_size=group_size, sym=True) if fmt == "int4" else quantize(weight, fmt)


def _output_mse(x: torch.Tensor, weight: torch.Tensor, qt: QTensor) -> float:
    return float(((x @ (dequantize(qt) - weight).T) ** 2).mean())


# ---------------------------------------------------------------------------------------------------------------
# Dense groups


class DenseGPTQQuantizer(CalibratedDense):
    """``calibrated_quantizer(name, fp32 weight) -> QTensor`` (INT4) for the dense Linears of ``groups``,
    each rounded by GPTQ against the Hessian of the inputs it receives in the BF16 model.

    Example::

        dense = DenseGPTQQuantizer(model, "muse-bf16", ids, ("attention", "pooler/unpooler", "lm_head"))
        dense("lm_head.weight", w)       # canonical INT4 QTensor (symmetric, g128)
    """

    method = "quantized by GPTQ"

    def __init__(self, model: MuseModel, source: Union[str, Path], calibration_ids: torch.Tensor,
                 groups: Sequence[str], *, options: GPTQOptions = GPTQOptions(), names: Optional[Sequence[str]] = None,
                 progress: bool = False) -> None:
        from musecore_quant.checkpoint import open_checkpoint
        started = time.perf_counter()
        self.options = options
        self._select(model, groups, names)
        inputs = capture_linear_inputs(model, calibration_ids, self.names, max_rows=options.max_rows)
        reader = open_checkpoint(source)
        self.linears: list[dict] = []
        for name in self.names:
            weight = reader.read(name).float()
            x = inputs[name]
            cut = max(1, int(len(x) * (1 - options.heldout_fraction)))
            qt, stats = options.quantize(weight, input_hessian(x[:cut]), "int4")
            rtn = _rtn(weight, "int4", options.group_size)
            held = x[cut:]
            entry = {"name": name, "rows": cut, "heldout_rows": len(held), "proxy_error_gptq": stats.output_error,
                     "proxy_error_rtn": stats.rtn_output_error,
                     "heldout_mse_rtn": _output_mse(held, weight, rtn) if len(held) else None,
                     "heldout_mse_gptq": _output_mse(held, weight, qt) if len(held) else None}
            self.linears.append(entry)
            self.results[name], self.calibrated[name] = qt, weight
            if progress:
                print(f"{name}: GPTQ output-error proxy {stats.output_error:.3e} vs RTN {stats.rtn_output_error:.3e}"
                      + (f"; held out ({len(held)} rows) MSE rtn {entry['heldout_mse_rtn']:.3e} -> gptq "
                         f"{entry['heldout_mse_gptq']:.3e}" if len(held) else ""), file=sys.stderr, flush=True)
        self._finish(started, calibration_ids, options)

    def report(self) -> dict:
        held = [r for r in self.linears if r["heldout_mse_rtn"]]
        gains = [1 - r["heldout_mse_gptq"] / r["heldout_mse_rtn"] for r in held]
        return {"groups": list(self.groups), "options": self.options.as_dict(), "seconds": self.seconds,
                "mean_heldout_output_error_reduction": sum(gains) / len(gains) if gains else None,
                "linears_worse_than_rtn_heldout": sum(r["heldout_mse_gptq"] > r["heldout_mse_rtn"] for r in held),
                "linears": self.linears}


# ---------------------------------------------------------------------------------------------------------------
# Routed experts


class ExpertGPTQQuantizer(AutoRoundQuantizer):
    """``calibrated_quantizer`` for the routed experts of ``layers`` in ``fmt`` (``"int4"`` or ``"mxfp4"``):
    each expert rounded by GPTQ on what the router sent it (module doc). Answers the names
    :class:`~musecore.calibrate.AutoRoundQuantizer` answers (per-expert or fused), with the same checks;
    ``experts="rtn"`` rounds them to nearest instead (so a checkpoint can pair RTN experts with GPTQ
    dense groups). An expert no calibration token reached is rounded to nearest and counted."""

    def __init__(self, model: MuseModel, calibration_ids: torch.Tensor, *, fmt: str = "int4",
                 layers: Optional[Sequence[int]] = None, act_format: Optional[str] = None,
                 options: GPTQOptions = GPTQOptions(), experts: str = "gptq", sequences_per_pass: int = 8,
                 progress: bool = False) -> None:
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"GPTQ experts are written as {GPTQ_FORMATS}; got {fmt!r}")
        if experts not in EXPERT_SOURCES:
            raise ValueError(f"experts must be one of {EXPERT_SOURCES}; got {experts!r}")
        cfg = model.config
        self.model, self.fmt, self.act_format, self.gptq_options, self.method = model, fmt, act_format, options, experts
        self.layers = quantized_expert_layers(cfg) if layers is None else _sparse(cfg, layers)
        for i in self.layers:
            _dense_experts(model, i)
        started = time.perf_counter()
        self.expert_reports: list[dict] = []
        self.results = quantize_layerwise(
            model, calibration_ids, self.layers,
            lambda i, record: [self._expert(i, e, record, progress) for e in range(cfg.num_local_experts)],
            sequences_per_pass)
        self.seconds = time.perf_counter() - started
        digest = hashlib.sha256(calibration_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        self.__qualname__ = (f"musecore.calibrate_gptq.ExpertGPTQQuantizer(ids={digest}, fmt={fmt}, act={act_format}, "
                             f"experts={experts}, layers={self.layers}, "
                             f"options={json.dumps(options.as_dict(), sort_keys=True)})")

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.act_format is None else fake_quantize_activation(x, self.act_format)

    def _expert(self, layer: int, e: int, record: Any, progress: bool) -> dict[str, QTensor]:
        experts, opts = self.model.layers[layer].mlp.experts, self.gptq_options
        gate, up, down = experts.gate[e].float(), experts.up[e].float(), experts.down[e].float()
        routed = routed_inputs(record, e, opts.max_rows, opts.seed)
        if self.method == "rtn" or len(routed.tokens) == 0:
            self.expert_reports.append({"layer": layer, "expert": e, "method": "rtn", "rows": len(routed.tokens)})
            return {"gate_proj": _rtn(gate, self.fmt, opts.group_size), "up_proj": _rtn(up, self.fmt, opts.group_size),
                    "down_proj": _rtn(down, self.fmt, opts.group_size)}
        z = routed.z.float()
        y = (F.silu(z @ gate.T) * (z @ up.T)) @ down.T                         # [n, h] the expert's BF16 output
        token_weight = routed.weights.float() ** 2 / y.square().mean(-1).clamp_min(1e-12)
        root = token_weight.sqrt().unsqueeze(-1)
        zq = self._act(z)
        h_z = input_hessian(zq * root)
        q_gate, s_gate = opts.quantize(gate, h_z, self.fmt)
        q_up, s_up = opts.quantize(up, h_z, self.fmt)
        hidden = self._act(F.silu(zq @ dequantize(q_gate).T) * (zq @ dequantize(q_up).T))
        q_down, s_down = opts.quantize(down, input_hessian(hidden * root), self.fmt)
        entry = {"layer": layer, "expert": e, "method": "gptq", "rows": len(routed.tokens),
                 "proxy_reduction": {"gate_proj": s_gate.reduction, "up_proj": s_up.reduction,
                                     "down_proj": s_down.reduction}}
        self.expert_reports.append(entry)
        if progress:
            print(f"layer {layer} expert {e}: GPTQ on {len(routed.tokens)} rows, output-error proxy vs RTN "
                  f"{s_gate.reduction:+.0%} / {s_up.reduction:+.0%} / {s_down.reduction:+.0%} lower (gate/up/down)",
                  file=sys.stderr, flush=True)
        return {"gate_proj": q_gate, "up_proj": q_up, "down_proj": q_down}

    def include_patterns(self) -> list[str]:
        return expert_patterns(self.layers)

    def report(self) -> dict:
        tuned = [r for r in self.expert_reports if r["method"] == "gptq"]
        reductions = [v for r in tuned for v in r["proxy_reduction"].values()]
        return {"format": self.fmt, "act_format": self.act_format, "experts": self.method, "layers": self.layers,
                "options": self.gptq_options.as_dict(), "seconds": self.seconds, "gptq_experts": len(tuned),
                "rtn_experts": len(self.expert_reports) - len(tuned),
                "mean_proxy_error_reduction": sum(reductions) / len(reductions) if reductions else None,
                "per_expert": self.expert_reports}


class _Combined:
    """Routes each name to the quantizer that made it: experts to one, dense Linears to the other."""

    def __init__(self, experts: Any, dense: Optional[DenseGPTQQuantizer]) -> None:
        self.experts, self.dense = experts, dense
        self.__qualname__ = experts.__qualname__ + ("" if dense is None else "+" + dense.__qualname__)

    def __call__(self, name: str, weight: torch.Tensor) -> QTensor:
        if expert_weight(name) is not None or self.dense is None:
            return self.experts(name, weight)
        return self.dense(name, weight)


def convert_gptq(src: Union[str, Path], dst: Union[str, Path], calibration: Union[str, Sequence[int], torch.Tensor],
                 *, fmt: str = "int4", tokens: int = 16384, seq_len: int = 512, layers: Optional[Sequence[int]] = None,
                 experts: str = "gptq", dense_groups: Sequence[str] = (), act_format: Optional[str] = None,
                 options: GPTQOptions = GPTQOptions(), progress: bool = True, resume: bool = True) -> tuple[Any, dict]:
    """BF16 checkpoint ``src`` -> ``fmt`` checkpoint ``dst``: routed experts of ``layers`` by GPTQ
    (``experts="rtn"``: round to nearest) and, for INT4, the Linears of ``dense_groups`` by GPTQ too.

    ``calibration`` is text or token ids, cut like :func:`musecore.calibrate.convert_autoround`'s.
    ``act_format`` (W4A4 targets, e.g. ``"mxfp4"``): fit the experts to activations quantized that way.
    Returns ``(conversion report, GPTQ report)``; the latter is also ``dst/gptq_report.json``.

    Example::

        conv, rep = convert_gptq("muse-bf16", "muse-mxfp4-gptq", ids, fmt="mxfp4", act_format="mxfp4")
    """
    from musecore_quant.convert import convert
    if dense_groups and fmt != "int4":
        raise ValueError(f"dense groups are quantized to INT4 (what xeon6 runs); got fmt={fmt!r} with dense_groups")
    model, ids = calibration_model(src, calibration, tokens, seq_len)
    started = time.perf_counter()
    expert_q = ExpertGPTQQuantizer(model, ids, fmt=fmt, layers=layers, act_format=act_format, options=options,
                                   experts=experts, progress=progress)
    dense = DenseGPTQQuantizer(model, src, ids, dense_groups, options=options, progress=progress) if dense_groups else None
    include = expert_q.include_patterns() + (dense.include_patterns() if dense else [])
    quantize_options = {"group_size": options.group_size, "sym": True} if fmt == "int4" else {}
    report = convert(src, dst, to=fmt, method="gptq", include=include, exclude=convert_exclude(dense_groups),
                     quantize_options=quantize_options,
                     progress=progress, resume=resume, calibrated_quantizer=_Combined(expert_q, dense))
    gptq = {"calibration_tokens": int(ids.numel()), "seconds": time.perf_counter() - started,
            "experts": expert_q.report(), "dense": dense.report() if dense else None}
    (Path(dst) / GPTQ_REPORT_FILE).write_text(json.dumps(gptq, indent=2) + "\n")
    return report, gptq


def cli_calibrator(src: Union[str, Path], dst: Union[str, Path], *, calibration: Union[str, Path],
                   progress: bool = True, resume: bool = True, fmt: str = "int4") -> Any:
    """``musecore-quant convert SRC DST --to int4|mxfp4 --method gptq --calibration FILE``: routed experts by GPTQ
    (default options), registered under the ``musecore_quant.calibrators`` entry point beside AutoRound's. MXFP4
    experts are fitted to MXFP4 activations (what mi355x runs: the matrix's ``mxfp4-gptq`` recipe)."""
    return run_calibrated_convert(convert_gptq, src, dst, calibration=calibration, progress=progress, resume=resume,
                                  fmt=fmt, act_format="mxfp4" if fmt == "mxfp4" else None)


cli_calibrator.formats = GPTQ_FORMATS  # type: ignore[attr-defined]  (the --to formats musecore-quant offers)
