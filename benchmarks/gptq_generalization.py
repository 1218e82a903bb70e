"""Does GPTQ's lower output error carry over from the calibration text to the evaluation text?

For every dense Linear of xeon6's default plan (attention, pooler/unpooler, lm_head) of muse-tiny:
output MSE ``||(W - Q) x||^2`` of RTN (producer rule), the least-error scale search (what xeon6 does at
load) and GPTQ (``convert_gptq`` on the matrix's 14,336 GPTQ calibration tokens, its held-out quarter
included) on the inputs the BF16 model gives that Linear on (a) the calibration text and (b) the
first ``--tokens`` of the held-out evaluation text. Summed per group, relative to RTN.

    OMP_NUM_THREADS=1 python benchmarks/gptq_generalization.py --tokens 4096 \\
        --out benchmarks/results/real_arch/gptq_generalization.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

import musecore
from musecore.calibrate import calibration_windows, capture_linear_inputs, dense_linear_names
from musecore.matrix import DENSE_GROUPS, GPTQ_CALIBRATION_TOKENS, calibration_tokens, load_eval_tokens
from musecore.names import weight_group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from musecore_quant import dequantize, quantize
    from musecore_quant.checkpoint import open_checkpoint
    from musecore_quant.formats.int4 import int4_quantize_min_error
    from musecore.calibrate_gptq import convert_gptq

    src = Path(musecore.__file__).parent / "data" / "muse-tiny"
    model = musecore.load(src, device="cpu", dtype=torch.float32, progress=False, quantize_dense=False)
    config = model.config
    names = dense_linear_names(model, DENSE_GROUPS)
    calibration = calibration_tokens(config.vocab_size, src, tokens=GPTQ_CALIBRATION_TOKENS, seed=1)
    stream, source = load_eval_tokens(src, None, args.tokens, config.vocab_size)
    texts = {"calibration text": calibration_windows(calibration, calibration.numel(), 512),
             "evaluation text": calibration_windows(stream, args.tokens, 512)}
    inputs = {label: capture_linear_inputs(model, ids, names, max_rows=ids.numel()) for label, ids in texts.items()}
    with tempfile.TemporaryDirectory() as tmp:
        convert_gptq(src, Path(tmp) / "gptq", calibration, tokens=calibration.numel(), experts="rtn",
                     dense_groups=DENSE_GROUPS, progress=False)
        reader, source_reader = open_checkpoint(Path(tmp) / "gptq"), open_checkpoint(src)
        sums: dict = defaultdict(lambda: defaultdict(float))
        for name in names:
            w = source_reader.read(name).float()
            approx = {"rtn": dequantize(quantize(w, "int4")), "least-error": dequantize(int4_quantize_min_error(w)[0]),
                      "gptq": dequantize(reader.read(name))}
            group = weight_group(name, config)[0]
            for label, rows in inputs.items():
                x = rows[name]
                for method, q in approx.items():
                    sums[(group, label)][method] += float(((x @ (q - w).T) ** 2).sum())
    result = []
    for (group, label), by_method in sums.items():
        line = {"group": group, "text": label, **{f"{m}_vs_rtn": v / by_method["rtn"] for m, v in by_method.items()}}
        result.append(line)
        print(f"{group:16s} {label:17s} output MSE vs RTN: least-error {line['least-error_vs_rtn']:.3f}, "
              f"GPTQ {line['gptq_vs_rtn']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": "OMP_NUM_THREADS=1 python benchmarks/gptq_generalization.py "
                                        + " ".join(sys.argv[1:]), "eval": source,
                                        "calibration_tokens": int(calibration.numel()), "rows": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
