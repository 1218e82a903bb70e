"""musecore's muse-small decode beside llama.cpp at equal weight bytes per token, on this CPU (issue 30, item 4).

A benchmark, not a test. llama.cpp cannot run Muse Spark (its MoE with a pooler, per-expert norms and gated
residuals is not a llama.cpp architecture), so the peer is the nearest thing it runs at full speed: a dense
llama-architecture model with random Q4_0 weights (written here with the ``gguf`` package) whose weight bytes
per decode token equal muse-small's under musecore's default xeon plan (INT4 g128 routed experts of layers
1..L-2, attention, pooler/unpooler and lm_head; BF16 first/last-layer experts, fp32 router). Both engines
stream the same number of weight bytes per token, so tokens/s compares what each pays per token beyond
the bytes (kernels' streaming rate, per-op and Python costs). Same hidden size, layers, heads, KV heads
and vocabulary as muse-small; only the llama FFN width is chosen to match the bytes.

Both run greedy decode of ``--new-tokens`` tokens after a ``--prompt-tokens`` prompt, in alternating
rounds in one process (llama.cpp, musecore INT4 plan, musecore BF16), at each thread count; the median
of the rounds is reported with every round kept. musecore's tokens/s is ``generate()``'s
``decode_tokens_per_s`` (sampling included); llama.cpp's is the same loop over ``Llama.eval`` of one
token and an argmax of its logits.

Install the peer (not a musecore dependency; several minutes on 2 cores)::

    pip install gguf
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36

Run (writes benchmarks/results/xeon_avx512bf16/llama_cpp_peer.json; a few minutes of loading first)::

    python3 benchmarks/llama_cpp_peer.py [--threads 1 2] [--rounds 5] [--new-tokens 64] [--no-bf16]
        [--wait-until 14:45] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

OUT = Path(__file__).parent / "results" / "xeon_avx512bf16" / "llama_cpp_peer.json"
INSTALL = ('llama-cpp-python is not installed: pip install gguf; CMAKE_ARGS="-DGGML_NATIVE=ON" pip install '
           '--no-binary llama-cpp-python llama-cpp-python==0.3.36')
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # 32 weights: an fp16 scale and 16 bytes of 4-bit codes
FFN_MULTIPLE = 256  # llama.cpp's quantized matmuls want rows of whole super-blocks; 256 keeps every kernel path


# -- the bytes one decode token reads --------------------------------------------------------------

def musecore_bytes(config: Any) -> dict[str, float]:
    """Weight bytes per decode token of musecore's xeon plans (:func:`musecore_xeon.bench.decode_bytes_per_token`):
    ``int4_dense_bytes`` is the default plan's, ``bf16_bytes`` every weight BF16."""
    from musecore_xeon.bench import decode_bytes_per_token
    return decode_bytes_per_token(config)


def llama_tensors(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                  vocab: int) -> dict[str, tuple[int, int]]:
    """The 2-D weights of a llama model, ``name: (rows, cols)`` in llama.cpp's names (norms aside)."""
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_q.weight": (heads * head_dim, hidden), p + "attn_k.weight": (kv_heads * head_dim, hidden),
                       p + "attn_v.weight": (kv_heads * head_dim, hidden), p + "attn_output.weight": (hidden, heads * head_dim),
                       p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                       p + "ffn_down.weight": (hidden, ffn)})
    return shapes


def q4_0_bytes(rows: int, cols: int) -> int:
    return rows * cols // Q4_0_BLOCK * Q4_0_BYTES


def llama_bytes_per_token(shapes: dict[str, tuple[int, int]]) -> int:
    """Bytes one decode token reads: every Q4_0 weight but the embedding (one row), plus the fp32 norms."""
    total = sum(q4_0_bytes(*s) for name, s in shapes.items() if name != "token_embd.weight")
    hidden = shapes["output.weight"][1]
    layers = sum(name.endswith("attn_q.weight") for name in shapes)
    return total + q4_0_bytes(1, hidden) + 4 * hidden * (2 * layers + 1)


def llama_shape_for(target_bytes: float, config: Any) -> dict[str, int]:
    """muse-small's hidden size, layers, heads and vocabulary, with the FFN width (a multiple of
    :data:`FFN_MULTIPLE`) whose bytes per token come closest to ``target_bytes``."""
    base = dict(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab=config.vocab_size)
    best = None
    for ffn in range(FFN_MULTIPLE, 64 * config.hidden_size, FFN_MULTIPLE):
        nbytes = llama_bytes_per_token(llama_tensors(ffn=ffn, **base))
        if best is None or abs(nbytes - target_bytes) < abs(best[1] - target_bytes):
            best = (ffn, nbytes)
        if nbytes > target_bytes:
            break
    return dict(base, ffn=best[0])


