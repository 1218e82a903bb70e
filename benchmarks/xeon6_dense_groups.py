"""Which dense group costs xeon6's default plan its perplexity, under each technique.

On RTN INT4 experts (the int4-rtn recipe), each of attention, pooler/unpooler and lm_head is put
in INT4 alone (the other two BF16): rounded at load by the producer rule and by the least-error
search, and rounded by GPTQ into the checkpoint (experts RTN, that group GPTQ, built here with
``convert_gptq(..., experts="rtn", dense_groups=(group,))`` on the matrix's GPTQ calibration
tokens); then the mixed plans (two groups at load, least-error). Every line is measured against
BF16 on the same windows (the first ``--tokens`` of the matrix's held-out text, paired block
bootstrap 95% intervals), with KL(BF16 || row) and top-1 agreement. The 816B plan's bytes for each
group (BF16 vs INT4) come from ``musecore plan``.

    OMP_NUM_THREADS=1 python benchmarks/xeon6_dense_groups.py --tokens 16384 \\
        --out benchmarks/results/real_arch/xeon6_dense_groups.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import musecore
from musecore.evaluate import AccuracyMeter, batched_logits, eval_batches, evaluate, paired_bootstrap
from musecore.matrix import GPTQ_CALIBRATION_TOKENS, calibration_tokens, load_eval_tokens, requantization_rule

GROUPS = ("attention", "pooler/unpooler", "lm_head")
MIXED = (("pooler/unpooler", "lm_head"), ("attention", "pooler/unpooler", "lm_head"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from musecore.calibrate_gptq import convert_gptq
    from musecore_quant import convert
    from musecore.api import summarize
    from musecore.names import quantized_expert_patterns

    src = Path(musecore.__file__).parent / "data" / "muse-tiny"
    config = summarize(src)[0].config
    stream, source = load_eval_tokens(src, None, args.tokens, config.vocab_size)
    batches = eval_batches(stream, 512, 8)
    reference = musecore.load(src, device="cpu", progress=False)
    baseline = list(batched_logits(reference, batches))
    meter = AccuracyMeter()
    for (_, targets), logits in zip(batches, baseline):
        meter.update(targets, logits, logits)
    bf16_nll, _ = meter.per_token()
    bf16_ppl = meter.result().perplexity
    rows: list[dict] = []

    def measure(label: str, folder: Path, quantize_dense, rule: str) -> None:
        started = time.perf_counter()
        with requantization_rule(rule):
            model = musecore.load(folder, device="xeon6", emulate=True, progress=False, quantize_dense=quantize_dense)
        m = AccuracyMeter()
        acc = evaluate(model, batches, baseline, meter=m)
        nll, agree = m.per_token()
        ci = paired_bootstrap(nll, bf16_nll, agree)
        row = {"row": label, "delta_perplexity_pct": 100 * (acc.perplexity / bf16_ppl - 1),
               "delta_perplexity_pct_ci": [ci["delta_perplexity_pct"].low, ci["delta_perplexity_pct"].high],
               "kl": acc.kl, "top1_agreement": acc.top1_agreement,
               "top1_agreement_ci": [ci["top1_agreement"].low, ci["top1_agreement"].high],
               "seconds": time.perf_counter() - started}
        rows.append(row)
        print(f"{label:62s} dppl {row['delta_perplexity_pct']:+.2f}% [{row['delta_perplexity_pct_ci'][0]:+.2f}, "
              f"{row['delta_perplexity_pct_ci'][1]:+.2f}]  KL {acc.kl:.4f}  top-1 {acc.top1_agreement:.4f}", flush=True)

    calibration = calibration_tokens(config.vocab_size, src, tokens=GPTQ_CALIBRATION_TOKENS, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        rtn = Path(tmp) / "int4-rtn"
        convert(src, rtn, to="int4", include=quantized_expert_patterns(config), progress=False)
        measure("experts INT4 RTN only", rtn, False, "producer")
        for group in GROUPS:
            for rule in ("producer", "least-error"):
                measure(f"experts RTN + {group} INT4 at load ({rule})", rtn, (group,), rule)
            gptq = Path(tmp) / f"gptq-{group.replace('/', '-')}"
            convert_gptq(src, gptq, calibration, tokens=calibration.numel(), experts="rtn", dense_groups=(group,),
                         progress=False)
            measure(f"experts RTN + {group} INT4 GPTQ", gptq, False, "producer")
        for groups in MIXED:
            measure(f"experts RTN + {', '.join(groups)} INT4 at load (least-error)", rtn, groups, "least-error")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "OMP_NUM_THREADS=1 python benchmarks/xeon6_dense_groups.py " + " ".join(sys.argv[1:]),
            "eval": source, "bf16_perplexity": bf16_ppl, "gptq_calibration_tokens": int(calibration.numel()),
            "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average": os.getloadavg()},
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
