"""Greedy tokens and decode logits of a random-weight muse-small cut to ``--layers`` (the INT4 xeon plan) on the tree
``musecore`` imports from, saved to ``--out`` (a torch file) for a bit-for-bit comparison between two trees
(``--compare A B``): plumbing changes must give the same bits.

    python3 backends/xeon/lab/scripts/decode_bits_ab.py --out /tmp/after.pt [--layers 3] [--threads 2] [--tokens 48]
    python3 backends/xeon/lab/scripts/decode_bits_ab.py --compare /tmp/before.pt /tmp/after.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
    import xeon_decode_profile as profile
    torch.set_num_threads(args.threads)
    model = profile.load("int4", args.layers)
    prompt = torch.tensor([[(7 * i + 3) % 1000 + 1 for i in range(19)]])
    cache = model.new_cache(1, 19 + args.tokens + 1)
    logits, tokens = [], []
    with torch.inference_mode():
        out = model.forward(prompt, cache=cache)
        logits.append(out[0, -1].clone())
        token = int(out[0, -1].argmax())
        for s in range(args.tokens):
            tokens.append(token)
            out = model.forward(torch.tensor([[token]]), positions=torch.tensor([[19 + s]]), cache=cache)
            logits.append(out[0, -1].clone())
            token = int(out[0, -1].argmax())
    torch.save({"tokens": tokens, "logits": torch.stack(logits), "musecore": __import__("musecore").__file__}, args.out)
    print(f"{args.out}: {len(tokens)} tokens, first {tokens[:8]}")


def compare(a: str, b: str) -> None:
    x, y = torch.load(a), torch.load(b)
    same_tokens = x["tokens"] == y["tokens"]
    diff = (x["logits"] - y["logits"]).abs().max().item()
    equal = torch.equal(x["logits"], y["logits"])
    print(f"{x['musecore']} vs {y['musecore']}: tokens equal {same_tokens}, logits of all {len(x['logits'])} steps "
          f"bit-equal {equal} (max |diff| {diff:.3g})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