def write_gguf(path: Path, shape: dict[str, int], seed: int = 0) -> None:
    """A llama GGUF with random Q4_0 weights (codes uniform in 0..15, one fp16 scale 0.003 per block: weights
    within +-0.024), fp32 norms of ones, and a 65536-token SentencePiece-style vocabulary of placeholder
    pieces (the 256 byte tokens llama.cpp expects included; nothing is ever tokenized: ids go in directly)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, heads = shape["hidden"], shape["heads"]
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    vocab = shape["vocab"]
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    tokens += [f"t{i}".encode() for i in range(vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    scale = np.frombuffer(np.float16(0.003).tobytes(), dtype=np.uint8)
    for name, (rows, cols) in llama_tensors(ffn=shape["ffn"], **{k: v for k, v in shape.items() if k != "ffn"}).items():
        blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
        blocks[:, :, :2] = scale
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    for i in range(shape["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- the two decode loops ---------------------------------------------------------------------------

def llama_decode(llm: Any, prompt: list[int], new_tokens: int) -> float:
    """Greedy decode tokens/s of ``new_tokens`` steps after ``prompt`` (the prefill is not timed)."""
    llm.reset()
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return new_tokens / (time.perf_counter() - start)


def musecore_decode(model: Any, prompt: list[int], new_tokens: int) -> float:
    """``generate()``'s decode tokens/s (greedy; the first token comes from the prefill and is not counted)."""
    model.generate(prompt, max_new_tokens=new_tokens + 1)
    return model.last_generation_stats.decode_tokens_per_s


def set_llama_threads(llm: Any, threads: int) -> None:
    import llama_cpp
    llama_cpp.llama_set_n_threads(llm.ctx, threads, threads)


def profile_models(models: dict[str, Any], threads: list[int], path: Path) -> dict[str, Any]:
    """:mod:`xeon_decode_profile` of each loaded musecore model at each thread count: its markdown tables to ``path``;
    returns the profiles (they go into the JSON)."""
    import xeon_decode_profile

    profiles, text = {}, []
    for plan, model in models.items():
        for t in threads:
            r = xeon_decode_profile.profile_plan(model, t, 64)
            profiles[f"{plan}/{t}"] = r
            text.append(xeon_decode_profile.markdown(plan, r))
    path.parent.mkdir(parents=True, exist_ok=True)
    profiles["moe_vs_gemv"] = xeon_decode_profile.moe_vs_gemv(threads)
    text.append(xeon_decode_profile.moe_markdown(profiles["moe_vs_gemv"]))
    path.write_text("\n".join(text))
    return profiles


# -- the run ------------------------------------------------------------------------------------------

