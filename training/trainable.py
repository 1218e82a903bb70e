"""The production ``MuseModel`` graph made trainable: leaf tensors in its weight slots.

There is no second model definition here. :func:`new_parameters` makes one trainable tensor per
weight slot of ``MuseModel.weight_slots()`` (experts stacked ``[E, out, in]``, the layout the ops
take), :func:`install` puts them into a model exactly where the loader would put checkpoint
tensors, and :func:`checkpoint_tensors` turns them back into the per-expert checkpoint names of
MODEL.md section 3. The model then runs its own ``forward`` through an :class:`Ops` table.

:class:`TrainingBackend` is the reference backend with two training-only differences, both
checked against the reference ops by ``train_muse_tiny.py`` before and after training:

- ``router_topk`` also records each layer's router logits, for the load-balancing loss;
- ``moe`` (only with ``all_experts=True``) runs every expert on every token as three batched
  matmuls and weights the outputs by a ``[T, E]`` routing matrix that is zero off the top-k.
  The result and its gradients are the reference's (an unrouted expert gets weight 0, so
  contributes nothing and receives no gradient); it avoids the reference's per-expert loop with a
  host sync per expert, which on a GPU is launch-bound at this size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from musecore.backends.reference import ReferenceBackend, weight_format_of
from musecore.config import MuseConfig
from musecore.model import PREFIX, MuseModel, checkpoint_shapes
from musecore.ops import ExpertWeights, Ops, Weight
from musecore.ops import reference as ref

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "output_norm")


def expert_key(layer: int, projection: str) -> str:
    """The name of one layer's stacked expert tensor (in memory only; checkpoints keep per-expert keys)."""
    return f"{PREFIX}layers.{layer}.mlp.experts.{projection}.stacked"


def new_parameters(config: MuseConfig, device: torch.device, seed: int, std: float = 0.02,
                   embedding_std: float = 1.0) -> dict[str, torch.Tensor]:
    """fp32 leaf tensors for every slot: norms and residual gates 1, matrices normal(0, std).

    The embedding gets ``embedding_std`` instead: embeddings are not scaled (MODEL.md), and every
    sublayer adds an RMS-normalised, gate-1 output to the residual stream, so a 0.02 embedding
    would start as 2% of the stream after the first sublayer.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    params: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if ".mlp.experts." in name:
            continue
        if len(shape) == 1:
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=gen) * (embedding_std if name.endswith("embed_tokens.weight") else std)
        params[name] = value
    E, l, inter = config.num_experts, config.moe_latent_size, config.moe_intermediate_size
    for i in range(config.num_hidden_layers):
        params[expert_key(i, "gate_proj")] = torch.randn(E, inter, l, generator=gen) * std
        params[expert_key(i, "up_proj")] = torch.randn(E, inter, l, generator=gen) * std
        params[expert_key(i, "down_proj")] = torch.randn(E, l, inter, generator=gen) * std
        params[expert_key(i, "output_norm")] = torch.ones(E, l)
    return {name: value.to(device).requires_grad_(True) for name, value in params.items()}


def install(model: MuseModel, params: dict[str, torch.Tensor]) -> None:
    """Put ``params`` into ``model``'s weight slots, as the loader places checkpoint tensors."""
    for name, slot in model.weight_slots().items():
        if slot.role == "vector":
            setattr(slot.owner, slot.attr, params[name])
        elif slot.role in ("linear", "embedding"):
            data = params[name]
            setattr(slot.owner, slot.attr, Weight(data=data, format=weight_format_of(data), out_features=data.shape[0],
                                                  in_features=data.shape[1]))
        elif slot.role == "expert" and slot.owner.experts is None:
            i = slot.layer
            gate, up, down = (params[expert_key(i, p)] for p in EXPERT_PROJECTIONS[:3])
            slot.owner.experts = ExpertWeights(gate=gate, up=up, down=down, format=weight_format_of(gate),
                                               num_experts=gate.shape[0])
            slot.owner.output_norm = params[expert_key(i, "output_norm")]


