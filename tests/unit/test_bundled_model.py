"""The bundled muse-tiny checkpoint: it loads, fits the package limit, and has learned Python.

The model was trained on the Python standard library (training/README.md); the held-out slice in
``musecore/data/eval/`` comes from files it never saw. Perplexity is per token of the bundled BPE
tokenizer, over documents framed as in training (``<|start|>`` + file + ``<|eot|>``).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import musecore

FOLDER = Path(musecore.__file__).parent / "data" / "muse-tiny"
SLICE = Path(musecore.__file__).parent / "data" / "eval" / "stdlib_heldout_slice.jsonl"
MAX_BYTES = 25 * 1000 * 1000
# Measured on this slice with the shipped BF16 checkpoint on a CPU: see eval.json
# ("heldout_slice"). The threshold leaves 10% for other CPUs' BF16 rounding.
MEASURED_SLICE_PERPLEXITY = 17.84  # CPU, torch 2.13, bf16 and fp32; 17.88 on the H200 (eval.json)
PERPLEXITY_THRESHOLD = 19.6  # measured * 1.1


@pytest.fixture(scope="module")
def model():
    return musecore.load("muse-tiny", device="cpu")


def test_bundled_checkpoint_is_transformers_layout_bf16_under_25_mb():
    files = sorted(p for p in FOLDER.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_BYTES, f"musecore/data/muse-tiny holds {total / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB limit"
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "muse_spark" and config["architectures"] == ["MuseSparkForConditionalGeneration"]
    text = config["text_config"]
    assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (0, 3, 7)
    from safetensors import safe_open
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    fp32 = {n for n, d in dtypes.items() if d == "F32"}
    assert set(dtypes.values()) == {"BF16", "F32"}
    assert fp32 == {n for n in dtypes if n.endswith(("residual_gate.gate", "mlp.gate.weight", "e_score_correction_bias"))}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in dtypes
    assert any(n.startswith("model.vision_tower.") for n in dtypes) and any(n.startswith("model.audio_tower.") for n in dtypes)


def test_bundled_model_loads_by_preset_name_with_its_tokenizer(model):
    assert model.config.num_local_experts == 12 and model.config.vocab_size == 4096
    assert model.tokenizer is not None
    text = "def f(x):\n\tif x:\n        return  x  # two spaces\n\n"
    assert model.tokenizer.decode(model.tokenizer.encode(text, add_special_tokens=False)) == text


def test_heldout_slice_perplexity_is_below_threshold(model):
    tok = model.tokenizer
    bos, eos = model.config.bos_token_id, model.config.eos_token_id
    ids = []
    for line in SLICE.read_text(encoding="utf-8").splitlines():
        ids += [bos] + tok.encode(json.loads(line)["text"], add_special_tokens=False) + [eos]
    stream, seq_len = torch.tensor(ids), 512
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, seq_len):  # non-overlapping windows, as training/ measures
            chunk = stream[start:start + seq_len + 1][None]
            logits = model.forward(chunk[:, :-1])[0]
            nll += F.cross_entropy(logits.float(), chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    perplexity = math.exp(nll / count)
    print(f"held-out slice perplexity {perplexity:.3f} over {count} tokens (threshold {PERPLEXITY_THRESHOLD})")
    assert perplexity < PERPLEXITY_THRESHOLD, (
        f"held-out slice perplexity {perplexity:.3f} over {count} tokens; expected below {PERPLEXITY_THRESHOLD} "
        f"(measured {MEASURED_SLICE_PERPLEXITY} when the checkpoint was bundled)")


def test_greedy_completion_of_def_is_python_looking_text(model):
    text = model.generate("def ", max_new_tokens=24, temperature=0.0)
    print(repr(text))
    assert text.strip(), "greedy completion of 'def ' is empty"
    assert "(" in text and ":" in text, f"greedy completion of 'def ' does not look like a function header: {text!r}"


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers", reason="transformers 5.24 is the oracle (a test dependency)")
    model, info = transformers.MuseSparkForConditionalGeneration.from_pretrained(
        FOLDER, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers found missing/unexpected keys in muse-tiny: {info}"
    return model.eval()


def test_transformers_loads_muse_tiny_unchanged_and_gives_our_logits(hf_model):
    ids = torch.tensor([[0, 414, 286, 1290, 17, 9, 300, 41, 12, 2000, 77, 5] * 8])  # 96 tokens > window 64
    ours = musecore.load("muse-tiny", device="cpu", dtype=torch.float32).forward(ids)
    with torch.no_grad():
        theirs = hf_model(input_ids=ids).logits.float()
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert err <= 1e-4, f"muse-tiny fp32 logits differ from transformers' by {err:.2e} of max |logit| (tolerance 1e-4)"


def test_greedy_generate_equals_transformers_token_for_token_on_muse_tiny(hf_model):
    muse = musecore.load("muse-tiny", device="cpu", dtype=torch.float32)
    prompt = [0] + muse.tokenizer.encode("def fibonacci(n):", add_special_tokens=False)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=None,
                                   pad_token_id=7)[0, len(prompt):].tolist()
    assert muse.generate(prompt, max_new_tokens=80, stop=[]) == theirs


def test_chat_template_frames_a_conversation_with_the_special_tokens():
    transformers = pytest.importorskip("transformers", reason="transformers' tokenizer renders the chat template")
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in text and "<|message|>" in text, text
