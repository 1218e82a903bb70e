"""musecore TP/EP beside transformers' own TP/EP (``DistributedConfig``) on muse-tiny, CPU + gloo (issue 23).

A torchrun script, not a test. Every rank loads the bundled muse-tiny checkpoint twice in one process:
with transformers (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, ep_size=2))``)
and with musecore (``musecore.load(..., tp=2, ep=2)``), plus transformers with
``ep_implementation="all_to_all"`` (its default at inference with tp == ep is an all-reduce over every
rank's experts; musecore exchanges the routed tokens). All run the same fixed batch forward and greedy
decodes; rank 0 also runs one-process transformers (sdpa, the reference, and eager attention) and
one-process musecore. Decode rounds alternate between the engines so that machine noise falls on all.
If transformers' TP+EP does not run here, the error and the transformers frame that raised it are
recorded, and the nearest configuration that does run (TP alone, then EP alone) is tried and labelled.

    OMP_NUM_THREADS=1 timeout 900 python3 -m torch.distributed.run --nproc-per-node 2 \
        --master-port 29731 benchmarks/transformers_peer_distributed.py

Writes benchmarks/results/distributed/transformers_peer_cpu.json (rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import musecore
import musecore.api
from musecore.benchmarking import cpu_name

OUT = Path(__file__).parent / "results" / "distributed" / "transformers_peer_cpu.json"
IDS = torch.tensor([[1, 414, 286, 300, 17, 9, 1000, 5], [3, 2, 1, 77, 88, 99, 11, 12]])  # tests/distributed/worker.py
# Greedy prompts: the distributed tests' (its first step is a near tie: musecore's fp32 logits for tokens
# 279 and 1256 are equal, so agreement there depends on tie-breaking) and a longer one from the same row
# whose 32 greedy steps all have a top-1/top-2 gap of at least 0.18 in musecore's one-process logits.
PROMPTS = {"tests_prompt": IDS[0, :4].tolist(), "six_token_prompt": IDS[0, :6].tolist()}




def full(t: Any) -> torch.Tensor:
    """A plain tensor from a DTensor (transformers may hand back sharded or replicated DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def failure(e: BaseException) -> dict:
    """The error and the innermost transformers frame on its traceback (the line that raised or called down)."""
    frames = traceback.extract_tb(e.__traceback__)
    in_transformers = [f for f in frames if "/transformers/" in f.filename]
    where = in_transformers[-1] if in_transformers else (frames[-1] if frames else None)
    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "transformers_frame": (f"{where.filename.split('site-packages/')[-1]}:{where.lineno} in {where.name}: "
                                   f"{where.line}" if where else None),
            "innermost_frame": (f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno} in "
                                f"{frames[-1].name}" if frames else None),
            "traceback_tail": "".join(traceback.format_exception(e))[-3000:]}


def local_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds (a DTensor counts its local shard only)."""
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def local_shapes_vs_checkpoint(model: torch.nn.Module, folder: Path) -> dict[str, str]:
    """Layer 0's text parameters, embed_tokens and lm_head: this rank's shape beside the checkpoint's (a
    smaller one is sharded here)."""
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    shown = {}
    for name, t in model.named_parameters():
        if "language_model.layers.0." in name or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            local = tuple((t.to_local() if hasattr(t, "to_local") else t).shape)
            want = stored.get(name)
            shown[name] = f"{list(local)} of {list(want) if want else '?'}" + (" (sharded)" if want and local != want
                                                                            else "")
    return shown


def everyone_ok(error: Optional[dict]) -> list[Optional[dict]]:
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, error)
    return got


def top1(logits: torch.Tensor) -> tuple[int, float]:
    """The greedy token (argmax of one position's logits: the lowest id on a tie, as musecore's generate and
    transformers' greedy search pick) and its lead over the runner-up."""
    values = logits.float().topk(2).values
    return int(logits.argmax()), float(values[0] - values[1])


# -- the two engines behind one small interface: logits for a batch, a greedy decode with step times --

class TransformersEngine:
    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return full(self.model(input_ids=ids, use_cache=False).logits).float()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float], float]:
        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        token, gap = top1(full(out.logits)[0, -1])
        tokens, times, gaps = [token], [], [gap]
        for _ in range(n - 1):
            t0 = time.perf_counter()
            out = self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            token, gap = top1(full(out.logits)[0, -1])
            times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(token)
            gaps.append(gap)
        return tokens, times, min(gaps)


