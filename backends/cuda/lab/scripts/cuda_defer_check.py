"""Session 79: muse-small's one-token decode logits with the MoE block's residual norm deferred into the next layer's
q/k/v/gate launch (``fused.DEFER_MOE_NORM``) and without, eager and from the captured decode graph, each against the
separate ops (NMSE), to tell a numerics change from a bug (run 160's A/B: the replayed step's logits 0.386 apart);
also the share of logits at the soft cap (saturation hides small differences) and any fused block's ticket counter
left non-zero after the replays (a miscounted ticket would change later launches). Session 80: then deferred with
PDL off (``MUSECORE_CUDA_PDL=0``) and with no early PDL signal (``MUSECORE_CUDA_PDL_EARLY=0``), to tell a race in
the PDL chain from an error in the launches themselves.

    python backends/cuda/lab/scripts/cuda_defer_check.py [--preset muse-small] [--format nvfp4]
"""

from __future__ import annotations

import argparse
import os

import torch

from musecore.api import load_random
from musecore.model import separate_ops
from musecore.testing import nmse
from musecore_cuda import fused


def load_model(doc: str):
    """The model of the session 79-80 deferral probes (this one, ``cuda_defer_locate.py``, ``cuda_defer_chain.py``):
    ``--preset`` (muse-small) in ``--format`` (nvfp4), random weights, on the GPU."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    args = p.parse_args()
    return load_random(args.preset, "h200", checkpoint_format=args.format)


def main() -> None:
    model = load_model(__doc__)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), 32, dtype=torch.long, device="cuda")

    def prefilled():
        cache = model.new_cache(1, 40, static=True)
        model.forward(prompt, cache=cache)
        return cache

    with torch.inference_mode():
        with separate_ops(model):
            want = model.forward(tok, pos, cache=prefilled())
        runs = [(False, {}), (True, {}), (False, {}), (True, {}), (True, {"MUSECORE_CUDA_PDL": "0"}),
                (True, {"MUSECORE_CUDA_PDL_EARLY": "0"}), (False, {"MUSECORE_CUDA_PDL": "0"})]
        for defer, env in runs:
            fused.DEFER_MOE_NORM = defer
            for name in ("MUSECORE_CUDA_PDL", "MUSECORE_CUDA_PDL_EARLY"):
                os.environ.pop(name, None)
            os.environ.update(env)
            model.release_generation_cache()
            eager = model.forward(tok, pos, cache=prefilled())
            step = model.decode_step(prefilled())
            graph = step(tok, pos).clone()
            again = step(tok, pos).clone()
            torch.cuda.synchronize()
            tickets = [(i, kind, b.fused.counters.flatten().tolist()) for i, layer in enumerate(model.layers)
                       for kind, b in (("attention", layer.self_attn), ("moe", layer.mlp))
                       if getattr(b, "fused", None) is not None and b.fused.counters.any()]
            print(f"DEFER_MOE_NORM={defer} {env or ''}: eager vs separate {nmse(want, eager):.3g}, graph vs separate "
                  f"{nmse(want, graph):.3g}, graph vs eager {nmse(eager, graph):.3g}, replay vs replay "
                  f"{nmse(graph, again):.3g}; logits saturated at the cap: "
                  f"{float((graph.abs() >= graph.abs().max()).float().mean()):.3f}; tickets left non-zero: "
                  f"{tickets or 'none'}", flush=True)


if __name__ == "__main__":
    main()
