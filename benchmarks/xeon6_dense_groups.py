"""Which dense group costs xeon6's default plan its perplexity: each group alone in INT4 (producer RTN
and least-error), on the int4-rtn checkpoint (experts INT4 RTN), against BF16, on the held-out slice.

    OMP_NUM_THREADS=1 python benchmarks/xeon6_dense_groups.py ~/.cache/musecore/matrix/muse-tiny-*/int4-rtn OUT.json
"""
import os, sys, json
import torch, musecore
from pathlib import Path
from musecore.matrix import load_eval_tokens, DEFAULT_EVAL_TEXT
from musecore.evaluate import eval_batches, evaluate, AccuracyMeter, batched_logits, paired_bootstrap
src = Path(musecore.__file__).parent / "data" / "muse-tiny"
ckpt = Path(sys.argv[1])  # the matrix cache's int4-rtn checkpoint
stream, _ = load_eval_tokens(src, None, None, 4096)
batches = eval_batches(stream, 512, 8)
ref = musecore.load(src, device="cpu", progress=False)
base = list(batched_logits(ref, batches)); m0 = AccuracyMeter()
for (_, t), l in zip(batches, base): m0.update(t, l, l)
bnll, _ = m0.per_token(); bppl = m0.result().perplexity
out = {}
for groups in ("attention", "pooler/unpooler", "lm_head"):
    for rule in ("producer", "least-error"):
        os.environ["MUSECORE_REQUANTIZATION"] = rule
        model = musecore.load(ckpt, device="xeon6", emulate=True, progress=False, quantize_dense=groups)
        meter = AccuracyMeter(); acc = evaluate(model, batches, base, meter=meter)
        nll, agree = meter.per_token(); ci = paired_bootstrap(nll, bnll, agree)["delta_perplexity_pct"]
        d = 100 * (acc.perplexity / bppl - 1)
        print(f"{groups:16s} {rule:12s} dppl {d:+.2f}% [{ci.low:+.2f}, {ci.high:+.2f}] top1 {acc.top1_agreement:.4f}", flush=True)
        out[f"{groups}|{rule}"] = {"delta_perplexity_pct": d, "ci": [ci.low, ci.high], "top1": acc.top1_agreement}
if len(sys.argv) > 2:
    json.dump(out, open(sys.argv[2], "w"), indent=1)
