"""Tower throughput and the encoder cache, musecore against transformers in one process.

Builds a random ``MuseSparkForConditionalGeneration`` whose towers have a preset's sizes (``small``:
muse-small's towers; ``816b``: the full model's, 50 vision layers of width 1536 and the 4-stage audio
pyramid) and whose text decoder is muse-tiny's (only the last projection of each tower depends on
it), saves it with ``save_pretrained``, loads it with ``musecore.load`` and times, in alternating
rounds on the same inputs and dtype:

- images/s at 448x448 and 1344x896 (pixels prepared once by ``musecore.media``; the timed call is the
  encoder: musecore's ``encode_images`` against transformers' ``get_image_features``),
- audio seconds per second on a 10 s clip (``encode_audio`` against ``get_audio_features``),
- a chat turn with one 448x448 image (``model.generate`` of one token, processing included) with the
  encoder cache cleared before the turn (uncached) and with the image already cached (cached).

Usage::

    python benchmarks/towers_bench.py --device cpu --towers small --out benchmarks/results/towers/cpu_small.json
    python benchmarks/towers_bench.py --device cuda --towers 816b --out $OUT/h200_816b.json   # on the GPU machine

The JSON records the hardware, the torch version and every round's time.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import musecore
from musecore.benchmarking import cpu_name

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "musecore" / "data" / "muse-tiny"
PRESET = {"tiny": "muse-tiny", "small": "muse-small", "816b": "muse-spark-open-816b-a42b"}
IMAGE_SIZES = ((448, 448), (1344, 896))  # (width, height)
AUDIO_SECONDS = 10.0


def build(towers: str, folder: Path, dtype: torch.dtype) -> None:
    """A random transformers model: muse-tiny's text decoder and tokenizer, a preset's towers."""
    from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration
    tiny = json.loads((TINY / "config.json").read_text())
    sizes = musecore.MuseConfig.from_name(PRESET[towers]).to_dict()
    text_hidden = tiny["text_config"]["hidden_size"]
    config = MuseSparkConfig(
        text_config=tiny["text_config"], vision_config=sizes["vision_config"],
        audio_config={**sizes["audio_config"], "out_hidden_size": text_hidden},
        out_hidden_size=sizes["out_hidden_size"], projector_hidden_size=sizes["projector_hidden_size"],
        image_token_id=tiny["image_token_id"], video_token_id=tiny["video_token_id"],
        audio_token_id=tiny["audio_token_id"])
    torch.manual_seed(0)
    MuseSparkForConditionalGeneration(config).to(dtype).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def alternate(ours, theirs, device: torch.device, rounds: int) -> tuple[list[float], list[float]]:
    """Warm both once, then ``rounds`` alternating (ours, theirs) timings."""
    ours(), theirs()
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(ours, device))
        b.append(timed(theirs, device))
    return a, b


def chat_turn(model, image_class, device: torch.device, rounds: int) -> dict:
    """One chat turn with a 448x448 image, the encoder cache cleared first (uncached) and then warm."""
    from musecore.multimodal import encoder_cache
    pixels = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    image = image_class.fromarray(pixels.numpy())
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                              {"type": "text", "text": "What is it?"}]}]
    cache = encoder_cache(model)
    model.generate(messages, max_new_tokens=1)  # warm-up
    cold, warm = [], []
    for _ in range(rounds):
        cache.clear()
        cold.append(timed(lambda: model.generate(messages, max_new_tokens=1), device))
        warm.append(timed(lambda: model.generate(messages, max_new_tokens=1), device))
    return {"case": "chat turn, one 448x448 image", "uncached_s": statistics.median(cold),
            "cached_s": statistics.median(warm), "speedup": statistics.median(cold) / statistics.median(warm),
            "uncached_rounds": cold, "cached_rounds": warm, "cache": cache.stats()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="musecore device (cpu, xeon, cuda, h200 ...)")
    p.add_argument("--towers", choices=sorted(PRESET), default="small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dtype = torch.bfloat16

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(args.towers, folder, dtype)
        model = musecore.load(folder, device=args.device, dtype=dtype, towers=True)
        device = model.device
        from transformers import MuseSparkForConditionalGeneration
        hf = MuseSparkForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        generator = torch.Generator().manual_seed(0)
        rows = []
        with torch.inference_mode():
            for width, height in IMAGE_SIZES:
                # The encoder's time does not depend on the pixel values: the grid is the image's (sizes that
                # are multiples of 28 keep their size), the values random.
                grid = torch.tensor([[1, height // 14, width // 14]], device=device)
                pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=generator).to(device, dtype)
                ours, theirs = alternate(lambda: model.encode_images(pixels, grid),
                                         lambda: hf.model.get_image_features(pixels, grid), device, args.rounds)
                rows.append({"case": "image", "size": f"{width}x{height}", "patches": int(grid.prod()),
                             "musecore_per_s": 1 / statistics.median(ours), "transformers_per_s": 1 / statistics.median(theirs),
                             "musecore_s": ours, "transformers_s": theirs})
            samples = int(AUDIO_SECONDS * 24000)  # a multiple of 1920: no padding
            values = (0.1 * torch.randn(1, samples, generator=generator)).to(device, dtype)
            mask = torch.ones(1, samples, dtype=torch.bool, device=device)
            ours, theirs = alternate(lambda: model.encode_audio(values, mask),
                                     lambda: hf.model.get_audio_features(values, mask.long()), device, args.rounds)
            rows.append({"case": "audio", "size": f"{AUDIO_SECONDS:g} s",
                         "musecore_per_s": AUDIO_SECONDS / statistics.median(ours),
                         "transformers_per_s": AUDIO_SECONDS / statistics.median(theirs),
                         "unit": "audio seconds per second", "musecore_s": ours, "transformers_s": theirs})

        try:
            from PIL import Image
        except ImportError:  # the GPU machine may lack Pillow: the encoder rows stand, the chat row is left out
            Image = None
        rows += [] if Image is None else [chat_turn(model, Image, device, args.rounds)]

    hardware = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "machine": platform.machine(),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    result = {"benchmark": "towers", "towers": args.towers, "device": args.device, "dtype": "bfloat16",
              "backend": model.plan.backend if model.plan is not None else None, "torch": torch.__version__,
              "hardware": hardware, "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        if "musecore_per_s" in row:
            print(f"{row['case']:6s} {row['size']:>10s}  musecore {row['musecore_per_s']:8.3f}/s  "
                  f"transformers {row['transformers_per_s']:8.3f}/s  ratio {row['musecore_per_s'] / row['transformers_per_s']:.2f}x")
        else:
            print(f"{row['case']}: uncached {row['uncached_s'] * 1e3:.1f} ms, cached {row['cached_s'] * 1e3:.1f} ms "
                  f"({row['speedup']:.1f}x)")


if __name__ == "__main__":
    main()
