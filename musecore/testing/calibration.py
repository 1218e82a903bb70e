"""Static activation calibration for W4A4 checkpoints: what ModelOpt does before exporting NVFP4.

A real NVFP4 checkpoint carries, beside each expert weight, an ``input_scale`` (the activation
global scale, ``amax / (6*448)``) calibrated on sample text; Blackwell's W4A4 kernels scale the
activations' E4M3 block scales under it. ``musecore_quant.convert`` quantizes weights alone (it
knows no model graph), so the accuracy matrix runs the BF16 model on calibration tokens, records
each expert's input amax (the pooled latent ``z`` for gate/up, ``silu(gate) * up`` for down),
and writes them into the converted checkpoint. It also keeps a sample of those activations, so
the report can state the SQNR that activation quantization costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

PREFIX = "model.language_model.layers."
_NOT_COPIED = {"config.json", "hf_quant_config.json", "model.safetensors.index.json"}
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth"}


class _ExpertInputRecorder:
    """Stands in for a layer's op table during calibration: ``moe`` records, everything else delegates."""

    def __init__(self, ops: Any, layer: int, stats: "ActivationStats") -> None:
        self._ops, self._layer, self._stats = ops, layer, stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Any,
            post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
        zf = z.float()
        for e in ids.unique().tolist():
            tokens = (ids == e).any(-1)
            ze = zf[tokens]
            h = F.silu(ze @ experts.gate[e].float().T) * (ze @ experts.up[e].float().T)
            self._stats.record(self._layer, e, ze, h)
        return self._ops.moe(z, weights, ids, experts, post_norm, post_eps)


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


def calibrate_expert_inputs(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
                            sample_rows: int = 256) -> ActivationStats:
    """Run ``model`` (a loaded BF16 :class:`~musecore.model.MuseModel`) on ``batches`` and record
    every expert's input ranges; the model's op tables are restored afterwards."""
    stats = ActivationStats(sample_rows)
    saved = [layer.mlp.ops for layer in model.layers]
    try:
        for i, layer in enumerate(model.layers):
            if model.config.is_sparse(i):  # dense-MLP layers have no routed experts
                layer.mlp.ops = _ExpertInputRecorder(saved[i], i, stats)
        with torch.inference_mode():
            for inputs, _ in batches:
                model.forward(inputs)
    finally:
        for layer, ops in zip(model.layers, saved):
            layer.mlp.ops = ops
    return stats


def _expert_key(name: str) -> Optional[tuple[int, int, str]]:
    if not name.startswith(PREFIX) or ".mlp.experts." not in name or not name.endswith("_proj.weight"):
        return None
    layer = int(name[len(PREFIX):].split(".")[0])
    expert = int(name.split(".experts.")[1].split(".")[0])
    return layer, expert, name.rsplit(".", 2)[-2]


def write_with_input_scales(src: Union[str, Path], dst: Union[str, Path], stats: ActivationStats) -> int:
    """Copy the NVFP4 checkpoint ``src`` to ``dst`` with each quantized expert projection's static
    ``input_scale`` (ModelOpt: ``amax / (6*448)``) from ``stats``; returns how many were set.

    The writer is musecore_quant's (atomic, sha256 per shard); other files are copied as they are.
    """
    from musecore_quant import QTensor
    from musecore_quant.checkpoint import CheckpointWriter, open_checkpoint
    from musecore_quant.formats.nvfp4 import nvfp4_input_scale

    src, dst = Path(src), Path(dst)
    reader = open_checkpoint(src)
    count = 0
    with reader, CheckpointWriter(dst, config=reader.config, format="nvfp4") as writer:
        for _, weights in reader.iter_shards():
            for name, value in weights.items():
                key = _expert_key(name)
                if key is not None and isinstance(value, QTensor) and value.format == "nvfp4":
                    scale = nvfp4_input_scale(max(stats.amax(*key), torch.finfo(torch.float32).tiny))
                    value = replace(value, input_scale=scale)
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
