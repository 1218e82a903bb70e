"""Train muse-tiny-mm: muse-tiny's text decoder plus small trained vision and audio towers.

The model is transformers' own ``MuseSparkForConditionalGeneration`` (5.24.0), trained as that
class and saved with ``save_pretrained``, like muse-tiny (training/README.md). It learns to answer
questions about synthetic images (shape, colour, count of Pillow-drawn shapes) and spoken digits
(espeak-ng), from training/media_data.py.

- **Init:** the text decoder and LM head are muse-tiny's (the token table grows from 4096 to 4104
  rows for the processor's start/end tokens); the towers, adapter and projections are
  transformers' random init. Everything trains; code windows from muse-tiny's own training split
  are mixed into every step so the decoder keeps its Python.
- **Inputs** are what musecore feeds at inference: pixel values by the image processor's formula
  (:func:`pixel_values`, checked equal to ``musecore.media`` by ``--check-processor``), the 24 kHz
  waveform padded to a multiple of 1920 with its mask, and prompt ids from the checkpoint's own
  chat template and tokenizer with each placeholder expanded as transformers' processor does.

Usage (see training/README.md for the run that made the shipped checkpoint)::

    python training/media_data.py --out .corpus/mmdata --train-clips 4000     # espeak-ng clips -> audio_*.npz
    python training/train_multimodal_demo.py --prepare .corpus/mmdata   # 24 kHz clips + code windows
    python training/train_multimodal_demo.py --out /tmp/mm --time-budget 300 --device cuda
    # the shipped checkpoint's second run: a vision-only phase with per-token probes, then the joint phase
    python training/train_multimodal_demo.py --init-from musecore/data/muse-tiny-mm --freeze-audio-tower \
        --vision-seconds 100 --dense-weight 1 --batch-vision 256 --time-budget 150 --out /tmp/mm --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import json
import lzma
import math
import platform
import random
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import media_data as md  # noqa: E402
from muse_tiny import CHECKPOINT as MUSE_TINY  # noqa: E402
from muse_tiny import TEXT_CONFIG, start_run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "musecore/data/muse-tiny-mm"

# The processor's token strings (transformers' MuseSparkProcessor defaults, which the real release
# uses too). <|patch|>, <|video|>, <|audio|> keep muse-tiny's ids 4, 5, 6 (the chat template writes
# one of them per media part; the processor expands it); the start/end tokens are new, ids 4096+.
TOKENS = {
    "image_token": "<|patch|>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>",
    "video_token": "<|video|>", "video_start_token": "<|vid_start|>", "video_end_token": "<|vid_end|>",
    "video_sep_token": "<|vid_frame_separator|>",
    "audio_token": "<|audio|>", "audio_start_token": "<|soft_audio_start|>", "audio_end_token": "<|soft_audio_end|>",
}
NEW_TOKENS = ("<|image_start|>", "<|image_end|>", "<|soft_audio_start|>", "<|soft_audio_end|>", "<|vid_start|>",
              "<|vid_end|>", "<|vid_frame_separator|>", "<|reserved_0|>")  # ids 4096..4103
VOCAB = 4096 + len(NEW_TOKENS)
IMAGE_ID, VIDEO_ID, AUDIO_ID = 4, 5, 6
BOS_ID, EOM_ID, EOS_ID, PAD_ID = 0, 2, 3, 7
VISION_CONFIG = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
AUDIO_CONFIG = dict(hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 2, 2], out_hidden_size=256)
TOP_CONFIG = dict(out_hidden_size=4 * 96, projector_hidden_size=256, image_token_id=IMAGE_ID,
                  video_token_id=VIDEO_ID, audio_token_id=AUDIO_ID)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|start|>' + message['role'] + '<|message|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|patch|>' -}}{%- elif part['type'] == 'video' -%}{{- '<|video|>' -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio|>' -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|eot|>' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start|>assistant<|message|>' -}}{%- endif -%}"
)
PATCH, MERGE, TEMPORAL = 14, 2, 2
GRID = md.IMAGE_SIZE // PATCH               # patches per side of a training image
IMAGE_TOKENS = (GRID // MERGE) ** 2         # placeholder tokens per image
AUDIO_INPUT_STD = 0.6  # init std of the audio tower's first projection (raw waveform -> stage 1); see init_model
SAMPLES_PER_TOKEN = 1920


# --small: a decoder trained from scratch, small enough to train on two shared CPU cores (the shipped
# model; see training/README.md for why): 2 dense layers of width 128, towers to match.
SMALL_TEXT_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, sliding_window=64,
    mlp_layer_types=["dense", "dense"], num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=128,
    moe_intermediate_size=128, output_multiplier=1.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
SMALL_VISION_CONFIG = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2)
SMALL_AUDIO_CONFIG = dict(hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1], out_hidden_size=128)
SMALL_TOP_CONFIG = dict(TOP_CONFIG, out_hidden_size=4 * 64, projector_hidden_size=128)


def demo_config(small: bool = False):
    from transformers import MuseSparkConfig

    if small:
        return MuseSparkConfig(text_config=dict(SMALL_TEXT_CONFIG), vision_config=dict(SMALL_VISION_CONFIG),
                               audio_config=dict(SMALL_AUDIO_CONFIG), **SMALL_TOP_CONFIG)
    text = dict(TEXT_CONFIG, vocab_size=VOCAB)
    return MuseSparkConfig(text_config=text, vision_config=dict(VISION_CONFIG), audio_config=dict(AUDIO_CONFIG),
                           **TOP_CONFIG)


# ------------------------------------------------------------------------------------ tokenizer files

def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (muse-tiny's, id 4 renamed <|patch|>, 8 special tokens added) and tokenizer_config.json."""
    tok = json.loads((MUSE_TINY / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert vocab["<|image|>"] == IMAGE_ID and len(vocab) == 4096, "muse-tiny's tokenizer.json changed"
    del vocab["<|image|>"]
    vocab["<|patch|>"] = IMAGE_ID
    for entry in tok["added_tokens"]:
        if entry["id"] == IMAGE_ID:
            entry["content"] = "<|patch|>"
    template = dict(tok["added_tokens"][0])
    for i, content in enumerate(NEW_TOKENS):
        vocab[content] = 4096 + i
        tok["added_tokens"].append(dict(template, id=4096 + i, content=content))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<|start|>", "eos_token": "<|eot|>",
              "pad_token": "<|pad|>", **TOKENS, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096, "padding_side": "left", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------------ inputs

def pixel_values(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, H, W, 3]`` (H, W multiples of 28, so the processor does not resize) -> ``[n*h*w, 1176]``.

    transformers' MuseGlimmerImageProcessor: rescale 1/255 and normalise mean 0.5 std 0.5, fused, patches in
    row-major (h, w) order, each laid out (temporal, channel, 14, 14) with the frame repeated twice.
    """
    n, height, width, _ = images.shape
    # transformers fuses rescale and normalise: (x - 0.5 * 255) / (0.5 * 255), in float32
    x = (images.permute(0, 3, 1, 2).to(torch.float32) - 0.5 * 255) / (0.5 * 255)
    h, w = height // PATCH, width // PATCH
    x = x.reshape(n, 3, h, PATCH, w, PATCH).permute(0, 2, 4, 1, 3, 5)  # n, h, w, c, p, p
    x = x.unsqueeze(3).expand(-1, -1, -1, TEMPORAL, -1, -1, -1)
    return x.reshape(n * h * w, TEMPORAL * 3 * PATCH * PATCH)


class Prompts:
    """Prompt ids as musecore / transformers build them: chat template, placeholder expansion, tokenizer."""

    def __init__(self, folder: Path):
        import jinja2
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.template = jinja2.Environment().from_string(CHAT_TEMPLATE)

    @lru_cache(maxsize=None)
    def prompt(self, kind: str, question: str, n_tokens: int, media_first: bool) -> tuple[int, ...]:
        part = {"type": kind}
        text = {"type": "text", "text": question}
        rendered = self.template.render(messages=[{"role": "user", "content": [part, text] if media_first
                                                   else [text, part]}], add_generation_prompt=True)
        if kind == "image":
            single = TOKENS["image_token"]
            expanded = TOKENS["image_start_token"] + single * n_tokens + TOKENS["image_end_token"]
        else:
            single = TOKENS["audio_token"]
            expanded = TOKENS["audio_start_token"] + single * n_tokens + TOKENS["audio_end_token"]
        assert rendered.count(single) == 1, rendered
        return tuple(self.tok.encode(rendered.replace(single, expanded), add_special_tokens=False).ids)

    @lru_cache(maxsize=None)
    def answer(self, text: str) -> tuple[int, ...]:
        return tuple(self.tok.encode(text + "<|eot|>", add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True).strip()


def pad_batch(seqs: list[list[int]], n_prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and loss mask (answer tokens only)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), PAD_ID, dtype=torch.long)
    att = torch.zeros((len(seqs), length), dtype=torch.long)
    loss = torch.zeros((len(seqs), length), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, n_prompt)):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        loss[i, p:len(s)] = True
    return ids, att, loss


def audio_batch(waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """MuseSparkFeatureExtractor: right-pad with zeros to the longest, rounded up to 1920; mask; tokens each."""
    longest = max(len(w) for w in waves)
    length = -(-longest // SAMPLES_PER_TOKEN) * SAMPLES_PER_TOKEN
    values = torch.zeros(len(waves), length)
    mask = torch.zeros(len(waves), length, dtype=torch.long)
    for i, w in enumerate(waves):
        values[i, :len(w)] = w
        mask[i, :len(w)] = 1
    return values, mask, [-(-len(w) // SAMPLES_PER_TOKEN) for w in waves]


MU = 255.0


def mulaw_encode(x: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> 8-bit mu-law (G.711's curve, mu = 255): half the bytes of 16-bit PCM, ~38 dB SNR."""
    y = np.sign(x) * np.log1p(MU * np.minimum(np.abs(x), 1.0)) / np.log1p(MU)
    return np.round((y + 1) / 2 * 255).astype(np.uint8)


def mulaw_decode(q: np.ndarray) -> np.ndarray:
    y = q.astype(np.float32) / 255 * 2 - 1
    return (np.sign(y) * np.expm1(np.abs(y) * np.log1p(MU)) / MU).astype(np.float32)


def load_clips(path: Path) -> tuple[list[torch.Tensor], list[int], list[dict]]:
    """24 kHz float clips from ``prepare``'s file: training clips stored as 8-bit mu-law (so that they
    travel to the GPU machine), held-out clips as 16-bit PCM (int16 / 32768, as a 16-bit WAV reads)."""
    z = np.load(path)
    off = z["offsets"]  # read once: each z[...] reads the file again
    raw = lzma.decompress(z["payload"].tobytes())
    if str(z["encoding"]) == "mulaw8":
        samples = mulaw_decode(np.frombuffer(raw, dtype=np.uint8))
    else:  # "pcm16-delta": int16 differences (wrapping), undone by an int16 cumsum
        samples = np.frombuffer(raw, dtype="<i2").cumsum(dtype=np.int16).astype(np.float32) / 32768.0
    clips = [torch.from_numpy(samples[off[i]:off[i + 1]].copy()) for i in range(len(off) - 1)]
    return clips, [int(d) for d in z["digit"]], [json.loads(s) for s in z["spec"]]


def resample_all(clips: list[np.ndarray], rate: int, load_audio) -> list[np.ndarray]:
    """``load_audio(clip, sampling_rate=rate)`` for every int16 clip, fast.

    musecore's resampler (``musecore.media.audio.resample``, torchaudio's Hann-windowed sinc)
    puts output k at input ``k * orig // new`` (rates divided by their gcd, 147 -> 160 here) and
    weighs the 16 input samples around it with a kernel that depends only on ``k % new``. It
    computes that kernel for every output sample, which takes minutes for 1,500 clips on this
    machine; here the ``new`` distinct kernels are computed once with the same float64 formula and
    applied to every clip. Every clip's result is then compared with ``load_audio`` itself on
    every 50th clip: they must be equal (bitwise), or this stops.
    """
    import musecore.media.audio as ma

    orig, new = rate // math.gcd(rate, ma.SAMPLING_RATE), ma.SAMPLING_RATE // math.gcd(rate, ma.SAMPLING_RATE)
    width_factor, rolloff = 6, 0.99
    base = min(orig, new) * rolloff
    width = math.ceil(width_factor * orig / base)
    offsets = torch.arange(-width, width + 2, dtype=torch.int64)
    k = torch.arange(new, dtype=torch.int64)
    m = ((k * orig) // new)[:, None] + offsets
    t = (m * new - (k * orig)[:, None]).to(torch.float64) * (base / (orig * new))
    t = t.clamp_(-width_factor, width_factor)
    window = torch.cos(t * (math.pi / width_factor / 2)) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, 1.0, t))
    kernel = kernel * window * (base / orig)  # [new, taps]
    out = []
    for i, c in enumerate(clips):
        x = torch.from_numpy(c.astype(np.float32) / 32768.0).to(torch.float64)
        n = len(x)
        kk = torch.arange(-(-new * n // orig), dtype=torch.int64)
        idx = ((kk * orig) // new)[:, None] + offsets
        taps = torch.where((idx >= 0) & (idx < n), x[idx.clamp(0, n - 1)], 0.0)
        y = (taps * kernel[kk % new]).sum(dim=1).to(torch.float32).numpy()
        if i % 50 == 0:
            ref = load_audio(c, sampling_rate=rate).numpy()
            if not np.array_equal(ref, y):
                raise SystemExit(f"clip {i}: fast resampling differs from musecore.media.load_audio by "
                                 f"{np.abs(ref - y).max() if ref.shape == y.shape else ref.shape}")
        out.append(y)
    return out


def prepare(data: Path, code_chunks: int, seed: int) -> None:
    """espeak-ng clips -> 24 kHz int16 (musecore.media.load_audio), and code windows from muse-tiny's train split."""
    from musecore.media import load_audio

    for split in ("train", "heldout"):
        clips, digits, specs, rate = md.load_audio_split(data / f"audio_{split}.npz")
        out = resample_all(clips, rate, load_audio)
        offsets = np.cumsum([0] + [len(c) for c in out])
        flat = np.concatenate(out)
        if split == "train":
            encoding, payload = "mulaw8", mulaw_encode(flat).tobytes()
        else:
            pcm = np.clip(np.round(flat * 32768.0), -32768, 32767).astype(np.int16)
            encoding, payload = "pcm16-delta", np.diff(pcm, prepend=np.int16(0)).astype("<i2").tobytes()
        np.savez(data / f"clips24k_{split}.npz", payload=np.frombuffer(lzma.compress(payload), np.uint8),
                 encoding=encoding, offsets=offsets, digit=np.array(digits),
                 spec=np.array([json.dumps(s) for s in specs]))
        print(f"{split}: {len(out)} clips at 24 kHz ({encoding}), {offsets[-1] / 24000:.0f} s")
    stream = np.fromfile(REPO / ".corpus/train.i16", dtype="<i2")
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(len(stream) // 4096, size=code_chunks, replace=False)) * 4096
    code = np.stack([stream[s:s + 4096] for s in starts])
    np.savez_compressed(data / "code.npz", chunks=code)
    print(f"code: {code.size} tokens of muse-tiny's train split ({code_chunks} chunks of 4096)")


def write_subset(data: Path, out: Path, n_train: int, n_heldout: int, code_chunks: int) -> None:
    """The first clips (and code chunks) of ``prepare``'s files, for a run whose working tree has little room left
    (the device tool's 64 MiB): clip i of a prefix is clip i of the whole file (offsets, digits and specs cut at
    the same place; the PCM deltas of a prefix undo to the same samples)."""
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        z = np.load(data / f"clips24k_{split}.npz")
        off, encoding = z["offsets"][:n + 1], str(z["encoding"])
        width = 1 if encoding == "mulaw8" else 2
        raw = lzma.decompress(z["payload"].tobytes())[:int(off[-1]) * width]
        np.savez(out / f"clips24k_{split}.npz", payload=np.frombuffer(lzma.compress(raw), np.uint8),
                 encoding=encoding, offsets=off, digit=z["digit"][:n], spec=z["spec"][:n])
    code = np.load(data / "code.npz")["chunks"][:code_chunks]
    np.savez_compressed(out / "code.npz", chunks=code)
    print(f"{out}: {n_train} training clips, {n_heldout} held-out clips, {len(code)} code chunks")


def check_processor(n: int) -> dict:
    """pixel_values() and audio_batch() against musecore.media on n held-out items: must be identical."""
    from musecore.media import MediaProcessor

    proc = MediaProcessor.from_pretrained(None, demo_config())
    items = [md.image_item("heldout", i) for i in range(n)]
    ours = pixel_values(torch.stack([torch.from_numpy(np.array(it.image)) for it in items]))
    theirs = proc.images([it.image for it in items])
    assert theirs.grid_thw.tolist() == [[1, GRID, GRID]] * n, theirs.grid_thw
    image_diff = (ours - theirs.pixel_values).abs().max().item()
    waves = [torch.randn(int(l)) * 0.1 for l in torch.randint(3000, 20000, (n,))]
    values, mask, tokens = audio_batch(waves)
    a = proc.audio(waves)
    audio_diff = (values - a.input_values).abs().max().item() if values.shape == a.input_values.shape else float("inf")
    same_mask = values.shape == a.input_values.shape and torch.equal(mask.bool(), a.mask.bool())
    strings = {k: proc.placeholder(k, inp, 0) for k, inp in (("image", theirs), ("audio", a))}
    expected = {"image": TOKENS["image_start_token"] + TOKENS["image_token"] * IMAGE_TOKENS + TOKENS["image_end_token"],
                "audio": TOKENS["audio_start_token"] + TOKENS["audio_token"] * tokens[0] + TOKENS["audio_end_token"]}
    return {"images": n, "pixel_values_max_abs_diff": image_diff, "audio_values_max_abs_diff": audio_diff,
            "audio_mask_equal": same_mask, "placeholders_equal": strings == expected}


# ------------------------------------------------------------------------------------ training

def patch_for_autocast() -> None:
    from train_muse_tiny import patch_for_autocast as patch

    patch()


def batch_vision_attention() -> None:
    """Run transformers' vision attention as one batched SDPA call when every segment has one length.

    Without flash attention, ``MuseSparkVisionAttention.forward`` splits the packed sequence at
    ``cu_seqlens`` and calls SDPA once per image (per window): hundreds of small calls a step here,
    where every image has the same size. Equal segments are the same computation as a batch of
    ``[n, heads, length, head_dim]``; anything else takes transformers' own path.
    :func:`check_vision_attention` compares both on random inputs.
    """
    from transformers.models.muse_spark import modeling_muse_spark as mm

    original = getattr(mm.MuseSparkVisionAttention, "_transformers_forward", mm.MuseSparkVisionAttention.forward)

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if mm.is_flash_attention_requested(self.config) or bool((lengths != lengths[0]).any()):
            return original(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        seq, n, length = hidden_states.shape[0], len(lengths), int(lengths[0])
        q, k, v = (proj(hidden_states).reshape(1, seq, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        q, k = mm.apply_rotary_pos_emb_vision(q, k, cos, sin)
        q, k, v = (x.reshape(n, length, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
        attention = mm.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, mm.eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False)
        return self.proj(out.reshape(seq, -1).contiguous())

    mm.MuseSparkVisionAttention._transformers_forward = original
    mm.MuseSparkVisionAttention.forward = forward


def check_vision_attention(device: torch.device) -> dict:
    """The batched vision attention against transformers' per-segment loop: outputs and gradients."""
    from transformers.models.muse_spark import modeling_muse_spark as mm

    torch.manual_seed(0)
    tower = mm.MuseSparkVisionModel(demo_config().vision_config).to(device)
    pv = torch.randn(3 * GRID * GRID, TEMPORAL * 3 * PATCH * PATCH, device=device)
    grid = torch.tensor([[1, GRID, GRID]] * 3, device=device)
    results = []
    for use_batched in (False, True):
        forward = mm.MuseSparkVisionAttention.forward
        if not use_batched:
            mm.MuseSparkVisionAttention.forward = mm.MuseSparkVisionAttention._transformers_forward
        tower.zero_grad()
        out = tower(pv, grid).last_hidden_state
        out.square().mean().backward()
        results.append((out.detach(), tower.patch_embedder.patch_embedding.weight.grad.clone()))
        mm.MuseSparkVisionAttention.forward = forward
    return {"vision_attention_max_abs_diff": float((results[0][0] - results[1][0]).abs().max()),
            "vision_attention_grad_max_rel_diff": float((results[0][1] - results[1][1]).abs().max()
                                                        / results[0][1].abs().max())}


def init_model(device: torch.device, small: bool = False):
    """Fresh MuseSparkForConditionalGeneration (transformers' init); unless ``small``, text decoder and
    LM head from muse-tiny. ``small``: the token embedding is re-drawn normal(0, 1), as for muse-tiny
    (it is followed by a weightless RMSNorm, so its scale only sets its effective learning rate)."""
    from safetensors.torch import load_file
    from transformers import MuseSparkForConditionalGeneration

    model = MuseSparkForConditionalGeneration(demo_config(small))
    tiny = {} if small else load_file(str(MUSE_TINY / "model.safetensors"))
    if small:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 1.0)
    state = model.state_dict()
    copied = 0
    with torch.no_grad():
        for name, t in tiny.items():
            if not name.startswith(("model.language_model.", "lm_head.")):
                continue
            target = state[name]
            if name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
                target[:4096].copy_(t.float())
                if name.startswith("model.language_model.embed_tokens"):
                    target[4096:].normal_(0.0, float(t.float().std()))  # same scale as the trained rows
                else:
                    target[4096:].normal_(0.0, 0.02)
            else:
                assert target.shape == t.shape, (name, target.shape, t.shape)
                target.copy_(t.to(target.dtype))
            copied += 1
        # transformers zero-initialises biases, so a silent stretch of waveform (exact zeros: padding
        # inside a batch, leading silence) reaches the first RMSNorm as a zero vector and its
        # gradient is scaled by 1/sqrt(eps) = 1000 per stage: grad norms of 1e7 at step 1. A small
        # random bias on each stage's patch projection keeps every normed vector away from zero.
        for layer in model.model.audio_tower.layers:
            layer.patch_embedder.proj.bias.normal_(0.0, 0.02)
        # That bias must not drown the waveform: with transformers' std 0.02 the first projection
        # maps a 16-sample frame of speech (rms ~0.1) to ~0.01 per channel, below the 0.02 bias, so
        # after the stage's RMSNorm every frame looks alike and the tower does not learn (a tower +
        # linear digit probe stayed at 15-20% on its own training batches). Drawn at AUDIO_INPUT_STD
        # the speech dominates the bias and the same probe reaches ~85% held-out in 150 steps.
        model.model.audio_tower.layers[0].patch_embedder.proj.weight.normal_(0.0, AUDIO_INPUT_STD)
    return model.to(device), copied


def learning_rate(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def answer_loss(model, ids: torch.Tensor, loss_mask: torch.Tensor, **inputs) -> torch.Tensor:
    """Cross-entropy of each answer token (and its <|eot|>) given everything before it.

    transformers' forward (``model.model``, then its LM head, output multiplier and tanh softcap,
    as ``MuseSparkForConditionalGeneration.forward`` applies them) with the LM head applied only
    at the positions that predict an answer token: most of a step's arithmetic otherwise.
    """
    hidden = model.model(input_ids=ids, use_cache=False, **inputs).last_hidden_state
    mask = loss_mask[:, 1:]
    text = model.config.text_config
    logits = model.lm_head(hidden[:, :-1][mask]) * text.output_multiplier
    logits = torch.tanh(logits / text.final_logit_softcapping) * text.final_logit_softcapping
    return F.cross_entropy(logits.float(), ids[:, 1:][mask])


class AuxHeads(torch.nn.Module):
    """Training-only probes on the towers' outputs (mean over an input's tokens -> linear -> class).

    They give the towers a direct signal from the first step (the decoder has to learn to read
    the towers before the answer loss can teach them anything) and are not part of the checkpoint.
    """

    def __init__(self, model, dense_weight: float = 0.0):
        super().__init__()
        hidden = model.config.text_config.hidden_size
        self.dense_weight = dense_weight
        self.cell_centre = torch.nn.Linear(hidden, 2)  # per image token: does a shape's centre lie in it
        self.cell_shape = torch.nn.Linear(hidden, len(md.SHAPES) + 1)  # per image token: the shape there, or none
        self.shape = torch.nn.Linear(hidden, len(md.SHAPES))
        self.colour = torch.nn.Linear(hidden, len(md.COLOURS))
        self.count = torch.nn.Linear(hidden, md.MAX_COUNT)
        self.digit = torch.nn.Linear(hidden, 10)
        self.vision_out = self.audio_out = None
        model.model.vision_projection.register_forward_hook(lambda m, i, o: setattr(self, "vision_out", o))
        model.model.audio_tower.register_forward_hook(lambda m, i, o: setattr(self, "audio_out", o.last_hidden_state))

    def image_loss(self, shape, colour, count, centres, cell_shapes, tokens_per_image: int) -> torch.Tensor:
        """Mean-pooled probes (shape, colour, count) plus, weighted by ``dense_weight``, per-token probes
        (media_data.cell_labels: centre present, shape or background): a direct signal for every token."""
        tokens = self.vision_out.reshape(len(shape), tokens_per_image, -1).float()
        pooled = tokens.mean(1)
        loss = (F.cross_entropy(self.shape(pooled), shape) + F.cross_entropy(self.colour(pooled), colour)
                + F.cross_entropy(self.count(pooled), count)) / 3
        if self.dense_weight:
            dense = (F.cross_entropy(self.cell_centre(tokens).reshape(-1, 2), centres.reshape(-1))
                     + F.cross_entropy(self.cell_shape(tokens).reshape(-1, len(md.SHAPES) + 1), cell_shapes.reshape(-1)))
            loss = loss + self.dense_weight * dense / 2
        return loss

    def audio_loss(self, digits, tokens: list[int]) -> torch.Tensor:
        feats = self.audio_out.float()
        mask = (torch.arange(feats.shape[1], device=feats.device)[None] < torch.tensor(tokens, device=feats.device)[:, None])
        pooled = (feats * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.cross_entropy(self.digit(pooled), digits)


VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")


@torch.no_grad()
def probe_accuracy(model, aux: AuxHeads, images: list, device, autocast=contextlib.nullcontext) -> dict:
    """The training-only probes on held-out images: pooled shape/colour/count heads, and the count
    read as the number of image tokens whose centre head says yes (does the tower find the objects)."""
    model.eval()
    right = {"shape": 0, "colour": 0, "count": 0, "count_from_centres": 0}
    for start in range(0, len(images), 200):
        chunk = images[start:start + 200]
        pv = pixel_values(torch.stack([torch.from_numpy(np.array(im)) for im, *_ in chunk])).to(device)
        with autocast():
            model.model.get_image_features(pv, torch.tensor([[1, GRID, GRID]] * len(chunk), device=device))
        tokens = aux.vision_out.reshape(len(chunk), IMAGE_TOKENS, -1).float()
        pooled = tokens.mean(1)
        guess = {"shape": [md.SHAPES[i] for i in aux.shape(pooled).argmax(-1).tolist()],
                 "colour": [sorted(md.COLOURS)[i] for i in aux.colour(pooled).argmax(-1).tolist()],
                 "count": [str(i + 1) for i in aux.count(pooled).argmax(-1).tolist()],
                 "count_from_centres": [str(i) for i in (aux.cell_centre(tokens).argmax(-1) == 1).sum(1).tolist()]}
        for j, (*_, facts) in enumerate(chunk):
            for key, values in guess.items():
                right[key] += values[j] == facts[{"shape": 0, "colour": 1}.get(key, 2)]
    model.train()
    return {f"probe_{k}": v / len(images) for k, v in right.items()}


def train_vision(model, aux: AuxHeads, data, images_eval: list, args, device, autocast, note) -> None:
    """Phase one (``--vision-seconds``): the vision tower, adapter and projection trained on the
    training-only probes alone (pooled and per-token, AuxHeads.image_loss), ``--vision-batch`` images
    a step. A step of the tower alone takes milliseconds where a step of the whole model takes a
    large part of a second, and the probes on held-out images showed shape accuracy growing with
    optimizer steps rather than images (training/README.md); the joint phase then teaches the
    decoder to read the new features."""
    named = [(n, p) for n, p in model.named_parameters() if n.startswith(VISION_PREFIXES)]
    named += [(f"aux.{n}", p) for n, p in aux.named_parameters() if not n.startswith("digit")]
    decay = [p for n, p in named if p.dim() >= 2 and "position_embedding" not in n]
    rest = [p for n, p in named if not (p.dim() >= 2 and "position_embedding" not in n)]
    params = decay + rest
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=args.lr_vision, betas=(0.9, 0.95),
                                  eps=1e-8, fused=device.type == "cuda")
    total, step, t0, calib_start, loss_sum, n = 10 ** 9, 0, time.time(), None, 0.0, 0
    while step < total:
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            calib_start = time.time()
        if step == 25:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - calib_start) / 20
            total = max(50, int((args.vision_seconds - (time.time() - t0)) / per_step) + 25)
            note({"event": "vision_calibrated", "seconds_per_step": round(per_step, 4), "steps": total})
        lr = args.lr_vision * learning_rate(step, total if total < 10 ** 9 else 1000, args.warmup)
        for g in optimizer.param_groups:
            g["lr"] = lr
        pv, grid, labels = data.vision_batch(args.vision_batch)
        with autocast():
            model.model.get_image_features(pv.to(device), grid.to(device))
            loss = aux.image_loss(*(x.to(device) for x in labels), tokens_per_image=IMAGE_TOKENS)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:
            note({"event": "vision_skipped_step", "step": step + 1, "grad_norm": str(float(grad_norm))})
        step += 1
        loss_sum, n = loss_sum + float(loss.detach()), n + 1
        if step % (args.log_every * 10) == 0 or step == total:
            note({"event": "vision_train", "step": step, "of": total, "seconds": round(time.time() - t0, 1),
                  "lr": round(lr, 6), "loss_probes": round(loss_sum / n, 4),
                  **probe_accuracy(model, aux, images_eval[:300], device, autocast)})
            loss_sum, n = 0.0, 0
    note({"event": "vision_trained", "steps": step, "seconds": round(time.time() - t0, 1),
          **probe_accuracy(model, aux, images_eval, device, autocast)})


class Data:
    """Training batches: drawn images (a pool), augmented 24 kHz clips, code windows."""

    def __init__(self, data: Path, prompts: Prompts, pool: int, seed: int, workers: int, clean_audio: float = 0.0):
        self.prompts = prompts
        self.clean_audio = clean_audio
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        t = time.time()
        if workers > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(workers) as p:
                items = p.map(_draw_train, range(pool), chunksize=64)
        else:
            items = [_draw_train(i) for i in range(pool)]
        self.images = torch.from_numpy(np.stack([i[0] for i in items]))  # uint8 [N, size, size, 3]
        self.facts = [i[1] for i in items]
        # probe targets: shape, colour, count - 1, then per image token centre (0/1) and shape or background
        self.labels = (torch.tensor([md.SHAPES.index(f[0]) for f in self.facts]),
                       torch.tensor([sorted(md.COLOURS).index(f[1]) for f in self.facts]),
                       torch.tensor([f[2] - 1 for f in self.facts]),
                       torch.from_numpy(np.stack([i[2][0] for i in items])),
                       torch.from_numpy(np.stack([i[2][1] for i in items])))
        self.draw_seconds = time.time() - t
        self.clips, self.digits, _ = load_clips(data / "clips24k_train.npz")
        self.code = torch.from_numpy(np.load(data / "code.npz")["chunks"].astype(np.int64))

    def image_batch(self, n: int):
        idx = [self.rng.randrange(len(self.facts)) for _ in range(n)]
        seqs, n_prompt = [], []
        for i in idx:
            shape, colour, count = self.facts[i]
            item = md.ImageItem(None, shape, colour, count)
            _, question, answer = md.image_qa(item, self.rng)
            p = self.prompts.prompt("image", question, IMAGE_TOKENS, self.rng.random() < 0.75)
            seqs.append(list(p) + list(self.prompts.answer(answer)))
            n_prompt.append(len(p))
        ids, att, loss = pad_batch(seqs, n_prompt)
        at = torch.tensor(idx, device=self.images.device)
        pv = pixel_values(self.images[at])
        return ids, att, loss, pv, torch.tensor([[1, GRID, GRID]] * n), tuple(x[at] for x in self.labels)

    def vision_batch(self, n: int):
        """Images for the vision tower's training-only probes alone (no question): pixel values, grid, labels."""
        at = torch.randint(0, len(self.facts), (n,), generator=self.gen).to(self.images.device)
        return pixel_values(self.images[at]), torch.tensor([[1, GRID, GRID]] * n), tuple(x[at] for x in self.labels)

    def to(self, device: torch.device) -> "Data":
        """Keep the image pool and its labels on ``device`` (pixel values are then computed there)."""
        self.images = self.images.to(device)
        self.labels = tuple(x.to(device) for x in self.labels)
        return self

    def augment(self, w: torch.Tensor) -> torch.Tensor:
        """A clip as a training example: with probability ``clean_audio`` only a random gain (the held-out
        clips are clean espeak-ng output), else also tempo, leading/trailing silence and noise."""
        r = self.rng
        if r.random() < self.clean_audio:
            return w * (r.uniform(0.3, 1.0) / max(1e-4, float(w.abs().max())))
        if r.random() < 0.5:  # tempo/pitch +-8% by linear resampling
            factor = r.uniform(0.92, 1.08)
            w = F.interpolate(w[None, None], size=max(1, int(len(w) * factor)), mode="linear",
                              align_corners=False)[0, 0]
        w = w * r.uniform(0.3, 1.0) / max(1e-4, float(w.abs().max()))
        lead = torch.zeros(r.randrange(0, 4800))
        w = torch.cat([lead, w, torch.zeros(r.randrange(0, 2400))])
        if r.random() < 0.5:
            w = w + torch.randn(len(w), generator=self.gen) * float(w.abs().max()) * 10 ** (-r.uniform(25, 45) / 20)
        return w

    def audio_batch(self, n: int):
        idx = [self.rng.randrange(len(self.clips)) for _ in range(n)]
        waves = [self.augment(self.clips[i]) for i in idx]
        values, mask, tokens = audio_batch(waves)
        seqs, n_prompt = [], []
        for i, k in zip(idx, tokens):
            p = self.prompts.prompt("audio", self.rng.choice(md.AUDIO_QUESTIONS), k, self.rng.random() < 0.75)
            seqs.append(list(p) + list(self.prompts.answer(str(self.digits[i]))))
            n_prompt.append(len(p))
        ids, att, loss = pad_batch(seqs, n_prompt)
        return ids, att, loss, values, mask, torch.tensor([self.digits[i] for i in idx]), tokens

    def code_batch(self, n: int, length: int) -> torch.Tensor:
        rows = torch.randint(0, len(self.code), (n,), generator=self.gen)
        starts = torch.randint(0, self.code.shape[1] - length, (n,), generator=self.gen)
        return torch.stack([self.code[r, s:s + length] for r, s in zip(rows.tolist(), starts.tolist())])


def _draw_train(i: int):
    it = md.image_item("train", i)
    return np.asarray(it.image, dtype=np.uint8), (it.shape, it.colour, it.count), md.cell_labels(it)


# ------------------------------------------------------------------------------------ evaluation

def heldout_sets(data: Path, n_images: int, n_clips: int | None):
    """Held-out questions: images (every question kind in turn) and clips, with their expected answers."""
    images = []
    kinds = sorted(md.IMAGE_QUESTIONS)
    for i in range(n_images):
        item = md.image_item("heldout", i)
        kind, question, answer = md.image_qa(item, random.Random(f"eval-question:{i}"), kinds[i % 3])
        images.append((np.array(item.image, dtype=np.uint8), kind, question, answer,
                       (item.shape, item.colour, str(item.count))))
    clips, digits, specs = load_clips(data / "clips24k_heldout.npz")
    n_clips = len(clips) if n_clips is None else n_clips
    audio = [(clips[i], md.AUDIO_QUESTIONS[i % 3], str(digits[i]), specs[i]) for i in range(n_clips)]
    return images, audio


@torch.no_grad()
def greedy_answers(model, prompts: Prompts, kind: str, examples: list, device, batch: int = 64,
                   max_new: int = 6, autocast=contextlib.nullcontext) -> list[str]:
    """Greedy decoding (full forward each step) of every example; batches of equal prompt length."""
    if kind == "image":
        plist = [prompts.prompt("image", q, IMAGE_TOKENS, True) for _, _, q, *_ in examples]
    else:
        plist = [prompts.prompt("audio", q, -(-len(w) // SAMPLES_PER_TOKEN), True) for w, q, _, _ in examples]
    out = [""] * len(examples)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(plist):
        by_len.setdefault(len(p), []).append(i)
    for idxs in by_len.values():
        for start in range(0, len(idxs), batch):
            chunk = idxs[start:start + batch]
            ids = torch.tensor([plist[i] for i in chunk], device=device)
            extra = {}
            if kind == "image":
                extra["pixel_values"] = pixel_values(torch.stack([torch.from_numpy(examples[i][0]) for i in chunk])).to(device)
                extra["image_grid_thw"] = torch.tensor([[1, GRID, GRID]] * len(chunk), device=device)
            else:
                values, mask, _ = audio_batch([examples[i][0] for i in chunk])
                # transformers casts pixel values to the patch embedding's dtype itself, not audio
                extra["input_values"] = values.to(device, next(model.parameters()).dtype)
                extra["input_values_mask"] = mask.to(device)
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            new = []
            for _ in range(max_new):
                with autocast():
                    logits = model(input_ids=ids, use_cache=False, **extra).logits[:, -1]
                nxt = logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
                new.append(nxt)
                done |= (nxt == EOS_ID) | (nxt == EOM_ID)
                ids = torch.cat([ids, nxt[:, None]], 1)
                if bool(done.all()):
                    break
            new = torch.stack(new, 1).tolist()
            for i, seq in zip(chunk, new):
                seq = [t for t in seq if t not in (PAD_ID,)]
                if EOS_ID in seq:
                    seq = seq[:seq.index(EOS_ID)]
                out[i] = prompts.decode(seq)
    return out


def evaluate(model, prompts: Prompts, images: list, audio: list, device, autocast=contextlib.nullcontext) -> dict:
    model.eval()
    got_i = greedy_answers(model, prompts, "image", images, device, autocast=autocast)
    got_a = greedy_answers(model, prompts, "audio", audio, device, autocast=autocast)
    per_kind = {}
    for (_, kind, _, ans, *_), g in zip(images, got_i):
        k = per_kind.setdefault(kind, [0, 0])
        k[0] += g == ans
        k[1] += 1
    wrong_i = [{"index": i, "asks": kind, "question": q, "expected": ans, "got": g}
               for i, ((_, kind, q, ans, *_), g) in enumerate(zip(images, got_i)) if g != ans]
    wrong_a = [{"index": i, "expected": ans, "got": g, "espeak": spec}
               for i, ((_, _, ans, spec), g) in enumerate(zip(audio, got_a)) if g != ans]
    model.train()
    return {
        "image_accuracy": sum(g == e[3] for g, e in zip(got_i, images)) / max(1, len(images)),
        "audio_accuracy": sum(g == e[2] for g, e in zip(got_a, audio)) / max(1, len(audio)),
        "images": len(images), "clips": len(audio),
        "image_accuracy_by_question": {k: v[0] / v[1] for k, v in sorted(per_kind.items())},
        "image_errors": wrong_i[:40], "audio_errors": wrong_a[:40],
    }


def code_perplexity(model, device, autocast=contextlib.nullcontext) -> dict:
    """muse-tiny's CI-slice perplexity (3 held-out stdlib modules), to show the decoder kept its Python."""
    from muse_tiny import perplexity, slice_stream

    model.eval()
    with autocast():
        r = perplexity(model, slice_stream(), 512, 16)
    model.train()
    return r


# ------------------------------------------------------------------------------------ main

def finish(run: Path, dest: Path) -> None:
    """Install a run's checkpoint as the bundled model: weights and configs as ``save_pretrained`` wrote
    them, the tokenizer files, and eval.json with musecore's own answers on the committed held-out media."""
    import hashlib
    import shutil

    src = run / "muse-tiny-mm"
    if not (src / "model.safetensors").is_file():
        sys.exit(f"{src}/model.safetensors not found: a sharded run needs training/merge_shards.py first")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(src / name, dest / name)
    write_tokenizer(dest)
    results = json.loads((run / "eval.json").read_text())

    import musecore

    fixtures = REPO / "tests/data/media/heldout"
    items = json.loads((fixtures / "manifest.json").read_text())["items"]
    model = musecore.load(str(dest), device="cpu")
    answers = []
    for item in items:
        part = {"type": item["kind"], "path": str(fixtures / item["file"])}
        got = model.chat([{"role": "user", "content": [part, {"type": "text", "text": item["question"]}]}],
                         max_new_tokens=6).strip()
        answers.append({"file": item["file"], "question": item["question"], "expected": item["answer"], "got": got})
    by_kind = {k: [a for a, i in zip(answers, items) if i["kind"] == k] for k in ("image", "audio")}
    results["musecore_fixtures"] = {
        "what": "musecore.load('muse-tiny-mm').chat on tests/data/media/heldout (CPU, reference backend)",
        **{f"{k}_accuracy": sum(a["got"] == a["expected"] for a in v) / len(v) for k, v in by_kind.items()},
        "answers": answers}
    results["checkpoint"] = {n: {"bytes": (dest / n).stat().st_size,
                                 "sha256": hashlib.sha256((dest / n).read_bytes()).hexdigest()}
                             for n in sorted(p.name for p in dest.iterdir() if p.name != "eval.json")}
    (dest / "eval.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results["musecore_fixtures"].items() if k != "answers"}))


def evaluate_checkpoint(args: argparse.Namespace) -> None:
    """Held-out accuracy of a saved checkpoint as shipped (BF16 weights, transformers' forward)."""
    from transformers import MuseSparkForConditionalGeneration

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok_dir = Path(tempfile.mkdtemp())
    write_tokenizer(tok_dir)
    prompts = Prompts(tok_dir)
    batch_vision_attention()
    model = MuseSparkForConditionalGeneration.from_pretrained(args.evaluate, dtype=torch.bfloat16).to(device).eval()
    if device.type == "cpu":
        model.set_experts_implementation(args.experts_implementation or "eager")
    images, audio = heldout_sets(args.data, args.eval_images, args.eval_clips)
    t = time.time()
    result = evaluate(model, prompts, images, audio, device)
    result.update(checkpoint=str(args.evaluate), device=str(device), seconds=round(time.time() - t, 1),
                  torch=torch.__version__)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval_heldout.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("errors")}))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=REPO / ".corpus/mmdata",
                    help="prepare's folder (under the git-ignored .corpus/, so the device tool does not send it)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prepare", type=Path, help="only write clips24k_*.npz and code.npz into this folder")
    ap.add_argument("--code-chunks", type=int, default=300)
    ap.add_argument("--finish", type=Path, help="install this run's checkpoint as musecore/data/muse-tiny-mm")
    ap.add_argument("--subset", type=Path, help="only write the first clips and code chunks of --data into this folder")
    ap.add_argument("--subset-train", type=int, default=700)
    ap.add_argument("--subset-heldout", type=int, default=60)
    ap.add_argument("--subset-code", type=int, default=100)
    ap.add_argument("--init-from", type=Path, help="start from this saved checkpoint (a folder) instead of muse-tiny")
    ap.add_argument("--check-processor", type=int, default=0, help="compare inputs with musecore.media on N items")
    ap.add_argument("--evaluate", type=Path, help="only evaluate this saved checkpoint (BF16, transformers) on the "
                    "held-out sets (--eval-images, the clips of --data) and print the result")
    ap.add_argument("--freeze-audio-tower", action="store_true", help="keep the audio tower's weights (with --init-from)")
    ap.add_argument("--vision-seconds", type=float, default=0, help="first train the vision tower on its probes alone")
    ap.add_argument("--vision-batch", type=int, default=512)
    ap.add_argument("--lr-vision", type=float, default=2e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small decoder from scratch (the shipped model)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--experts-implementation", choices=("grouped_mm", "eager"),
                    help="transformers' MoE path (default: grouped_mm on cuda, eager on cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds of training; sets --steps from steps 5-25")
    ap.add_argument("--batch-image", type=int, default=64)
    ap.add_argument("--batch-audio", type=int, default=64)
    ap.add_argument("--batch-code", type=int, default=16)
    ap.add_argument("--code-len", type=int, default=128)
    ap.add_argument("--code-weight", type=float, default=0.5)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the towers' training-only probes")
    ap.add_argument("--dense-weight", type=float, default=0.0, help="weight of the per-image-token probes (AuxHeads)")
    ap.add_argument("--batch-vision", type=int, default=0, help="extra images per step for the vision probes alone")
    ap.add_argument("--lr-new", type=float, default=2e-3, help="towers, adapter, projection, new token rows")
    ap.add_argument("--lr-text", type=float, default=3e-4, help="muse-tiny's decoder and LM head")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--clean-audio", type=float, default=0.5, help="share of training clips left unaugmented but for gain")
    ap.add_argument("--pool", type=int, default=16000, help="training images drawn once, reused")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-images", type=int, default=600)
    ap.add_argument("--eval-clips", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--shard-size", default="15MB")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.prepare:
        prepare(args.prepare, args.code_chunks, args.seed)
        return
    if args.finish:
        finish(args.finish, DEMO)
        return
    if args.subset:
        write_subset(args.data, args.subset, args.subset_train, args.subset_heldout, args.subset_code)
        return
    if args.evaluate:
        evaluate_checkpoint(args)
        return
    if args.check_processor:
        print(json.dumps(check_processor(args.check_processor)))
        return
    if args.out is None:
        sys.exit("--out is required for training")
    import transformers
    from transformers import MuseSparkForConditionalGeneration

    device, use_bf16, log = start_run(args)
    note = log.note

    tok_dir = Path(tempfile.mkdtemp())
    write_tokenizer(tok_dir)
    prompts = Prompts(tok_dir)
    data = Data(args.data, prompts, args.pool, args.seed, args.workers, args.clean_audio)
    images_eval, audio_eval = heldout_sets(args.data, args.eval_images, args.eval_clips)
    patch_for_autocast()
    batch_vision_attention()
    note({"event": "vision_attention_check", **check_vision_attention(device)})
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.init_from:  # continue training a saved muse-tiny-mm (fp32 master weights again from its BF16)
        model = MuseSparkForConditionalGeneration.from_pretrained(args.init_from, dtype=torch.float32).to(device)
        copied = f"none: init from {args.init_from}"
    else:
        model, copied = init_model(device, args.small)
    experts = args.experts_implementation or ("grouped_mm" if device.type == "cuda" else "eager")
    if not args.small:
        model.set_experts_implementation(experts)
    model.train()
    ac = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    new_params, text_params, frozen = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias") or (args.freeze_audio_tower and name.startswith("model.audio_tower.")):
            p.requires_grad_(False)
            frozen.append(name)
            continue
        (text_params if name.startswith(("model.language_model.", "lm_head.")) else new_params).append((name, p))

    def groups(named, lr):
        decay = [p for n, p in named if p.dim() >= 2 and "embed_tokens" not in n and "position_embedding" not in n]
        rest = [p for n, p in named if not (p.dim() >= 2 and "embed_tokens" not in n and "position_embedding" not in n)]
        return [{"params": decay, "weight_decay": args.weight_decay, "base_lr": lr},
                {"params": rest, "weight_decay": 0.0, "base_lr": lr}]

    aux = AuxHeads(model, args.dense_weight).to(device)
    param_groups = (groups(new_params, args.lr_new) + groups(text_params, args.lr_text)
                    + groups(list(aux.named_parameters()), args.lr_new))
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr_new, betas=(0.9, 0.95), eps=1e-8,
                                  fused=device.type == "cuda")
    # new token rows of the embedding and LM head learn at the towers' rate through a gradient scale
    emb, head = model.get_input_embeddings().weight, model.lm_head.weight
    scale = torch.ones(VOCAB, 1, device=device)
    scale[4096:] = args.lr_new / args.lr_text
    emb.register_hook(lambda g: g * scale)
    head.register_hook(lambda g: g * scale)

    n_params = sum(p.numel() for p in model.parameters())
    note({"event": "start", "params": n_params, "tower_params": sum(p.numel() for _, p in new_params),
          "copied_from_muse_tiny": copied, "device": str(device), "bf16_autocast": use_bf16,
          "torch": torch.__version__, "transformers": transformers.__version__,
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
          "pool_images": len(data.facts), "draw_seconds": round(data.draw_seconds, 1),
          "train_clips": len(data.clips), "code_tokens": int(data.code.numel()),
          "heldout_images": len(images_eval), "heldout_clips": len(audio_eval),
          "args": {k: str(v) for k, v in vars(args).items()}})
    if not args.small and (device.type == "cuda" or args.eval_every):
        note({"event": "code_slice_init", **code_perplexity(model, device, ac)})
    if args.vision_seconds:
        train_vision(model, aux, data.to(device), images_eval, args, device, ac, note)

    total = args.steps or 10 ** 9
    t0 = time.time()
    calib_start = None
    step = 0
    sums = {"image": 0.0, "audio": 0.0, "code": 0.0, "aux_image": 0.0, "aux_audio": 0.0, "n": 0}
    while step < total:
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            calib_start = time.time()
        if step == 25 and args.time_budget and not args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - calib_start) / 20
            total = max(30, int((args.time_budget - (time.time() - t0)) / per_step) + 25)
            note({"event": "calibrated", "seconds_per_step": round(per_step, 4), "steps": total})
        lr_factor = learning_rate(step, total if total < 10 ** 9 else 1000, args.warmup)
        for g in optimizer.param_groups:
            g["lr"] = g["base_lr"] * lr_factor
        ids, att, lmask, pv, grid, labels = data.image_batch(args.batch_image)
        with ac():
            loss_i = answer_loss(model, ids.to(device), lmask.to(device), attention_mask=att.to(device),
                                 pixel_values=pv.to(device), image_grid_thw=grid.to(device))
            aux_i = aux.image_loss(*(x.to(device) for x in labels), tokens_per_image=IMAGE_TOKENS)
        if args.batch_vision:  # more images for the vision tower's probes alone
            pv, grid, labels = data.vision_batch(args.batch_vision)
            with ac():
                model.model.get_image_features(pv.to(device), grid.to(device))
                aux_i = aux_i + aux.image_loss(*(x.to(device) for x in labels), tokens_per_image=IMAGE_TOKENS)
        ids, att, lmask, values, vmask, digits, tokens = data.audio_batch(args.batch_audio)
        with ac():
            loss_a = answer_loss(model, ids.to(device), lmask.to(device), attention_mask=att.to(device),
                                 input_values=values.to(device), input_values_mask=vmask.to(device))
            aux_a = aux.audio_loss(digits.to(device), tokens)
        loss = loss_i + loss_a + args.aux_weight * (aux_i + aux_a)
        if args.batch_code:
            code = data.code_batch(args.batch_code, args.code_len + 1).to(device)
            with ac():
                logits = model(input_ids=code[:, :-1], use_cache=False).logits
            loss_c = F.cross_entropy(logits.float().reshape(-1, VOCAB), code[:, 1:].reshape(-1))
            loss = loss + args.code_weight * loss_c
        else:
            loss_c = torch.zeros(())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for g in param_groups for p in g["params"]], 1.0)
        # one inf in a gradient makes clipping scale it by 0 and write NaN into every weight (the second
        # shipped-recipe run, a continuation, ended that way): such a step is skipped and logged instead
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:
            note({"event": "skipped_step", "step": step + 1, "grad_norm": str(float(grad_norm)),
                  "losses": [round(float(x.detach()), 4) for x in (loss_i, loss_a, aux_i, aux_a, loss_c)]})
        step += 1
        sums["image"] += float(loss_i.detach())
        sums["audio"] += float(loss_a.detach())
        sums["code"] += float(loss_c.detach())
        sums["aux_image"] += float(aux_i.detach())
        sums["aux_audio"] += float(aux_a.detach())
        sums["n"] += 1
        if step % args.log_every == 0 or step == total:
            n = sums.pop("n")
            note({"event": "train", "step": step, "of": total, "seconds": round(time.time() - t0, 1),
                  "lr_factor": round(lr_factor, 4), "grad_norm": round(float(grad_norm), 3),
                  **{f"loss_{k}": round(v / n, 4) for k, v in sums.items()}})
            sums = {"image": 0.0, "audio": 0.0, "code": 0.0, "aux_image": 0.0, "aux_audio": 0.0, "n": 0}
        if args.eval_every and step % args.eval_every == 0:
            r = evaluate(model, prompts, images_eval[:120], audio_eval[:60], device, ac)
            note({"event": "eval", "step": step, **{k: v for k, v in r.items() if not k.endswith("errors")}})
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t0
    note({"event": "trained", "steps": step, "seconds": round(train_seconds, 1)})

    folder = args.out / "muse-tiny-mm"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model, optimizer
        shipped = MuseSparkForConditionalGeneration.from_pretrained(tmp, dtype=torch.bfloat16)
    shipped.generation_config.bos_token_id = BOS_ID
    shipped.generation_config.eos_token_id = [EOS_ID, EOM_ID]
    shipped.generation_config.pad_token_id = PAD_ID
    shipped.generation_config.do_sample = False
    shipped.save_pretrained(folder, max_shard_size=args.shard_size)
    shipped = shipped.to(device).eval()
    if not args.small:
        shipped.set_experts_implementation(experts)
    result = evaluate(shipped, prompts, images_eval, audio_eval, device)
    code = None if args.small else code_perplexity(shipped, device)
    note({"event": "heldout_bf16_checkpoint", **{k: v for k, v in result.items() if not k.endswith("errors")},
          "code_slice": code})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (args.out / "eval.json").write_text(json.dumps({
        "heldout": result, "code_slice_bf16": code, "device": gpu,
        "training": {"steps": step, "seconds": round(train_seconds, 1), "seed": args.seed,
                     "args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }, indent=1) + "\n")
    print(f"held-out accuracy: images {result['image_accuracy']:.3f} ({result['images']}), "
          f"spoken digits {result['audio_accuracy']:.3f} ({result['clips']})", flush=True)
    log.close()


if __name__ == "__main__":
    main()
