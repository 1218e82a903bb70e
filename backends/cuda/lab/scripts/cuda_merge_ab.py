"""A/B of the split-keys merge in muse-small's batch-1 decode at long contexts, in one process (session 44, issue 26).

Decode attention splits the keys over programs once a context passes ~256 tokens (``attention`` in
``musecore_triton.kernels.attention``); the partials were merged by ~10 PyTorch ops plus the head-norm kernel, and are
now merged by ``merge_splits_kernel`` (one launch, the gate in its epilogue). ``old`` puts the PyTorch merge back in
place of the kernel (this script's shim: the same ops, then one copy into the output), ``new`` is the kernel. Per
prompt length: ``generate`` per token, the graph replay of one step and its kernels, alternated ``--rounds`` times.

    python backends/cuda/lab/scripts/cuda_merge_ab.py [--prompts 32,1000,4000] [--out merge_ab.json]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from cuda_decode_host_probe import decode_numbers, save_rows  # this folder is sys.path[0] when run as a script
from musecore.api import load_random
from musecore_triton.kernels import attention as attention_module
from musecore_triton.kernels.norms import head_norm_gate


def _merge_splits(partial: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """The merge before session 44: split-S partials ``[splits, BH, R, D]`` by log2-sum-exp -> ``[BH, R, D]``."""
    m, l = ml[..., 0], ml[..., 1]
    m_max = m.amax(0)
    m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    w = torch.exp2(m - m_max)
    denom = (w * l).sum(0)
    num = (w[..., None] * partial).sum(0)
    return torch.where(denom[..., None] > 0, num / denom.clamp_min(1e-30)[..., None], torch.zeros_like(num))


class _TorchMerge:
    """Stands in for ``merge_splits_kernel[grid](...)``: the PyTorch merge and the head-norm kernel."""

    def __getitem__(self, grid):
        def run(partial, ml, out, splits, nkv, rows, rows_pad, so_b, so_t, so_h, g, sg_b, sg_t, eps, *, G, D, GATE,
                **launch):
            B, T, nq, d = out.shape
            merged = _merge_splits(partial, ml)[:, :rows]
            out.copy_(merged.reshape(B, nkv, T, G, d).permute(0, 2, 1, 3, 4).reshape(B, T, nq, d))
            if GATE:
                out.copy_(head_norm_gate(out, g, eps))
        return run


@contextlib.contextmanager
def torch_merge():
    kernel = attention_module.merge_splits_kernel
    attention_module.merge_splits_kernel = _TorchMerge()
    try:
        yield
    finally:
        attention_module.merge_splits_kernel = kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--prompts", default="32,1000,4000")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="cuda_merge_ab.json")
    args = p.parse_args()
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    rows = []
    for length in (int(n) for n in args.prompts.split(",")):
        prompt = torch.randint(0, model.config.vocab_size, (1, length)).tolist()
        for r in range(args.rounds):
            for mode in ("new", "old"):
                with contextlib.nullcontext() if mode == "new" else torch_merge():
                    row = {"prompt": length, "round": r, "mode": mode, **decode_numbers(model, prompt)}
                    print(row, flush=True)
                    rows.append(row)
    for length in sorted({r["prompt"] for r in rows}):
        for mode in ("new", "old"):
            mine = [r for r in rows if r["mode"] == mode and r["prompt"] == length]
            print(f"prompt {length} {mode}: replay {min(r['replay_us'] for r in mine)} us, generate "
                  f"{min(r['generate_us_per_token'] for r in mine)} us/token, {mine[0]['kernels_per_step']} kernels")
    save_rows(args.out, args, rows)


if __name__ == "__main__":
    main()
