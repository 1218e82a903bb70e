"""The muse-tiny configuration, as transformers' ``MuseSparkConfig``, and what the training scripts share.

Everything not named here is transformers' default for ``MuseSparkConfig`` (5.24.0): sigmoid top-k
routing with ``e_score_correction_bias``, pooled experts with the shared post-expert norm, residual
gates, weightless QK/O norms, NoPE on every 4th layer counted back from the last (here layers 1 and
5, full attention), sliding window on the others, final tanh softcap 20. ``output_multiplier`` is
``1/sqrt(hidden_size/256) = 1.0`` for H=256, the rule transformers documents for the released model.

The vision and audio towers are the smallest that the config accepts (the audio tower's
``out_hidden_size`` must equal the text ``hidden_size``); they are never trained here and ship at
their random initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = REPO / "musecore/data/muse-tiny"
TOKENIZER = CHECKPOINT / "tokenizer.json"
SLICE = REPO / "musecore/data/eval/stdlib_heldout_slice.jsonl"

# Special tokens of the shipped tokenizer (train_tokenizer.SPECIAL_TOKENS), ids 0..7.
SPECIAL_TOKENS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|image|>", "<|video|>", "<|audio|>", "<|pad|>")
BOS_ID, EOM_ID, EOS_ID, PAD_ID = 0, 2, 3, 7
STOP_IDS = [EOS_ID, EOM_ID]  # generation stops on <|eot|> and on <|eom|>

PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n")

TEXT_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, sliding_window=64, num_local_experts=12,
    num_experts_per_tok=4, moe_hidden_size=128, moe_intermediate_size=256, output_multiplier=1.0,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
VISION_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
AUDIO_CONFIG = dict(hidden_sizes=[32, 32, 32, 32], depths=[1, 1, 1, 1], out_hidden_size=256)
TOP_CONFIG = dict(out_hidden_size=256, projector_hidden_size=256, image_token_id=4, video_token_id=5, audio_token_id=6)

# Parameters that training updates: the text decoder and the LM head. Everything else (vision
# tower, vision adapter and projection, audio tower) stays at transformers' random init.
TRAINED_PREFIXES = ("model.language_model.", "lm_head.")


def muse_tiny_config():
    from transformers import MuseSparkConfig

    return MuseSparkConfig(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                           audio_config=dict(AUDIO_CONFIG), **TOP_CONFIG)


def slice_stream() -> list[int]:
    """The committed CI slice, framed as in training: ``<|start|>`` + file + ``<|eot|>`` per file."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    ids: list[int] = []
    for line in SLICE.read_text(encoding="utf-8").splitlines():
        ids += [BOS_ID] + tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids + [EOS_ID]
    return ids


def perplexity(model, stream, seq_len: int = 512, batch: int = 64, autocast_bf16: bool = False) -> dict:
    """exp(mean NLL) over every token but the first, in non-overlapping ``seq_len`` windows (last one shorter).

    ``model`` is a ``MuseSparkForConditionalGeneration``; its own forward gives the logits.
    """
    import contextlib
    import math

    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    stream = torch.as_tensor(stream, dtype=torch.long)
    n = len(stream) - 1
    starts = list(range(0, n, seq_len))
    full = [s for s in starts if s + seq_len <= n]
    rest = [s for s in starts if s + seq_len > n]
    chunks = [stream[torch.tensor(full[i:i + batch])[:, None] + torch.arange(seq_len + 1)]
              for i in range(0, len(full), batch)]
    chunks += [stream[s:n + 1][None] for s in rest]
    nll, count = 0.0, 0
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext()
    with torch.no_grad():
        for chunk in chunks:
            chunk = chunk.to(device)
            with ctx:
                logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1),
                                   reduction="sum").item()
            count += chunk[:, 1:].numel()
    return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens": count}


class RunLog:
    """A training run's log: ``note(record)`` prints one JSON line and appends it to ``<out>/train_log.jsonl``."""

    def __init__(self, out: Path) -> None:
        self.file = open(Path(out) / "train_log.jsonl", "w")

    def note(self, record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def start_run(args) -> tuple:
    """``(device, use_bf16, log)`` for a training run: the device, bf16 autocast on a GPU when ``args.bf16``, the
    seed set, ``args.out`` created and its :class:`RunLog` opened."""
    import torch
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    return device, args.bf16 and device.type == "cuda", RunLog(args.out)
