"""Session 80: where the MoE block's deferred residual norm (``fused.DEFER_MOE_NORM``) goes wrong on muse-small
(run 161: the eager decode step's logits 1.26 NMSE from the separate ops' with it on, 0.0012 with it off, while
muse-tiny's GPU test passes at 1e-5). Per MoE layer ``i``, eager, on random one-token inputs, each against the
separate ops (NMSE):

* ``out``: the fused MoE block's output handed on unnormed (``DeferredNorm.out``) against the block's separate ops;
* ``resolved``: that ``DeferredNorm`` run by the ops (``resolve``) against the separate sublayer's pair;
* ``attn``: layer ``i + 1``'s fused attention sublayer taking the ``DeferredNorm`` against the separate ops' pair
  (and the cache's new k row);
* ``kernel``: ``qkv_gemv_rope_deferred`` on the ``DeferredNorm``'s tensors against ``qkv_gemv_rope`` on the
  resolved normed row (the projection ``y``, ``q`` and the new residual).

    python backends/cuda/lab/scripts/cuda_defer_locate.py [--preset muse-small] [--format nvfp4]
"""

from __future__ import annotations

import torch

# (this folder is sys.path[0] when run as a script)
from cuda_defer_check import load_model
from musecore.model import DeferredNorm, separate_ops
from musecore.testing import nmse, through_separate_ops
from musecore_triton.kernels.dense_gemv import qkv_gemv_rope, qkv_gemv_rope_deferred
from musecore_cuda import fused


def main() -> None:
    model = load_model(__doc__)
    fused.DEFER_MOE_NORM = True
    H = model.config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    caches = [model.new_cache(1, 64, static=True) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model.forward(prompt, cache=cache)
        positions = torch.tensor([[12]], device="cuda")
        rope = model.rope(positions)
        for i in range(len(model.layers) - 1):
            x, a = (torch.randn(1, 1, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
            try:
                deferred, none = model.feedforward_sublayer(i, x, a, defer=True)
                if not isinstance(deferred, DeferredNorm):
                    print(f"layer {i}: not deferred ({type(deferred).__name__})", flush=True)
                    continue
                row = {"residual is x": deferred.residual.data_ptr() == x.data_ptr()
                       or torch.equal(deferred.residual, x)}
                row["out"] = nmse(through_separate_ops(model.layers[i].mlp, a), deferred.out)
                with separate_ops(model):
                    want = model.feedforward_sublayer(i, x, a)
                resolved = deferred.resolve(model.ops)
                row["resolved res"], row["resolved normed"] = (nmse(w, g) for w, g in zip(want, resolved))
                block = model.layers[i + 1].self_attn
                lc = caches[1][i + 1]
                cos, sin = rope if block.rope else (None, None)
                ff = block.fused
                counters = torch.zeros_like(ff.counters)[1:]
                qkv = (ff.in_proj, block.nq, block.nkv, cos, sin, block.eps, block.q_scale)
                k1, v1, p1 = (t.clone() for t in (lc.k, lc.v, lc.positions))
                k2, v2, p2 = (t.clone() for t in (lc.k, lc.v, lc.positions))
                y0, q0 = qkv_gemv_rope(resolved[1].reshape(1, -1), *qkv, k1, v1, p1, positions, lc.capacity,
                                       lc.ring, counters)
                y1, q1, r1 = qkv_gemv_rope_deferred((deferred.out.reshape(1, -1), deferred.residual.reshape(1, -1),
                                                     *deferred.norm), *qkv, k2, v2, p2, positions, lc.capacity,
                                                    lc.ring, counters)
                row["kernel y"], row["kernel q"] = nmse(y0, y1), nmse(q0, q1)
                row["kernel res"] = nmse(resolved[0], r1)
                row["kernel cache k"] = nmse(k1, k2)
                got = model.attention_sublayer(i + 1, deferred, None, positions, rope, caches[0])
                with separate_ops(model):
                    want2 = model.attention_sublayer(i + 1, *want, positions, rope, caches[1])
                row["attn res"], row["attn normed"] = (nmse(w, g) for w, g in zip(want2, got))
                row["attn cache k"] = nmse(caches[1][i + 1].k, caches[0][i + 1].k)
                print(f"layer {i} -> {i + 1}: " + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
            except Exception as e:  # noqa: BLE001 - a lab probe: report and go on to the next layer
                print(f"layer {i}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
