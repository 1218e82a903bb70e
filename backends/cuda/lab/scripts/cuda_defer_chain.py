"""Session 80: muse-small's eager one-token decode step, layer by layer, through the separate ops, the fused blocks
and the fused blocks with the MoE block's residual norm deferred (``fused.DEFER_MOE_NORM``): each layer's residual
after its MoE sublayer (a ``DeferredNorm`` resolved by the ops for the comparison only) against the separate ops'
(NMSE), and the MoE blocks' router choices (the top-k ids of the op on each MoE input) where they differ. Run 161's
eager logits were 1.26 NMSE from the separate ops' with the deferral, 0.0012 without, while every layer's deferred
pair matched alone (``cuda_defer_locate.py``): a bug of the chain, or a router near-tie that one rounding flips?

    python backends/cuda/lab/scripts/cuda_defer_chain.py [--preset muse-small] [--format nvfp4]
"""

from __future__ import annotations

import contextlib

import torch

# (this folder is sys.path[0] when run as a script)
from cuda_defer_check import load_model
from musecore.model import DeferredNorm, MoE, separate_ops
from musecore.testing import nmse
from musecore_cuda import fused


def chain(model, tok, pos, cache) -> tuple[list, list, torch.Tensor]:
    """``forward``'s stages by hand: each layer's residual after its MoE sublayer, the MoE inputs' router ids and
    the logits."""
    residuals, ids = [], []
    x, a, positions, rope = model.embed(tok, pos, cache)
    for i, layer in enumerate(model.layers):
        h, m = model.attention_sublayer(i, x, a, positions, rope, cache, defer=True)
        m_seen = h.resolve(model.ops)[1] if isinstance(h, DeferredNorm) else m
        if isinstance(layer.mlp, MoE):
            b = layer.mlp
            ids.append(model.ops.router_topk(m_seen.reshape(1, -1), b.router, b.correction_bias, b.top_k,
                                             b.multiplier, b.scaling)[1].sort().values.flatten().tolist())
        x, a = model.feedforward_sublayer(i, h, m, defer=True)
        residuals.append((x.resolve(model.ops)[0] if isinstance(x, DeferredNorm) else x).clone())
    return residuals, ids, model.logits(a[:, -1:].contiguous())


def main() -> None:
    model = load_model(__doc__)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), 32, dtype=torch.long, device="cuda")
    runs = {}
    with torch.inference_mode():
        for name, defer in (("separate", False), ("fused", False), ("deferred", True)):
            fused.DEFER_MOE_NORM = defer
            cache = model.new_cache(1, 40, static=True)
            model.forward(prompt, cache=cache)
            with separate_ops(model) if name == "separate" else contextlib.nullcontext():
                runs[name] = chain(model, tok, pos, cache)
    for name, base in (("fused", "separate"), ("deferred", "separate"), ("deferred", "fused")):
        (want_res, want_ids, want_logits), (res, ids, logits) = runs[base], runs[name]
        print(f"{name} vs {base}: logits NMSE {nmse(want_logits, logits):.3g}; per layer residual NMSE "
              + " ".join(f"{nmse(w, g):.2g}" for w, g in zip(want_res, res)), flush=True)
        for j, (w, g) in enumerate(zip(want_ids, ids)):
            if w != g:
                print(f"  MoE block {j}: router ids {g} where {base} chose {w}", flush=True)


if __name__ == "__main__":
    main()
