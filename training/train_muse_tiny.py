"""Train the bundled muse-tiny model on the Python standard library, evaluate it, export it.

The trainable model is transformers' own ``MuseSparkForConditionalGeneration`` (transformers 5.24.0,
the model's reference implementation) built from ``muse_tiny.muse_tiny_config()``: what is trained
is what ships. Only the text decoder and the LM head are trained (the corpus is text); the vision
and audio towers keep their random initialisation.

Loss: next-token cross-entropy plus DeepSeek-V3's sequence-wise balance loss with a tiny weight
(``--seq-balance-coef``, 1e-4). Routing balance comes mainly from DeepSeek-V3's auxiliary-loss-free
rule: after every optimizer step ``e_score_correction_bias[e] += gamma * sign(mean_load - load[e])``
per layer, ``load`` = tokens routed to expert e in that step (read with a forward hook on
``MuseSparkTopkRouter``). AdamW with linear warmup and cosine decay; bf16 autocast on a GPU (fp32
master weights; the router and the routed experts' grouped matmuls are kept as transformers means
them: the router in fp32, the experts in the autocast dtype, see ``patch_for_autocast``).

``--time-budget S`` picks the number of steps from the measured step time (steps 10-40, in the
warmup, so they do not depend on the total); the chosen number is printed and written to
``eval.json``, and ``--steps N`` reproduces that schedule.

After training it writes the checkpoint with ``save_pretrained`` in BF16 (``from_pretrained(...,
dtype=torch.bfloat16)`` of the fp32 weights, which keeps transformers' ``_keep_in_fp32_modules_strict``
tensors in fp32), as two shards so that each file stays under the device tool's 16 MiB limit
(``merge_shards.py`` makes the single file that ships), reloads it with ``from_pretrained`` and
measures held-out perplexity, CI-slice perplexity, expert load and greedy completions with it.

Usage (the recorded run is in training/README.md)::

    python training/train_muse_tiny.py --corpus .corpus --out $OUT --time-budget 225
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from muse_tiny import (BOS_ID, PAD_ID, PROMPTS, SLICE, STOP_IDS, TOKENIZER, TRAINED_PREFIXES,  # noqa: E402
                       muse_tiny_config, start_run, perplexity, slice_stream)


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
    p.add_argument("--bias-update-rate", type=float, default=1e-3, help="gamma of the loss-free balancing rule")
    p.add_argument("--seq-balance-coef", type=float, default=1e-4, help="alpha of the sequence-wise balance loss")
    p.add_argument("--embedding-std", type=float, default=1.0,
                   help="re-initialise the token embedding normal(0, std); 0 keeps transformers' init (0.02)")
    p.add_argument("--experts-implementation", default="grouped_mm", choices=("grouped_mm", "eager"))
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 everywhere (CPU smoke runs)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--load-window", type=int, default=200, help="report expert load over the last N steps")
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--eval-limit", type=int, default=None, help="evaluate only the first N held-out tokens (smoke runs)")
    p.add_argument("--sample-tokens", type=int, default=96)
    p.add_argument("--shard-size", default="15MB", help="save_pretrained max_shard_size (device files <= 16 MiB)")
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


def patch_for_autocast() -> None:
    """Two places where autocast would change what transformers' code means, for fp32 master weights.

    - ``MuseSparkTopkRouter.forward`` casts to fp32 and calls ``F.linear``, which autocast would
      run in bf16; the router runs with autocast off, as in inference (its weight is fp32 there).
    - the grouped-matmul experts path casts the activations to the *weight* dtype (fp32 masters
      here) because ``grouped_mm`` is not autocast-aware; under autocast both are cast to the
      autocast dtype instead, as autocast does for every ``F.linear``. Without autocast nothing
      changes.
    """
    import transformers.integrations.moe as moe
    from transformers.models.muse_spark import modeling_muse_spark as msm

    router_forward = msm.MuseSparkTopkRouter.forward
    if not getattr(router_forward, "_fp32_patched", False):
        def forward(self, hidden_states):
            with torch.autocast(hidden_states.device.type, enabled=False):
                return router_forward(self, hidden_states)
        forward._fp32_patched = True
        msm.MuseSparkTopkRouter.forward = forward

    grouped_mm = moe._grouped_mm
    if not getattr(grouped_mm, "_autocast_patched", False):
        def _grouped_mm(input, weight, offs):
            kind = input.device.type
            if torch.is_autocast_enabled(kind):
                dtype = torch.get_autocast_dtype(kind)
                return grouped_mm(input.to(dtype), weight.to(dtype), offs)
            return grouped_mm(input, weight, offs)
        _grouped_mm._autocast_patched = True
        moe._grouped_mm = _grouped_mm


class RouterTap:
    """Forward hooks on every ``MuseSparkTopkRouter``: per-layer expert counts and the balance loss."""

    def __init__(self, model, num_experts: int, top_k: int):
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, MuseSparkTopkRouter)]
        self.E, self.K = num_experts, top_k
        device = next(model.parameters()).device
        self.counts = torch.zeros(len(self.routers), num_experts, device=device)  # since the last reset
        self.seq_losses: list[torch.Tensor] = []
        self.want_loss = False
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            router_logits, _, topk_indices = output
            flat = topk_indices.reshape(-1)
            with torch.no_grad():  # index_add_, not bincount: no host sync on a GPU
                self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))
            if self.want_loss:
                shape = inputs[0].shape  # [B, T, H]
                B, T = (shape[0], shape[1]) if len(shape) == 3 else (1, shape[0])
                # DeepSeek-V3 eq. 17-20: L = sum_e f_e P_e per sequence; f_e = E/(K T) * tokens routed to e,
                # P_e = mean over the sequence of s_e / sum_j s_j (s = sigmoid scores). 1.0 when balanced.
                scores = torch.sigmoid(router_logits.float()).view(B, T, self.E)
                p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E]
                hits = torch.zeros(B, self.E, device=scores.device).scatter_add_(
                    1, topk_indices.view(B, T * self.K), torch.ones(B, T * self.K, device=scores.device))  # [B, E]
                f = hits * self.E / (self.K * T)
                self.seq_losses.append((f * p).sum(-1).mean())
        return hook

    def take_loss(self) -> torch.Tensor:
        loss = torch.stack(self.seq_losses).mean()
        self.seq_losses.clear()
        return loss

    @torch.no_grad()
    def update_biases(self, step_counts: torch.Tensor, rate: float) -> None:
        """Loss-free balancing: bias_e += rate * sign(mean load - load_e), per layer."""
        for layer, router in enumerate(self.routers):
            load = step_counts[layer]
            router.e_score_correction_bias += rate * torch.sign(load.mean() - load)

    def biases(self) -> list[list[float]]:
        return [[round(v, 4) for v in r.e_score_correction_bias.tolist()] for r in self.routers]


def load_summary(counts: torch.Tensor) -> dict:
    frac = counts / counts.sum(-1, keepdim=True)
    E = counts.shape[-1]
    return {"fraction_per_layer": [[round(v, 4) for v in row] for row in frac.tolist()],
            "max_over_mean_per_layer": [round(v, 3) for v in (frac.max(-1).values * E).tolist()],
            "min_over_mean_per_layer": [round(v, 3) for v in (frac.min(-1).values * E).tolist()]}


def next_token_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def check_experts_implementations(model, x: torch.Tensor, y: torch.Tensor, device: torch.device, bf16: bool,
                                  trainable: list) -> dict:
    """The implementation used for training against transformers' eager (reference) experts loop.

    Same weights and batch: the loss in fp32 and under bf16 autocast, and the fp32 gradients on two
    sequences. A failure is recorded, not raised (``main`` decides).
    """
    used = model.config._experts_implementation
    result = {"experts_implementation": used}
    if used == "eager":
        return result
    for label, use_bf16 in (("fp32", False), ("bf16_autocast", bf16)):
        try:
            losses = {}
            for impl in ("eager", used):
                model.set_experts_implementation(impl)
                with torch.no_grad(), autocast(device, use_bf16):
                    losses[impl] = next_token_loss(model, x, y).item()
            result[f"loss_{label}_eager"], result[f"loss_{label}_{used}"] = losses["eager"], losses[used]
            result[f"loss_{label}_abs_diff"] = abs(losses["eager"] - losses[used])
        except Exception as e:  # noqa: BLE001
            result[f"error_{label}"] = f"{type(e).__name__}: {e}"[:500]
    try:
        grads = []
        for impl in ("eager", used):  # fp32 gradients on two sequences
            model.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True)
            next_token_loss(model, x[:2], y[:2]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in trainable]).double())
        result["grad_nmse_fp32"] = float(((grads[0] - grads[1]) ** 2).sum() / (grads[0] ** 2).sum())
    except Exception as e:  # noqa: BLE001
        result["error_grad_fp32"] = f"{type(e).__name__}: {e}"[:500]
    model.zero_grad(set_to_none=True)
    model.set_experts_implementation(used)
    return result


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, new_tokens: int) -> dict:
    """transformers' ``generate`` (greedy, KV cache), checked against a no-cache full-forward argmax loop."""
    device = next(model.parameters()).device
    prompt_ids = [BOS_ID] + tokenizer.encode(prompt, add_special_tokens=False).ids
    x = torch.tensor([prompt_ids], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=STOP_IDS, pad_token_id=PAD_ID)
    gen = out[0, len(prompt_ids):].tolist()
    ids = list(prompt_ids)
    for _ in range(new_tokens):
        nxt = int(model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt in STOP_IDS:
            break
    loop = ids[len(prompt_ids):]
    agree = next((i for i, (a, b) in enumerate(zip(gen, loop)) if a != b), min(len(gen), len(loop)))
    return {"prompt": prompt, "completion": tokenizer.decode(gen, skip_special_tokens=False), "new_tokens": len(gen),
            "stopped_on": gen[-1] if gen and gen[-1] in STOP_IDS else None,
            "generate_matches_no_cache_loop": gen == loop, "tokens_agreeing_with_no_cache_loop": agree}


def main() -> None:
    args = parse_args()
    device, use_bf16, log = start_run(args)
    note = log.note

    import transformers
    from tokenizers import Tokenizer
    from transformers import MuseSparkForConditionalGeneration

    meta = json.loads((args.corpus / "tokens.json").read_text())
    tokenizer_sha = hashlib.sha256(TOKENIZER.read_bytes()).hexdigest()
    if meta["tokenizer_sha256"] != tokenizer_sha:
        sys.exit(f"{args.corpus}/tokens.json was made with tokenizer {meta['tokenizer_sha256'][:12]} but {TOKENIZER} "
                 f"is {tokenizer_sha[:12]}; rerun training/train_tokenizer.py")
    train_stream = read_tokens(args.corpus / "train.i16")
    heldout_stream = read_tokens(args.corpus / "heldout.i16")
    assert len(train_stream) == meta["train"]["tokens"] and len(heldout_stream) == meta["heldout"]["tokens"]
    train_on_device = train_stream.to(device)

    patch_for_autocast()
    config = muse_tiny_config()
    model = MuseSparkForConditionalGeneration(config).to(device)  # transformers' init, fp32
    if args.embedding_std:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, args.embedding_std)
    model.set_experts_implementation(args.experts_implementation)
    model.train()
    trainable, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINED_PREFIXES))
        if not p.requires_grad:
            continue
        trainable.append(p)
        # matrices (and the [E, out, in] expert stacks) decay; the embedding (followed by a weightless
        # RMSNorm, so its scale is free), norms and residual gates do not.
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    text = config.text_config
    tap = RouterTap(model, text.num_local_experts, text.num_experts_per_tok)
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in trainable)
    note({"event": "start", "params": n_params, "trained_params": n_trained, "device": str(device),
          "torch": torch.__version__, "transformers": transformers.__version__,
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
          "train_tokens": len(train_stream), "heldout_tokens": len(heldout_stream),
          "args": {k: str(v) for k, v in vars(args).items()}})

    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        chunk = train_on_device[(starts[:, None] + offsets).to(device)]
        return chunk[:, :-1], chunk[:, 1:]

    x0, y0 = batch()
    check_start = check_experts_implementations(model, x0[:8], y0[:8], device, use_bf16, trainable)
    note({"event": "check_experts_vs_eager", "when": "init", **check_start})
    if check_start.get("loss_fp32_abs_diff", 0) > 1e-3 or check_start.get("grad_nmse_fp32", 0) > 1e-6:
        sys.exit("the experts implementation does not match transformers' eager loop in fp32; not training")
    if f"error_{'bf16_autocast' if use_bf16 else 'fp32'}" in check_start:  # the training path itself failed
        note({"event": "fallback", "experts_implementation": "eager", "why": "the grouped_mm training path failed"})
        args.experts_implementation = "eager"
        model.set_experts_implementation("eager")
    tap.counts.zero_()

    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    total = args.steps or args.max_steps
    calib_start, calib_end = 10, 40
    sums = torch.zeros(3, device=device)
    window_counts = torch.zeros_like(tap.counts)
    interval_counts = torch.zeros_like(tap.counts)
    started = time.perf_counter()
    t_calib = started
    per_step = None
    step = 0
    last_ce = float("nan")
    tap.want_loss = args.seq_balance_coef > 0
    while step < total:
        lr = learning_rate(step, total, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch()
        tap.counts.zero_()
        with autocast(device, use_bf16):
            ce = next_token_loss(model, x, y)
        seq_balance = tap.take_loss() if tap.want_loss else torch.zeros((), device=device)
        loss = ce + args.seq_balance_coef * seq_balance
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tap.update_biases(tap.counts, args.bias_update_rate)
        interval_counts += tap.counts
        if step >= total - args.load_window:
            window_counts += tap.counts
        sums += torch.stack([ce.detach(), seq_balance.detach(), grad_norm.detach()])
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
            n = (step - 1) % args.log_every + 1
            ce_mean, bal_mean, gn_mean = (sums / n).tolist()
            last_ce = ce_mean
            frac = interval_counts / interval_counts.sum(-1, keepdim=True)
            note({"event": "train", "step": step, "lr": lr, "ce": round(ce_mean, 4), "seq_balance": round(bal_mean, 4),
                  "grad_norm": round(gn_mean, 3), "load_max_over_mean": round(float(frac.max()) * frac.shape[-1], 3),
                  "load_min_over_mean": round(float(frac.min()) * frac.shape[-1], 3),
                  "elapsed": round(time.perf_counter() - started, 1)})
            sums.zero_()
            interval_counts.zero_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - started
    steps_done = step
    tap.want_loss = False
    train_load = load_summary(window_counts)
    final_biases = tap.biases()
    note({"event": "trained", "steps": steps_done, "train_seconds": round(train_seconds, 1),
          "final_interval_ce": last_ce, "expert_load_last_steps": train_load["max_over_mean_per_layer"]})

    # -- checks, then export ---------------------------------------------------------------------
    model.eval()
    check_end = check_experts_implementations(model, x0[:8], y0[:8], device, use_bf16, trainable)
    note({"event": "check_experts_vs_eager", "when": "end", **check_end})
    limit = args.eval_limit or len(heldout_stream)
    fp32_eval = perplexity(model, heldout_stream[:limit], args.seq_len, args.eval_batch, autocast_bf16=use_bf16)
    note({"event": "heldout_fp32_weights", "bf16_autocast": use_bf16, **fp32_eval})

    folder = args.out / "muse-tiny"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # fp32
        del model, optimizer, train_on_device
        shipped = MuseSparkForConditionalGeneration.from_pretrained(tmp, dtype=torch.bfloat16)
    shipped.generation_config.bos_token_id = BOS_ID
    shipped.generation_config.eos_token_id = list(STOP_IDS)
    shipped.generation_config.pad_token_id = PAD_ID
    shipped.generation_config.do_sample = False
    shipped.save_pretrained(folder, max_shard_size=args.shard_size)
    del shipped
    files = sorted(p.name for p in folder.iterdir())
    note({"event": "saved", "folder": str(folder), "files": files,
          "bytes": {f: (folder / f).stat().st_size for f in files}})

    # -- evaluation of the saved BF16 checkpoint, as from_pretrained gives it --------------------
    shipped = MuseSparkForConditionalGeneration.from_pretrained(folder).to(device).eval()
    shipped.set_experts_implementation(args.experts_implementation)
    dtypes = sorted({str(p.dtype) for p in shipped.state_dict().values()})
    fp32_tensors = sorted(n for n, t in shipped.state_dict().items() if t.dtype == torch.float32)
    note({"event": "reloaded", "dtypes": dtypes, "fp32_tensors": len(fp32_tensors),
          "experts_implementation": shipped.config._experts_implementation})
    tap = RouterTap(shipped, text.num_local_experts, text.num_experts_per_tok)
    heldout = perplexity(shipped, heldout_stream[:limit], args.seq_len, args.eval_batch)
    heldout_load = load_summary(tap.counts.clone())
    note({"event": "heldout_bf16_checkpoint", **heldout, "load_max_over_mean": heldout_load["max_over_mean_per_layer"]})
    slice_ids = slice_stream() if SLICE.is_file() else None
    slice_eval = perplexity(shipped, slice_ids, args.seq_len, args.eval_batch) if slice_ids else None
    note({"event": "slice_bf16_checkpoint", **(slice_eval or {})})
    slice_eager = None
    if slice_ids and shipped.config._experts_implementation != "eager":
        shipped.set_experts_implementation("eager")
        slice_eager = perplexity(shipped, slice_ids, args.seq_len, args.eval_batch)
        shipped.set_experts_implementation(args.experts_implementation)
        note({"event": "slice_bf16_checkpoint_eager_experts", **slice_eager})
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    samples = [greedy(shipped, tokenizer, prompt, args.sample_tokens) for prompt in PROMPTS]
    for s in samples:
        print(f"--- {s['prompt']!r} (generate == no-cache loop: {s['generate_matches_no_cache_loop']})\n"
              f"{s['prompt']}{s['completion']}\n", flush=True)
        note({"event": "sample", **s})

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {
        "model": "muse-tiny", "architecture": "MuseSparkForConditionalGeneration (transformers 5.24.0)",
        "parameters": n_params, "trained_parameters": n_trained,
        "untrained": "vision tower, vision adapter/projection and audio tower: transformers' random init "
                     "(text-only corpus); only model.language_model.* and lm_head.* were trained",
        "heldout": {**heldout, "split": "stdlib held-out files (training/corpus_manifest.tsv)",
                    "weights": "saved BF16 checkpoint via from_pretrained, transformers forward "
                               f"({args.experts_implementation} experts, sdpa attention), {gpu}",
                    "windows": f"non-overlapping {args.seq_len}-token windows; every token but the first predicted"},
        "heldout_fp32_weights_bf16_autocast": fp32_eval,
        "heldout_slice": {**(slice_eval or {}), "file": "musecore/data/eval/stdlib_heldout_slice.jsonl",
                          "weights": f"saved BF16 checkpoint, transformers forward, {gpu}"},
        "heldout_slice_eager_experts": slice_eager,
        "greedy_completions": samples,
        "expert_load": {"train_last_steps": {"steps": min(args.load_window, steps_done), **train_load},
                        "heldout_bf16_checkpoint": heldout_load,
                        "e_score_correction_bias": final_biases,
                        "note": "fraction of a layer's routed slots (tokens x top-4) per expert; 1/12 = 0.0833 is even"},
        "training": {"steps": steps_done, "planned_steps": total, "seconds": round(train_seconds, 1),
                     "time_budget": args.time_budget, "calibrated_seconds_per_step": per_step,
                     "final_train_ce": last_ce, "tokens_seen": steps_done * args.batch_size * args.seq_len,
                     "epochs": round(steps_done * args.batch_size * args.seq_len / len(train_stream), 2),
                     "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                     "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
                     "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
                     "betas": [0.9, 0.95], "eps": 1e-8,
                     "bias_update_rate": args.bias_update_rate, "seq_balance_coef": args.seq_balance_coef,
                     "init": "transformers MuseSparkPreTrainedModel._init_weights"
                             + (f"; embedding normal(0, {args.embedding_std})" if args.embedding_std else ""),
                     "bf16_autocast": use_bf16,
                     "experts_implementation": args.experts_implementation, "seed": args.seed, "device": gpu,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "experts_check": {"init": check_start, "end": check_end},
        "checkpoint": {"files": files, "dtypes": dtypes, "fp32_tensors": fp32_tensors},
        "corpus": {k: meta[k] for k in ("train", "heldout", "tokenizer_sha256")},
    }
    (args.out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    log.close()


if __name__ == "__main__":
    main()
