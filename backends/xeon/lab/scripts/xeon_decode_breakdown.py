"""Where a muse-small decode step goes on the xeon backend: each op of the graph (every op of the operator
interface but ``sample``, ``musecore.ops.OPS``: the router, the pooler's norm, the shared post-expert norm inside
``moe``, the gated residual norms, ``silu_mul`` of dense-MLP layers, the logit softcap) wrapped with a timer,
32 decode steps after a 32-token prefill (NVFP4 checkpoint, experts converted to INT4 as the plan does; random
weights)::

    python3 backends/xeon/lab/scripts/xeon_decode_breakdown.py [--threads 2] [--preset muse-small] [--quantize-dense]
        [--checkpoint-format bf16] [--steps 32]

Prints the step time without and with the timers, then per op: ms per token, calls per token and us per call,
and the time spent outside the ops (the graph's own Python and tensor bookkeeping).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from musecore.api import load_random
from musecore.ops import OPS as ALL_OPS

OPS = tuple(op for op in ALL_OPS if op != "sample")  # the ops one forward calls (sampling is generate's)


def decode_steps(model, steps: int, after_prefill=lambda: None) -> float:
    """Seconds per decode step after a 32-token prefill (``after_prefill`` runs between the two)."""
    cache = model.new_cache(1, 256)
    with torch.inference_mode():
        model.forward(torch.arange(1, 33)[None], cache=cache)
        after_prefill()
        start = time.perf_counter()
        for s in range(steps):
            model.forward(torch.tensor([[5]]), positions=torch.tensor([[32 + s]]), cache=cache)
        return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--checkpoint-format", default="nvfp4", choices=("nvfp4", "bf16"),
                   help="bf16: every weight BF16 (the baseline the INT4 ratios are taken against)")
    p.add_argument("--quantize-dense", action="store_true",
                   help="also convert the dense groups (attention, pooler/unpooler, lm_head, dense MLP) to INT4")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_random(args.preset, "xeon", checkpoint_format=args.checkpoint_format,
                        quantize_dense=args.quantize_dense)
    decode_steps(model, 4)
    plain = decode_steps(model, args.steps)
    spent, calls = collections.defaultdict(float), collections.Counter()
    for name in OPS:
        fn = getattr(model.ops, name)

        def timed(*a, _fn=fn, _name=name, **k):
            start = time.perf_counter()
            out = _fn(*a, **k)
            spent[_name] += time.perf_counter() - start
            calls[_name] += 1
            return out
        setattr(model.ops, name, timed)
    decode_steps(model, 2)
    wrapped = decode_steps(model, args.steps, after_prefill=lambda: (spent.clear(), calls.clear()))
    label = args.checkpoint_format + (" + quantize_dense" if args.quantize_dense else "")
    print(f"{args.preset} ({label}), {args.threads} threads: decode step {plain * 1e3:.2f} ms ({wrapped * 1e3:.2f} ms with timers)")
    n = args.steps
    inside = 0.0
    for name, total in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:15} {total / n * 1e3:7.2f} ms/token  {calls[name] / n:5.1f} calls/token  "
              f"{total / calls[name] * 1e6:8.1f} us/call")
        inside += total
    print(f"  outside the ops: {(wrapped - inside / n) * 1e3:.2f} ms/token")


if __name__ == "__main__":
    main()
