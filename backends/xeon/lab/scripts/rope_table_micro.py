"""The rotary rows of one decode step (``MuseModel.rope(positions [1,1])``, muse-small's head_dim 64) on the tree
that ``musecore`` imports from: per-step formula (4a8391e and before) or the CPU table (session 38). Warm, inference
mode, positions advancing as in decode; median of rounds, wall us per call.

    python3 backends/xeon/lab/scripts/rope_table_micro.py [--rounds 7] [--calls 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from musecore.config import MuseConfig
from musecore.rope import RotaryTable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    config = MuseConfig.from_name("muse-small")
    table = RotaryTable(config.head_dim, config.rope_parameters, config.max_position_embeddings)
    positions = [torch.tensor([[32 + i]]) for i in range(args.calls)]
    rounds = []
    with torch.inference_mode():
        for pos in positions[:200]:
            table(pos)
        for _ in range(args.rounds):
            start = time.perf_counter()
            for pos in positions:
                table(pos)
            rounds.append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"{__import__('musecore').__file__}: rope rows per decode step {statistics.median(rounds):.2f} us "
          f"(rounds {', '.join(f'{r:.2f}' for r in rounds)})")


if __name__ == "__main__":
    main()
