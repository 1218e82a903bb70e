"""Check the packaged muse-tiny folder on the CPU with transformers, and record the results in its eval.json.

- ``MuseSparkForConditionalGeneration.from_pretrained`` loads it with no missing, unexpected or
  mismatched keys; the tensors' dtypes are BF16 except ``_keep_in_fp32_modules_strict`` (fp32);
  ``generation_config`` stops on ``<|eot|>`` and ``<|eom|>``;
- ``AutoTokenizer.from_pretrained`` loads it, encodes like ``tokenizer.json`` and decodes back,
  and ``apply_chat_template`` renders and tokenizes a conversation;
- perplexity of the CI slice (``musecore/data/eval/stdlib_heldout_slice.jsonl``) with transformers' forward,
  with the BF16 weights computed in fp32 (``dtype=torch.float32``) and in BF16 (as saved), the
  latter with both the default (grouped_mm) and the eager experts loop;
- greedy completions on the CPU (BF16), compared with the GPU run's.

The run's ``eval.json`` (from the device) is read from ``--run-eval`` and written to the folder with
a ``cpu_check`` section added.

Usage::

    python training/check_muse_tiny.py musecore/data/muse-tiny --run-eval /path/to/run/eval.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from muse_tiny import BOS_ID, PAD_ID, PROMPTS, STOP_IDS, TOKENIZER, perplexity, slice_stream  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--run-eval", type=Path, default=None, help="the training run's eval.json")
    parser.add_argument("--sample-tokens", type=int, default=96)
    args = parser.parse_args()

    import tokenizers
    import transformers
    from transformers import AutoTokenizer, MuseSparkForConditionalGeneration

    torch.manual_seed(0)
    report: dict = {"device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
                    "torch": torch.__version__, "transformers": transformers.__version__}

    # -- loading ------------------------------------------------------------------------------
    model, info = MuseSparkForConditionalGeneration.from_pretrained(args.folder, output_loading_info=True)
    problems = {k: sorted(v) if not isinstance(v, list) else v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"from_pretrained reported {problems}")
    state = model.state_dict()
    keep = model._keep_in_fp32_modules_strict
    bad = [n for n, t in state.items() if t.dtype != (torch.float32 if any(k in n for k in keep) else torch.bfloat16)]
    if bad:
        raise SystemExit(f"unexpected dtypes: {bad[:5]}")
    gen_cfg = model.generation_config
    assert sorted(gen_cfg.eos_token_id) == sorted(STOP_IDS) and gen_cfg.bos_token_id == BOS_ID, gen_cfg
    file = args.folder / "model.safetensors"
    report["load"] = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "tensors": len(state),
                      "fp32_tensors": sum(t.dtype == torch.float32 for t in state.values()),
                      "bf16_tensors": sum(t.dtype == torch.bfloat16 for t in state.values()),
                      "parameters": sum(t.numel() for t in state.values()),
                      "model_safetensors_bytes": file.stat().st_size,
                      "model_safetensors_sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                      "generation_eos_token_id": gen_cfg.eos_token_id}
    print(json.dumps(report["load"]), flush=True)

    # -- tokenizer ----------------------------------------------------------------------------
    tok = AutoTokenizer.from_pretrained(args.folder)
    raw = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    text = 'class Stack:\n    def __init__(self):\n\tself.items = []  # "tabs"\n'
    ids = tok(text)["input_ids"]
    assert ids == raw.encode(text, add_special_tokens=False).ids and tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, 3, PAD_ID)
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "Write fibonacci."}]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = ("<|start|>system<|message|>You write Python.<|eot|><|start|>user<|message|>Write fibonacci.<|eot|>"
                "<|start|>assistant<|message|>")
    assert rendered == expected, rendered
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat_ids[0] == BOS_ID and chat_ids.count(BOS_ID) == 3 and chat_ids[-1] == 1, chat_ids
    report["tokenizer"] = {"class": type(tok).__name__, "bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
                           "chat_template_example": rendered, "chat_template_ids": chat_ids}
    print(json.dumps(report["tokenizer"]), flush=True)

    # -- CI slice perplexity on the CPU ---------------------------------------------------------
    stream = slice_stream()
    slice_results = {}
    model.eval()
    slice_results["bf16_weights_bf16_compute_grouped_mm"] = perplexity(model, stream)
    model.set_experts_implementation("eager")
    slice_results["bf16_weights_bf16_compute_eager"] = perplexity(model, stream)
    model.set_experts_implementation("grouped_mm")
    fp32 = MuseSparkForConditionalGeneration.from_pretrained(args.folder, dtype=torch.float32).eval()
    slice_results["bf16_weights_fp32_compute_grouped_mm"] = perplexity(fp32, stream)
    del fp32
    for k, v in slice_results.items():
        print(k, json.dumps(v), flush=True)
    report["ci_slice"] = {"file": "musecore/data/eval/stdlib_heldout_slice.jsonl", **slice_results}

    # -- greedy completions on the CPU (bf16) -----------------------------------------------------
    gpu_samples = {}
    run = json.loads(args.run_eval.read_text()) if args.run_eval else None
    if run:
        gpu_samples = {s["prompt"]: s["completion"] for s in run.get("greedy_completions", [])}
    samples = []
    for prompt in PROMPTS:
        x = torch.tensor([[BOS_ID] + tok(prompt)["input_ids"]])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=args.sample_tokens,
                                 do_sample=False)  # eos/pad from generation_config.json
        completion = tok.decode(out[0, x.shape[1]:].tolist())
        samples.append({"prompt": prompt, "completion": completion,
                        "same_as_gpu": completion == gpu_samples.get(prompt) if gpu_samples else None})
        print(f"--- {prompt!r} (same as GPU: {samples[-1]['same_as_gpu']})\n{prompt}{completion}\n", flush=True)
    report["greedy_completions_cpu_bf16"] = samples

    if run is not None:
        run["cpu_check"] = report
        (args.folder / "eval.json").write_text(json.dumps(run, indent=2, ensure_ascii=False) + "\n")
        print(f"-> {args.folder / 'eval.json'}")
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