def host() -> dict[str, Any]:
    from musecore.benchmarking import cpu_name
    from musecore_xeon.cpu import read_cpu_info
    info = read_cpu_info()
    return {"cpu": cpu_name(), "isa_tier": info.isa_tier, "logical_cores": info.logical_cores,
            "flags": sorted(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx512_vnni", "avx2") if info.has(f)),
            "torch": torch.__version__, "torch_cpu_capability": info.torch_capability, "python": platform.python_version()}


def wait_until(hhmm: Optional[str]) -> None:
    """Sleep until ``HH:MM`` UTC today (the host's quiet window), if it is still ahead."""
    if not hhmm:
        return
    now = datetime.datetime.now(datetime.timezone.utc)
    hour, minute = map(int, hhmm.split(":"))
    target = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if target > now:
        print(f"waiting until {hhmm} UTC ({(target - now).seconds} s)", flush=True)
        time.sleep((target - now).total_seconds())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--no-bf16", action="store_true", help="skip musecore's all-BF16 model (saves its load, ~4 GB)")
    p.add_argument("--gguf", type=Path, default=None, help="where to write (or reuse) the peer GGUF (default: a temp dir)")
    p.add_argument("--wait-until", default=None, help="HH:MM UTC: load first, then wait for this time to time")
    p.add_argument("--layers", type=int, default=0,
                   help="cut muse-small (and the peer with it) to this many layers: development runs only")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--profile", type=Path, default=None,
                   help="after the rounds, profile musecore's decode step on the loaded models "
                        "(benchmarks/xeon_decode_profile.py): tables to this markdown file, numbers into the JSON")
    args = p.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit(INSTALL)
    from musecore.api import load_random
    from musecore_xeon.bench import all_experts_bf16, plan_keeps_bf16_experts
    from musecore_xeon.kernels.crossover import calibrations

    sys.path.insert(0, str(Path(__file__).parent))
    from xeon_decode_profile import muse_small
    config = muse_small(args.layers)
    plan_bytes = musecore_bytes(config)
    shape = llama_shape_for(plan_bytes["int4_dense_bytes"], config)
    peer_bytes = llama_bytes_per_token(llama_tensors(**shape))
    path = args.gguf or Path(tempfile.gettempdir()) / f"llama_peer_{shape['layers']}x{shape['hidden']}_ffn{shape['ffn']}_q4_0.gguf"
    if not path.exists():
        start = time.perf_counter()
        write_gguf(path, shape)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"bytes per token: musecore INT4 plan {plan_bytes['int4_dense_bytes'] / 1e6:.1f} MB, llama Q4_0 "
          f"{peer_bytes / 1e6:.1f} MB (ffn {shape['ffn']}), musecore BF16 {plan_bytes['bf16_bytes'] / 1e6:.1f} MB",
          flush=True)

    loads: dict[str, float] = {}
    start = time.perf_counter()
    context = args.prompt_tokens + args.new_tokens + 8
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=context,  # scores keeps n_batch rows
                          n_threads=max(args.threads), n_threads_batch=max(args.threads), verbose=False)
    loads["llama.cpp"] = time.perf_counter() - start
    # The default xeon plan from an INT4 g128 checkpoint: the resident formats and bytes of a BF16 checkpoint
    # quantized at load (the same plan), without the minutes of least-error requantization of random weights.
    engines: dict[str, tuple[Callable[..., float], Any, float]] = {"llama.cpp Q4_0": (llama_decode, llm, peer_bytes)}
    start = time.perf_counter()
    engines["musecore int4 (xeon plan)"] = (musecore_decode, load_random(config, "xeon", checkpoint_format="int4"),
                                            plan_bytes["int4_dense_bytes"])
    loads["musecore int4"] = time.perf_counter() - start
    if not args.no_bf16:
        start = time.perf_counter()
        with plan_keeps_bf16_experts():  # the config subclass alone left layers 1..L-2 in INT4 (runs before 14:56)
            bf16_model = load_random(all_experts_bf16(config), "xeon", quantize_dense=False)
        engines["musecore bf16"] = (musecore_decode, bf16_model, plan_bytes["bf16_bytes"])
        loads["musecore bf16"] = time.perf_counter() - start
    prompt = torch.randint(3, config.vocab_size, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    for threads in args.threads:  # warm-up: kernels built, crossovers measured, caches sized
        torch.set_num_threads(threads)
        set_llama_threads(llm, threads)
        for run, obj, _ in engines.values():
            run(obj, prompt, 4)
    wait_until(args.wait_until)

    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        set_llama_threads(llm, threads)
        rounds: dict[str, list[float]] = {name: [] for name in engines}
        loadavg = []
        for r in range(args.rounds):
            for name, (run, obj, _) in engines.items():
                rounds[name].append(run(obj, prompt, args.new_tokens))
            loadavg.append(os.getloadavg()[0])
            print(f"threads {threads} round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rounds.items()), flush=True)
        peer = statistics.median(rounds["llama.cpp Q4_0"])
        results[str(threads)] = {
            name: {"tokens_per_s_median": statistics.median(v), "tokens_per_s_rounds": v,
                   "bytes_per_token": engines[name][2], "gb_per_s_streamed": statistics.median(v) * engines[name][2] / 1e9,
                   "vs_llama_cpp": statistics.median(v) / peer} for name, v in rounds.items()}
        results[str(threads)]["load_average_1min_after_each_round"] = loadavg
    doc = {"benchmark": "benchmarks/llama_cpp_peer.py", "command": " ".join(["python3"] + sys.argv),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": host(), "llama_cpp_python": llama_cpp.__version__, "llama_system_info":
           llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
           "musecore_model": f"muse-small ({config.num_hidden_layers} layers), random weights (seed 0), xeon default plan "
                             "from an INT4 g128 checkpoint; BF16: every expert BF16, quantize_dense=False",
           "peer_model": dict(shape, architecture="llama", format="Q4_0 (random codes, scale 0.003)", path=str(path)),
           "bytes_per_token": {"musecore_int4_plan": plan_bytes["int4_dense_bytes"], "llama_q4_0": peer_bytes,
                               "musecore_bf16": plan_bytes["bf16_bytes"]},
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
           "load_seconds": loads, "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "crossovers_measured_at_load": [{"kind": c.kind, "in_features": c.in_features, "proxy_out": c.proxy_out_features,
                                            "threads": c.threads, "crossover": c.crossover, "source": c.source}
                                           for c in calibrations()],
           "results_by_threads": results}
    if args.profile is not None:
        doc["profile"] = profile_models({name.split()[1]: obj for name, (_, obj, _) in engines.items()
                                         if name.startswith("musecore")}, args.threads, args.profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{'threads':>7} {'engine':28} {'tok/s':>7} {'GB/s':>6} {'vs llama.cpp':>12}")
    for threads, by_engine in results.items():
        for name, row in by_engine.items():
            if isinstance(row, dict):
                print(f"{threads:>7} {name:28} {row['tokens_per_s_median']:7.1f} {row['gb_per_s_streamed']:6.1f} "
                      f"{row['vs_llama_cpp']:12.2f}")
    print(f"wrote {args.out}")
    llm.close()  # while the interpreter is whole (llama-cpp-python's destructor fails at shutdown)


if __name__ == "__main__":
    main()