def checkpoint_tensors(params: dict[str, torch.Tensor], config: MuseConfig,
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (MODEL.md section 3), contiguous, on the CPU, in ``dtype``."""
    out = {}
    for name, value in params.items():
        if name.endswith(".stacked"):
            base, projection = name[: -len(".stacked")].rsplit(".", 1)
            for e in range(value.shape[0]):
                out[f"{base}.{e}.{projection}.weight"] = value[e].detach().to("cpu", dtype).contiguous()
        else:
            out[name] = value.detach().to("cpu", dtype).contiguous()
    expected = checkpoint_shapes(config)
    assert {k: tuple(v.shape) for k, v in out.items()} == expected, "exported tensors differ from checkpoint_shapes"
    return out


def stacked_from_checkpoint(tensors: dict[str, torch.Tensor], config: MuseConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`checkpoint_tensors`: per-expert keys stacked back to ``[E, ...]``."""
    out = {name: value for name, value in tensors.items() if ".mlp.experts." not in name}
    for i in range(config.num_hidden_layers):
        for projection in EXPERT_PROJECTIONS:
            out[expert_key(i, projection)] = torch.stack(
                [tensors[f"{PREFIX}layers.{i}.mlp.experts.{e}.{projection}.weight"] for e in range(config.num_experts)])
    return out


def load_for_evaluation(files: list[str], config: MuseConfig, device: torch.device | str,
                        dtype: torch.dtype = torch.bfloat16) -> MuseModel:
    """A saved checkpoint in a model with the reference ops, placed as ``ReferenceBackend`` places
    dense weights (device and ``dtype``, unchanged values). ``musecore.load`` does the same through
    the plan, which needs the plugin registry; ``tests/unit/test_bundled_model.py`` uses that path."""
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    model = MuseModel(config, Ops.from_backend(ReferenceBackend(device)), dtype=dtype, device=device)
    install(model, {name: value.to(device, dtype) for name, value in stacked_from_checkpoint(tensors, config).items()})
    return model


def moe_all_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
                    output_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.moe`` computed densely: every expert on every token, weighted by a sparse ``[T, E]`` matrix."""
    T, E = ids.shape[0], experts.num_experts
    routing = torch.zeros(T, E, dtype=torch.float32, device=z.device).scatter_add(1, ids, weights.float())  # [T,E]
    zf = z.float()
    gate = torch.einsum("tl,eil->eti", zf, experts.gate.float())  # [E,T,I]
    up = torch.einsum("tl,eil->eti", zf, experts.up.float())
    out = torch.einsum("eti,eli->etl", F.silu(gate) * up, experts.down.float())  # [E,T,l]
    out = ref.rms_norm(out, output_norm[:, None, :], eps)  # each expert's own norm, before its weight
    return (routing.T[:, :, None] * out.float()).sum(0)  # [T,l] fp32 weighted sum


class TrainingBackend(ReferenceBackend):
    """Reference ops on any device, recording router logits; optionally the dense all-experts MoE."""

    name = "training"

    def __init__(self, device: Optional[torch.device | str] = None, all_experts: bool = True) -> None:
        super().__init__(device)
        self.all_experts = all_experts
        self.record_router_logits = True
        self.router_logits: list[torch.Tensor] = []

    def router_topk(self, logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record_router_logits:
            self.router_logits.append(logits)
        return ref.router_topk(logits, k, renormalize)

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
            output_norm: torch.Tensor, eps: float) -> torch.Tensor:
        if self.all_experts:
            return moe_all_experts(z, weights, ids, experts, output_norm, eps)
        return ref.moe(z, weights, ids, experts, output_norm, eps)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch-Transformer balance loss averaged over layers (1.0 when perfectly balanced), and the
    per-layer fraction of routed slots each expert got ``[L, E]``.

    ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k slots routed to ``e`` (no gradient) and
    ``P_e`` the mean router probability of ``e``.
    """
    losses, fractions = [], []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [N,E]
        E = probs.shape[-1]
        ids = probs.topk(top_k, dim=-1).indices
        f = torch.zeros(E, device=probs.device).scatter_add(0, ids.flatten(), torch.ones(ids.numel(), device=probs.device))
        f = f / ids.numel()
        losses.append(E * (f * probs.mean(0)).sum())
        fractions.append(f)
    return torch.stack(losses).mean(), torch.stack(fractions)


def router_z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-sum-exp of the router logits, keeps them from drifting large."""
    return torch.stack([torch.logsumexp(x.float(), dim=-1).pow(2).mean() for x in router_logits]).mean()