class MusecoreEngine:
    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.forward(ids).float()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float], float]:
        cache = self.model.new_cache(1, len(prompt) + n + 1)
        logits = self.model.forward(torch.tensor([prompt]), cache=cache)
        token, gap = top1(logits[0, -1])
        tokens, times, gaps = [token], [], [gap]
        for _ in range(n - 1):
            t0 = time.perf_counter()
            logits = self.model.forward(torch.tensor([[token]]), cache=cache)
            token, gap = top1(logits[0, -1])
            times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(token)
            gaps.append(gap)
        return tokens, times, min(gaps)


@torch.inference_mode()
def transformers_routing(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer, the router's choice scores [B*T, E] and chosen experts [B*T, k] for ``ids``."""
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTopkRouter
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(router: Any, inputs: Any, out: Any) -> None:
        logits, indices = full(out[0]), full(out[2])
        scores = torch.sigmoid(logits * router.output_multiplier) + full(router.e_score_correction_bias)
        seen.append((scores.float(), indices.sort(-1).values))

    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, MuseSparkTopkRouter)]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def routing_differences(a: list, b: list, seq_len: int) -> list[dict]:
    """Tokens whose chosen experts differ between two runs, with how close ``a``'s choice was to a tie."""
    out = []
    for layer, ((scores_a, chosen_a), (scores_b, chosen_b)) in enumerate(zip(a, b)):
        k = chosen_a.shape[-1]
        for token in (chosen_a != chosen_b).any(-1).nonzero().flatten().tolist():
            top = scores_a[token].topk(k + 1).values
            out.append({"layer": layer, "row": token // seq_len, "position": token % seq_len,
                        "experts_a": chosen_a[token].tolist(), "experts_b": chosen_b[token].tolist(),
                        "a_kth_minus_next_score": float(top[k - 1] - top[k])})
    return out


def load_transformers(folder: Path, distributed_config: Any = None, **extra: Any) -> Any:
    from transformers import AutoModelForImageTextToText
    kwargs = {"dtype": torch.bfloat16, **extra}
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    model = AutoModelForImageTextToText.from_pretrained(folder, **kwargs)
    return model.eval()


def transformers_attempts(tp: int, ep: int) -> list[tuple[str, Callable[[], Any]]]:
    """TP+EP as asked, then the nearest configurations, in order; the first that runs is compared."""
    from transformers.distributed import DistributedConfig
    return [(f"tp_size={tp}, ep_size={ep}", lambda: DistributedConfig(tp_size=tp, ep_size=ep)),
            (f"tp_size={tp} (tp_plan auto, no EP)", lambda: DistributedConfig(tp_size=tp, tp_plan="auto")),
            (f"ep_size={ep}, tp_plan={{}} (EP alone)", lambda: DistributedConfig(tp_size=tp, ep_size=ep, tp_plan={}))]


def try_transformers(folder: Path, label: str, make: Callable[[], Any]) -> tuple[Optional[TransformersEngine],
                                                                                  Optional[torch.Tensor], dict]:
    """Load and run the fixed batch on every rank; (engine, logits, record), engine None when any rank failed."""
    engine, logits, error = None, None, None
    try:
        engine = TransformersEngine(load_transformers(folder, make()))
        logits = engine.logits(IDS)
    except Exception as e:  # recorded in the JSON and the report; the caller tries the next configuration
        error = failure(e)
    bad = {r: e for r, e in enumerate(everyone_ok(error)) if e is not None}
    record: dict[str, Any] = {"config": label, "ran": not bad, "failures_by_rank": bad or None}
    if dist.get_rank() == 0:
        print(f"[transformers] {label}: {'ran' if not bad else 'FAILED ' + list(bad.values())[0]['error']}",
              flush=True)
    if bad:
        return None, None, record
    model = engine.model
    record["distributed_config"] = model.config.distributed_config.to_dict()
    record["attn_implementation"] = model.config._attn_implementation
    record["tp_plan_applied"] = {k: str(v) for k, v in (getattr(model, "_tp_plan", None) or {}).items()}
    record["ep_plan_applied"] = {k: str(v) for k, v in (getattr(model, "_ep_plan", None) or {}).items()}
    record["rank_weight_bytes"] = everyone(local_weight_bytes(model))
    record["rank_weight_bytes_note"] = "all of the checkpoint's modules, vision and audio towers included"
    record["rank0_local_shapes_vs_checkpoint"] = local_shapes_vs_checkpoint(model, folder)
    return engine, logits, record


