"""Train the bundled muse-tiny model on the Python standard library, evaluate it, export it.

The model is ``MuseModel(MuseConfig.from_name("muse-tiny"))`` itself, with trainable tensors in
its weight slots (``trainable.py``): the graph that is trained is the graph that ships. Loss is
next-token cross-entropy plus a Switch-style load-balancing loss and a small router z-loss;
AdamW with linear warmup and cosine decay; bf16 autocast on a GPU.

``--time-budget S`` picks the number of steps from the measured step time (steps 10-40, which run
in the warmup and so do not depend on the total); the chosen number is printed and written to
``eval.json``, and ``--steps N`` reproduces that schedule exactly.

After training it writes the checkpoint (BF16, per-expert keys, two shards so that each file stays
under the device tool's 16 MiB transfer limit; ``merge_shards.py`` makes the single file that
ships), reloads it through the production loader and reference backend, and measures held-out
perplexity and greedy completions with that model.

Usage (the recorded run is in training/README.md)::

    PYTHONPATH=.:quant python training/train_muse_tiny.py --corpus .corpus --out $OUT --time-budget 230
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from musecore.backends.reference import ReferenceBackend
from musecore.config import MuseConfig
from musecore.model import MuseModel
from musecore.ops import Ops

from trainable import (TrainingBackend, checkpoint_tensors, install, load_balancing_loss, load_for_evaluation,
                       new_parameters, router_z_loss)

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "musecore/data/muse-tiny/tokenizer.json"
SLICE = REPO / "tests/data/stdlib_heldout_slice.jsonl"
BOS_ID, EOS_ID, PAD_ID = 0, 3, 7  # <|start|>, <|eot|>, <|pad|> (train_tokenizer.SPECIAL_TOKENS)
PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path(".corpus"), help="folder with train.i16, heldout.i16, tokens.json")
    p.add_argument("--out", type=Path, required=True, help="results: muse-tiny/ checkpoint, eval.json, train_log.jsonl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (fixes the cosine schedule)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of training; picks --steps after step 40")
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--balance-coef", type=float, default=0.02)
    p.add_argument("--z-coef", type=float, default=1e-3)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--embedding-std", type=float, default=1.0)
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 everywhere (CPU smoke runs)")
    p.add_argument("--reference-moe", action="store_true", help="train with the reference per-expert loop")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--eval-limit", type=int, default=None, help="evaluate only the first N held-out tokens (smoke runs)")
    p.add_argument("--sample-tokens", type=int, default=96)
    args = p.parse_args()
    if (args.steps is None) == (args.time_budget is None):
        p.error("give exactly one of --steps and --time-budget")
    return args


def read_tokens(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.int16).long()


def learning_rate(step: int, total: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def build_model(config: MuseConfig, backend: ReferenceBackend, params: dict[str, torch.Tensor]) -> MuseModel:
    model = MuseModel(config, Ops.from_backend(backend), dtype=torch.float32, device=backend.device)
    install(model, params)
    return model


def next_token_loss(model: MuseModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model.forward(x)  # [B,T,V] fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def check_against_reference(config: MuseConfig, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                            device: torch.device, bf16: bool) -> dict:
    """Loss and gradients of the training op table against the reference ops, same weights and batch."""
    reference = build_model(config, ReferenceBackend(device), params)
    training = build_model(config, TrainingBackend(device, all_experts=True), params)
    result = {}
    for label, use_bf16 in (("fp32", False), ("bf16_autocast", bf16)):
        with torch.no_grad(), autocast(device, use_bf16):
            a, b = next_token_loss(reference, x, y).item(), next_token_loss(training, x, y).item()
        result[f"loss_{label}_reference"], result[f"loss_{label}_training"] = a, b
        result[f"loss_{label}_abs_diff"] = abs(a - b)
    small_x, small_y = x[:2], y[:2]  # gradients in fp32 on two sequences: exact up to summation order
    grads = []
    for model in (reference, training):
        for p in params.values():
            p.grad = None
        next_token_loss(model, small_x, small_y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in params.values()]).double())
        for p in params.values():
            p.grad = None
    result["grad_nmse_fp32"] = float(((grads[0] - grads[1]) ** 2).sum() / (grads[0] ** 2).sum())
    return result


@torch.no_grad()
def perplexity(model: MuseModel, stream: torch.Tensor, seq_len: int, batch: int, use_autocast: bool = False) -> dict:
    """exp(mean NLL) over every token but the first, in non-overlapping windows of ``seq_len``."""
    device = model.device
    n = len(stream) - 1
    starts = list(range(0, n, seq_len))
    nll, count = 0.0, 0
    full = [s for s in starts if s + seq_len <= n]
    rest = [s for s in starts if s + seq_len > n]
    for i in range(0, len(full), batch):
        idx = torch.tensor(full[i:i + batch])[:, None] + torch.arange(seq_len + 1)
        chunk = stream[idx].to(device)
        with autocast(device, use_autocast):
            logits = model.forward(chunk[:, :-1])
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1), reduction="sum").item()
        count += chunk[:, 1:].numel()
    for s in rest:
        chunk = stream[s:n + 1][None].to(device)
        with autocast(device, use_autocast):
            logits = model.forward(chunk[:, :-1])
        nll += F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens": count}


@torch.no_grad()
def greedy_completion(model: MuseModel, tokenizer, prompt: str, new_tokens: int) -> str:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    ids = [BOS_ID] + prompt_ids
    for _ in range(new_tokens):
        nxt = int(model.forward(torch.tensor([ids]))[0, -1].argmax())
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    return tokenizer.decode(ids[1 + len(prompt_ids):])


def slice_stream(tokenizer) -> torch.Tensor:
    """The committed held-out slice, framed as in training (bos + file + eos per file)."""
    ids = []
    for line in SLICE.read_text(encoding="utf-8").splitlines():
        ids += [BOS_ID] + tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids + [EOS_ID]
    return torch.tensor(ids)


def save_checkpoint(folder: Path, config: MuseConfig, tensors: dict[str, torch.Tensor], shards: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total_bytes, running, parts = sum(nbytes.values()), 0, [[] for _ in range(shards)]
    for name in tensors:  # consecutive names, about the same bytes per shard
        parts[min(shards - 1, running * shards // total_bytes)].append(name)
        running += nbytes[name]
    weight_map = {}
    for s, part in enumerate(parts):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_checkpoint(folder: Path, device: torch.device) -> MuseModel:
    """The saved BF16 checkpoint with the reference ops and BF16 activations, as ``musecore.load`` gives it."""
    config = MuseConfig.from_pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return load_for_evaluation([str(folder / f) for f in sorted(set(index.values()))], config, device)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    use_bf16 = args.bf16 and device.type == "cuda"
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train_log.jsonl", "w")

    def note(record: dict) -> None:
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()

    meta = json.loads((args.corpus / "tokens.json").read_text())
    tokenizer_sha = hashlib.sha256(TOKENIZER.read_bytes()).hexdigest()
    if meta["tokenizer_sha256"] != tokenizer_sha:
        sys.exit(f"{args.corpus}/tokens.json was made with tokenizer {meta['tokenizer_sha256'][:12]} but {TOKENIZER} "
                 f"is {tokenizer_sha[:12]}; rerun training/train_tokenizer.py")
    train_stream = read_tokens(args.corpus / "train.i16")
    heldout_stream = read_tokens(args.corpus / "heldout.i16")
    assert len(train_stream) == meta["train"]["tokens"] and len(heldout_stream) == meta["heldout"]["tokens"]
    train_on_device = train_stream.to(device)

    config = MuseConfig.from_name("muse-tiny")
    params = new_parameters(config, device, args.seed, std=args.init_std, embedding_std=args.embedding_std)
    backend = TrainingBackend(device, all_experts=not args.reference_moe)
    model = build_model(config, backend, params)
    n_params = sum(p.numel() for p in params.values())
    note({"event": "start", "params": n_params, "device": str(device), "torch": torch.__version__,
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
          "train_tokens": len(train_stream), "heldout_tokens": len(heldout_stream), "args": {k: str(v) for k, v in vars(args).items()}})

    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        chunk = train_on_device[(starts[:, None] + offsets).to(device)]
        return chunk[:, :-1], chunk[:, 1:]

    x0, y0 = batch()
    check_start = check_against_reference(config, params, x0, y0, device, use_bf16)
    note({"event": "check_vs_reference_ops", "when": "init", **check_start})
    if (check_start["loss_fp32_abs_diff"] > 1e-3 or check_start["loss_bf16_autocast_abs_diff"] > 1e-2
            or check_start["grad_nmse_fp32"] > 1e-6):
        sys.exit("the training op table does not match the reference ops; not training")

    decay = [p for n, p in params.items() if p.dim() >= 2 and "embed_tokens" not in n and "output_norm" not in n]
    no_decay = [p for n, p in params.items() if not (p.dim() >= 2 and "embed_tokens" not in n and "output_norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    total = args.steps or args.max_steps
    calib_start, calib_end = 10, 40
    sums = torch.zeros(4, device=device)
    started = time.perf_counter()
    t_calib = started
    step = 0
    stopped_early = False
    while step < total:
        lr = learning_rate(step, total, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch()
        backend.router_logits.clear()
        with autocast(device, use_bf16):
            ce = next_token_loss(model, x, y)
        balance, fractions = load_balancing_loss(backend.router_logits, config.num_experts_per_tok)
        z_loss = router_z_loss(backend.router_logits)
        loss = ce + args.balance_coef * balance + args.z_coef * z_loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums += torch.stack([ce.detach(), balance.detach(), z_loss.detach(), grad_norm.detach()])
        step += 1
        if args.time_budget is not None and step in (calib_start, calib_end):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == calib_start:
                t_calib = now
            else:
                per_step = (now - t_calib) / (calib_end - calib_start)
                remaining = args.time_budget - (now - started)
                total = max(args.warmup_steps + 1, min(args.max_steps, step + int(0.97 * remaining / per_step)))
                note({"event": "steps_chosen", "seconds_per_step": per_step, "steps": total})
        if step % args.log_every == 0 or step == total:
            values = (sums / (step % args.log_every or args.log_every)).tolist()
            sums.zero_()
            elapsed = time.perf_counter() - started
            note({"event": "train", "step": step, "lr": lr, "ce": values[0], "balance": values[1], "z": values[2],
                  "grad_norm": values[3], "elapsed_s": round(elapsed, 1),
                  "expert_fraction_min": fractions.min().item(), "expert_fraction_max": fractions.max().item()})
            if args.time_budget is not None and elapsed > 1.15 * args.time_budget and step < total:
                note({"event": "stopped_early", "step": step, "planned_steps": total})
                stopped_early = True
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - started
    steps_done = step

    # -- export ---------------------------------------------------------------------------------
    export_config = dataclasses.replace(config, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    folder = args.out / "muse-tiny"
    save_checkpoint(folder, export_config, checkpoint_tensors(params, config))
    note({"event": "saved", "folder": str(folder), "train_seconds": round(train_seconds, 1), "steps": steps_done})

    # -- checks and evaluation ------------------------------------------------------------------
    check_end = check_against_reference(config, params, x0, y0, device, use_bf16)
    note({"event": "check_vs_reference_ops", "when": "end", **check_end})
    backend.record_router_logits = False
    limit = args.eval_limit or len(heldout_stream)
    fp32_eval = perplexity(model, heldout_stream[:limit], args.seq_len, args.eval_batch, use_autocast=use_bf16)
    note({"event": "heldout_fp32_weights", **fp32_eval})
    del model, params, optimizer, train_on_device
    shipped = load_checkpoint(folder, device)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    heldout = perplexity(shipped, heldout_stream[:limit], args.seq_len, args.eval_batch)
    note({"event": "heldout_bf16_checkpoint", **heldout})
    slice_eval = perplexity(shipped, slice_stream(tokenizer), args.seq_len, args.eval_batch) if SLICE.is_file() else None
    note({"event": "slice_bf16_checkpoint", **(slice_eval or {})})
    samples = {prompt: greedy_completion(shipped, tokenizer, prompt, args.sample_tokens) for prompt in PROMPTS}
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{prompt}{text}\n", flush=True)

    results = {
        "model": "muse-tiny", "parameters": n_params,
        "heldout": {**heldout, "split": "stdlib held-out files (training/corpus_manifest.tsv)",
                    "weights": "shipped BF16 checkpoint, production loader + reference ops, BF16 activations",
                    "windows": f"non-overlapping {args.seq_len}-token windows; every token but the first predicted"},
        "heldout_fp32_weights_bf16_autocast": fp32_eval,
        "heldout_slice": slice_eval,
        "greedy_completions": samples,
        "training": {"steps": steps_done, "planned_steps": total, "stopped_early": stopped_early,
                     "seconds": round(train_seconds, 1), "tokens_seen": steps_done * args.batch_size * args.seq_len,
                     "epochs": round(steps_done * args.batch_size * args.seq_len / len(train_stream), 2),
                     "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                     "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
                     "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "balance_coef": args.balance_coef,
                     "z_coef": args.z_coef, "init_std": args.init_std, "embedding_std": args.embedding_std,
                     "bf16_autocast": use_bf16, "moe_op": "reference loop" if args.reference_moe else "all-experts (checked)",
                     "seed": args.seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "python": platform.python_version()},
        "final_expert_fraction_per_layer": [[round(v, 4) for v in row] for row in fractions.tolist()],
        "op_check": {"init": check_start, "end": check_end},
        "corpus": {k: meta[k] for k in ("train", "heldout", "tokenizer_sha256")},
    }
    (args.out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    log.close()


if __name__ == "__main__":
    main()
