"""A/B of prefetching the next sublayer's dense weights into L2 during muse-small's batch-1 decode (session 49).

A batch-1 step is ~150 dependent kernels; its dense 16-bit GEMVs (~20 MB per layer: the fused q/k/v/gate, o_proj,
the router, the pooler and the unpooler) run at ~25% of the memory ceiling, each mostly its ramp and tail. Here a
side stream of the captured step issues Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2.global``: the TMA
unit fetches the bytes into L2, no registers or SM load slots) of the weights the main stream reads next:

- at layer i's attention sublayer, its own MoE block's router, pooler and unpooler;
- at layer i's feed-forward sublayer, layer i + 1's q/k/v/gate and o_proj.

The side stream joins the main one before the logits, so the graph still ends with everything done. Modes:
``none`` (the routed code), ``prefetch`` (both points), ``evict_last`` (both, with an evict-last L2 policy),
``attn_only`` (only the next layer's attention weights).
Same random weights, same prompt, alternated ``--rounds`` times; the step's logits are compared with ``none``'s.

    python backends/cuda/lab/scripts/cuda_l2_prefetch_ab.py [--rounds 3] [--out cuda_l2_prefetch_ab.json]
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# (this folder is sys.path[0] when run as a script)
from cuda_decode_host_probe import _prefilled_step, ab_arguments, decode_numbers, print_medians, save_rows
from musecore.api import load_random

MODES = ("none", "prefetch", "evict_last", "attn_only")
CHUNK = 32 << 10  # bytes per bulk prefetch (one thread each)
BLOCK = 128


@triton.jit
def bulk_prefetch_kernel(table_ptr, n, sink_ptr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Entry ``i`` of ``table [n, 2]`` (device address, bytes: a multiple of 16) fetched into L2 by thread ``i``
    (``EVICT_LAST``: with an evict-last cache policy)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    addr = tl.load(table_ptr + 2 * i, mask=m, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=m, other=0).to(tl.int32)
    if EVICT_LAST:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, r, mask=m & (size < 0))  # never stored: keeps the asm live


class Prefetch:
    """One launch that fetches ``tensors`` (each 16-byte aligned) into L2, in ``CHUNK`` pieces."""

    evict_last = False

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        rows = []
        for t in tensors:
            start, nbytes = t.data_ptr(), t.numel() * t.element_size() // 16 * 16
            assert start % 16 == 0 and t.is_contiguous(), "bulk prefetch takes contiguous, 16-byte aligned tensors"
            rows += [(start + o, min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)]
        self.bytes = sum(r[1] for r in rows)
        self.table = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)
        self.sink = torch.zeros(len(rows), dtype=torch.int32, device=tensors[0].device)

    def __call__(self) -> None:
        n = self.table.shape[0]
        bulk_prefetch_kernel[(triton.cdiv(n, BLOCK),)](self.table, n, self.sink, BLOCK=BLOCK,
                                                      EVICT_LAST=Prefetch.evict_last, num_warps=BLOCK // 32)


def layer_sets(model) -> tuple[list[Prefetch], list[Prefetch]]:
    """Per layer: (its attention block's weights, its MoE block's weights) as prefetches (None where not fused)."""
    attn, moe = [], []
    for layer in model.layers:
        fa, fm = layer.self_attn.fused, getattr(layer.mlp, "fused", None)
        attn.append(Prefetch([fa.in_proj, fa.o_proj]) if fa is not None else None)
        moe.append(Prefetch([fm.pooler, fm.unpooler, layer.mlp.router]) if fm is not None else None)
    return attn, moe


@contextlib.contextmanager
def mode_of(model, mode: str, sets):
    if mode == "none":
        yield
        return
    attn, moe = sets
    side = torch.cuda.Stream(model.device)
    Prefetch.evict_last = mode == "evict_last"
    cls = type(model)

    def launch(p) -> None:
        if p is None:
            return
        main = torch.cuda.current_stream(model.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            p()

    def attention_sublayer(i, *a, **k):
        if mode != "attn_only":
            launch(moe[i])
        return cls.attention_sublayer(model, i, *a, **k)

    def feedforward_sublayer(i, *a, **k):
        if i + 1 < len(attn):
            launch(attn[i + 1])
        return cls.feedforward_sublayer(model, i, *a, **k)

    def logits(a):
        torch.cuda.current_stream(model.device).wait_stream(side)  # the side stream joins before the step ends
        return cls.logits(model, a)

    model.attention_sublayer, model.feedforward_sublayer, model.logits = (attention_sublayer, feedforward_sublayer,
                                                                          logits)
    try:
        yield
    finally:
        del model.attention_sublayer, model.feedforward_sublayer, model.logits
        Prefetch.evict_last = False


def main() -> None:
    args = ab_arguments("cuda_l2_prefetch_ab.json")
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    sets = layer_sets(model)
    print(f"prefetched per layer: attention {sets[0][1].bytes / 1e6:.1f} MB, MoE {sets[1][1].bytes / 1e6:.1f} MB")
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    logits = {}
    for mode in MODES:  # the same step's logits in every mode (prefetching changes no value)
        with mode_of(model, mode, sets):
            step, tok, pos = _prefilled_step(model, prompt, 8)
            logits[mode] = step(tok, pos).float().clone()
    worst = max((logits[m] - logits["none"]).abs().max().item() for m in MODES)
    print(f"largest logit difference from 'none': {worst}")
    rows = []
    for r in range(args.rounds):
        for mode in MODES:
            with mode_of(model, mode, sets):
                row = {"round": r, "mode": mode, **decode_numbers(model, prompt, kernels=False)}
                print(row)
                rows.append(row)
    print_medians(rows, MODES)
    rows.append({"mode": "check", "largest_logit_difference": worst})
    save_rows(args.out, args, rows)


if __name__ == "__main__":
    main()