def everyone(value: Any) -> list:
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7, help="alternating decode rounds per engine")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    # One gloo group for both libraries (each joins an existing group rather than making its own).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    import transformers
    from transformers.distributed import DistributedConfig
    _, folder = musecore.api.resolve_model("muse-tiny")
    result: dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 timeout 900 python3 -m torch.distributed.run --nproc-per-node 2 "
                   f"--master-port <port> benchmarks/transformers_peer_distributed.py {' '.join(sys.argv[1:])}".strip(),
        "checkpoint": str(folder), "dtype": "bfloat16", "world": world, "batch_ids": IDS.tolist(), "prompts": PROMPTS,
        "new_tokens": args.new_tokens, "rounds": args.rounds,
        "hardware": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version(),
                     "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "noise": "2 logical CPUs shared with other engineers' jobs; 2 ranks x 1 thread; timings are noisy",
        "load_average_at_start": os.getloadavg(),
    }

    # One-process references on rank 0 (rank 1 waits at the barrier): transformers with its default
    # attention (sdpa) and with eager attention, and musecore without a mesh.
    engines: dict[str, Any] = {}
    logits: dict[str, torch.Tensor] = {}
    if rank == 0:
        engines["transformers_one_process"] = TransformersEngine(load_transformers(folder))
        engines["transformers_one_process_eager"] = TransformersEngine(load_transformers(folder,
                                                                                         attn_implementation="eager"))
        engines["musecore_one_process"] = MusecoreEngine(musecore.load("muse-tiny", device="cpu", progress=False,
                                                                       dtype=torch.bfloat16))
        for name, engine in engines.items():
            logits[name] = engine.logits(IDS)
        result["transformers_one_process_attn_implementation"] = (
            engines["transformers_one_process"].model.config._attn_implementation)
        result["transformers_one_process_weight_bytes"] = local_weight_bytes(engines["transformers_one_process"].model)
    one_process = set(engines)
    dist.barrier()

    # transformers' own TP/EP: the asked configuration first, then the nearest that runs.
    attempts = []
    for label, make in transformers_attempts(args.tp, args.ep):
        engine, hf_logits, record = try_transformers(folder, label, make)
        attempts.append(record)
        if engine is not None:
            engines["transformers_tp"], logits["transformers_tp"] = engine, hf_logits
            result["transformers_tp_config"] = label
            break
    result["transformers_attempts"] = attempts
    # ep_implementation "auto" runs AllReduceEP at inference when tp == ep (every rank runs its experts on
    # the whole batch, then an all-reduce); musecore exchanges only the routed tokens (all-to-all). Also
    # run transformers' all-to-all EP, the like-for-like dispatch.
    if args.ep > 1 and "transformers_tp" in engines:
        label = f"tp_size={args.tp}, ep_size={args.ep}, ep_implementation=all_to_all"
        engine, hf_logits, record = try_transformers(
            folder, label, lambda: DistributedConfig(tp_size=args.tp, ep_size=args.ep, ep_implementation="all_to_all"))
        result["transformers_all_to_all_attempt"] = record
        if engine is not None:
            engines["transformers_tp_all_to_all"], logits["transformers_tp_all_to_all"] = engine, hf_logits

    mc = musecore.load("muse-tiny", device="cpu", tp=args.tp, ep=args.ep, progress=False, dtype=torch.bfloat16)
    engines["musecore_tp"] = MusecoreEngine(mc)
    logits["musecore_tp"] = engines["musecore_tp"].logits(IDS)
    routing = {}
    for name in ("transformers_one_process", "transformers_one_process_eager", "transformers_tp"):
        if everyone(name in engines)[0]:  # rank 0 decides; the TP model's forward needs both ranks
            routing[name] = transformers_routing(engines[name].model, IDS) if name in engines else None
    result["musecore_mesh"] = {"tp": args.tp, "ep": args.ep, "rank_weight_bytes": everyone(mc.weight_bytes())}

    # Decode rounds, alternating engines; the distributed engines run on both ranks in lockstep, the
    # one-process ones on rank 0 only (rank 1 waits at the barrier).
    names = ("transformers_tp", "musecore_tp", "transformers_tp_all_to_all", "transformers_one_process",
             "transformers_one_process_eager", "musecore_one_process")
    order = everyone([n for n in names if n in engines])[0]  # rank 0's list on every rank
    one_process = set(everyone(sorted(one_process))[0])
    step_ms: dict[str, list[float]] = {name: [] for name in order}
    tokens: dict[str, dict[str, list[int]]] = {}
    gaps: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name in order:
            for prompt_name, prompt in PROMPTS.items():
                dist.barrier()
                if name in one_process and rank != 0:
                    continue
                got, times, gap = engines[name].greedy(prompt, args.new_tokens)
                tokens.setdefault(name, {})[prompt_name] = got
                gaps.setdefault(name, {})[prompt_name] = gap
                step_ms[name] += times
    dist.barrier()

    distributed_tokens = everyone({k: v for k, v in tokens.items() if k not in one_process})
    if rank == 0:
        ref = logits["transformers_one_process"]
        result["logits_abs_max_reference"] = float(ref.abs().max())
        pairs = [("transformers_tp", "musecore_tp"), ("transformers_tp", "transformers_one_process"),
                 ("musecore_tp", "transformers_one_process"), ("transformers_tp_all_to_all", "musecore_tp"),
                 ("transformers_tp_all_to_all", "transformers_one_process"),
                 ("transformers_tp", "transformers_one_process_eager"),
                 ("musecore_tp", "transformers_one_process_eager"), ("musecore_tp", "musecore_one_process"),
                 ("transformers_one_process", "transformers_one_process_eager"),
                 ("musecore_one_process", "transformers_one_process")]
        diffs, per_position = {}, {}
        for a, b in pairs:
            if a in logits and b in logits:
                d = (logits[a] - logits[b]).abs()
                diffs[f"{a}_vs_{b}"] = float(d.max())
                per_position[f"{a}_vs_{b}"] = [[round(float(v), 4) for v in row] for row in d.amax(-1)]
        result["logits_max_abs_diff"] = diffs
        result["routing_differences"] = {
            f"{a}_vs_{b}": routing_differences(routing[a], routing[b], IDS.shape[1])
            for a, b in [("transformers_one_process", "transformers_one_process_eager"),
                         ("transformers_one_process", "transformers_tp")] if a in routing and b in routing}
        result["routing_note"] = ("tokens of the fixed batch whose top-k experts differ between two transformers "
                                  "runs (router hooks); a_kth_minus_next_score is how far run a's last chosen expert "
                                  "led the first unchosen one: a near tie that rounding elsewhere flips")
        result["logits_max_abs_diff_per_position"] = per_position
        result["logits_note"] = ("fp32 views of each engine's logits [2, 8, 4096]; transformers returns BF16 logits "
                                 "(one BF16 ulp is 0.0625 at 8-16, 0.125 at 16-32), musecore fp32")
        reference = tokens["transformers_one_process"]
        greedy = {name: tokens[name] for name in one_process}
        greedy.update({f"{k}_rank{r}": v for r, got in enumerate(distributed_tokens) for k, v in got.items()})
        result["greedy_tokens"] = greedy
        result["greedy_agree_with_transformers_one_process"] = {
            k: {prompt_name: v[prompt_name] == reference[prompt_name] for prompt_name in PROMPTS}
            for k, v in greedy.items()}
        result["greedy_smallest_top1_lead"] = gaps
        result["greedy_note"] = ("greedy_smallest_top1_lead: rank 0's smallest top-1 minus top-2 logit over each "
                                 "decode (last round); a lead near 0 is a tie that rounding may break either way")
        result["decode_step_ms"] = {
            name: {"median": statistics.median(v), "min": min(v), "max": max(v), "steps": len(v)}
            for name, v in step_ms.items() if v}
        result["decode_step_ms_note"] = ("rank 0's wall time per greedy decode step (batch 1, one new token through "
                                         "the KV cache, argmax included, prefill excluded), all rounds pooled; "
                                         "one_process engines ran on rank 0 while rank 1 waited at a barrier")
        result["load_average_at_end"] = os.getloadavg()
        result["when_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: result.get(k) for k in ("logits_max_abs_diff", "greedy_agree_with_transformers_one_process",
                                                      "greedy_smallest_top1_lead", "decode_step_ms")}, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
