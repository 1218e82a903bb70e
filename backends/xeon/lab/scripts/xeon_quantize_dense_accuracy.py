"""Accuracy of ``quantize_dense`` on the bundled muse-tiny: the reference BF16 model as baseline, then
the xeon backend with INT4 experts only (``quantize_dense=False``, MODEL.md's INT4 export as it is),
with attention and lm_head in INT4 as well, with the xeon default plan (``quantize_dense=None``: the
device's dense groups, ``musecore.planning.dense_groups``), and (``--per-group``) with each group of
``DENSE_QUANTIZABLE`` alone (attention, pooler/unpooler, lm_head, the dense-MLP layers' projections).

    python backends/xeon/lab/scripts/xeon_quantize_dense_accuracy.py [--tokens 4096] [--per-group] [--eval-text FILE]

The evaluation text defaults to the committed held-out slice (4,620 tokens); ``--eval-text
.corpus/heldout.jsonl`` reads the held-out split that ``training/build_corpus.py`` writes.
"""

from __future__ import annotations

import argparse
import json

import musecore
from musecore.api import resolve_model
from musecore.devices import CATALOG
from musecore.matrix import evaluate, load_eval_tokens
from musecore.planning import DENSE_QUANTIZABLE, dense_groups
from musecore.evaluate import batched_logits, eval_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--per-group", action="store_true", help="also each dense group alone")
    parser.add_argument("--eval-text", default=None, help=".jsonl of {\"text\": ...} documents or plain text")
    args = parser.parse_args()
    _, folder = resolve_model("muse-tiny")
    reference = musecore.load(folder, device="cpu", progress=False)
    stream, source = load_eval_tokens(folder, args.eval_text, args.tokens, reference.config.vocab_size)
    batches = eval_batches(stream, args.seq_len, 4)
    baseline = list(batched_logits(reference, batches))
    rows = [{"model": "bf16 reference", **vars(evaluate(reference, batches, baseline))}]
    variants = [False, ("attention", "lm_head"), None]
    variants += [(group,) for group in DENSE_QUANTIZABLE] if args.per_group else []
    for dense in variants:
        model = musecore.load(folder, device="xeon", progress=False, quantize_dense=dense)
        if dense is None:
            label = "xeon default plan: int4 experts + " + ", ".join(dense_groups(None, CATALOG["xeon"]))
        else:
            label = "xeon int4 experts" + (f" + {', '.join(dense_groups(dense))}" if dense else " only")
        rows.append({"model": label, **vars(evaluate(model, batches, baseline))})
    print(source)
    for row in rows:
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}))


if __name__ == "__main__":
    main()
