"""Synthetic media for the muse-tiny-mm demo: coloured shapes drawn with Pillow, digits spoken by espeak-ng.

Everything is a pure function of a seed (images) or of an explicit synthesis spec (audio), so the
train and held-out sets can be rebuilt anywhere Pillow (and, for audio, Debian's ``espeak-ng``)
exists. The split (training/README.md):

- **Images** come from two disjoint seed streams: example ``i`` of split ``s`` is drawn with
  ``random.Random(f"image:{s}:{i}")``; ``s`` is ``"train"`` or ``"heldout"``, so no held-out image
  shares its seed (its shapes, positions, sizes, colour jitter, background) with a training image.
- **Audio**: a clip is ``(digit, voice, variant, speed, pitch)``. Held out are the espeak-ng voice
  *variants* whose ``sha256(name)[0] % 8 == 0`` (:data:`HELDOUT_VARIANTS`) and the whole voice
  ``en-us-nyc``: training clips use neither, held-out clips always use a held-out variant (with any
  voice), so every held-out clip is a speaker the model never heard.

Usage::

    python training/media_data.py --out .corpus/mmdata   # audio clips for training and evaluation
    python training/media_data.py --fixtures tests/data/media/heldout   # committed test media
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import shutil
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SIZE = 112  # a multiple of 28 (patch 14 x merge 2): the processor keeps it, 8x8 patches -> 16 tokens
CELL = 28         # pixels per image token (patch 14 x merge 2)
SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {  # name -> base RGB; each drawing jitters every channel by up to +-JITTER
    "red": (215, 35, 35), "green": (35, 165, 55), "blue": (40, 70, 220),
    "yellow": (235, 205, 20), "purple": (140, 50, 175), "orange": (245, 130, 20),
}
JITTER = 18
MAX_COUNT = 4
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

IMAGE_QUESTIONS = {
    "shape": ("What shape is this?", "What shape are they?", "Which shape do you see?"),
    "colour": ("What colour are the shapes?", "What color is it?", "Which colour do you see?"),
    "count": ("How many shapes are there?", "How many?", "Count the shapes."),
}
AUDIO_QUESTIONS = ("What digit is spoken?", "Which number do you hear?", "What number is said?")

VOICES = ("en-gb", "en-us", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd", "en-029",
          "en-us-nyc")
HELDOUT_VOICE = "en-us-nyc"
ESPEAK_RATE = 22050  # espeak-ng writes 16-bit mono at this rate
AUDIO_RATE = 24000   # what the model takes


# --------------------------------------------------------------------------------------------- images

@dataclass(frozen=True)
class ImageItem:
    """One drawn image and the facts about it."""

    image: object  # PIL.Image.Image, RGB, IMAGE_SIZE x IMAGE_SIZE
    shape: str
    colour: str
    count: int
    objects: tuple = ()  # (centre x, centre y, circumradius) of each shape, in image pixels


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "square":
        pts = [(math.cos(angle + math.pi / 4 + k * math.pi / 2), math.sin(angle + math.pi / 4 + k * math.pi / 2))
               for k in range(4)]
        return [(cx + r * x, cy + r * y) for x, y in pts]
    if shape == "triangle":
        return [(cx + r * math.cos(angle - math.pi / 2 + k * 2 * math.pi / 3),
                 cy + r * math.sin(angle - math.pi / 2 + k * 2 * math.pi / 3)) for k in range(3)]
    if shape == "star":
        return [(cx + (r if k % 2 == 0 else 0.45 * r) * math.cos(angle - math.pi / 2 + k * math.pi / 5),
                 cy + (r if k % 2 == 0 else 0.45 * r) * math.sin(angle - math.pi / 2 + k * math.pi / 5))
                for k in range(10)]
    raise ValueError(f"unknown shape {shape!r}")


def draw_image(rng: random.Random) -> ImageItem:
    """1-4 shapes of one kind and one colour on a light background, drawn 4x larger and downsampled."""
    from PIL import Image, ImageDraw

    shape, colour, count = rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.randint(1, MAX_COUNT)
    scale = 4
    size = IMAGE_SIZE * scale
    bg = tuple(rng.randint(215, 255) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    placed: list[tuple[float, float, float]] = []
    for _ in range(count):
        for _attempt in range(200):
            r = rng.uniform(8.0, 15.0 if count > 2 else 20.0) * scale
            cx, cy = rng.uniform(r + 2 * scale, size - r - 2 * scale), rng.uniform(r + 2 * scale, size - r - 2 * scale)
            if all(math.hypot(cx - x, cy - y) > r + q + 3 * scale for x, y, q in placed):
                break
        else:  # cannot happen at these sizes (checked on 100,000 seeds); a clear error if it ever does
            raise RuntimeError(f"could not place {count} shapes without overlap")
        placed.append((cx, cy, r))
        fill = tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[colour])
        angle = rng.uniform(-0.3, 0.3)
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_polygon(shape, cx, cy, r * (1.25 if shape == "triangle" else 1.0), angle), fill=fill)
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)
    outer = 1.25 if shape == "triangle" else 1.0  # the triangle is drawn at 1.25 r
    return ImageItem(img, shape, colour, count, tuple((cx / scale, cy / scale, outer * r / scale) for cx, cy, r in placed))


def cell_labels(item: ImageItem, covered: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """Per image token (a CELL x CELL square, row-major like the vision tower's merged output):
    whether a shape's centre lies in it (0/1), and the shape's index in SHAPES where the shapes'
    circumscribed discs cover more than ``covered`` of it, else len(SHAPES) (background).
    Training-only targets for the vision tower (train_multimodal_demo.AuxHeads)."""
    side = IMAGE_SIZE // CELL
    centre = np.zeros(side * side, dtype=np.int64)
    shape = np.full(side * side, len(SHAPES), dtype=np.int64)
    grid = (np.arange(IMAGE_SIZE // 2) * 2 + 1.0)  # sample points every 2 px
    xs, ys = np.meshgrid(grid, grid)
    inside = np.zeros(xs.shape, dtype=bool)
    for cx, cy, r in item.objects:
        centre[min(side - 1, int(cy // CELL)) * side + min(side - 1, int(cx // CELL))] = 1
        inside |= (xs - cx) ** 2 + (ys - cy) ** 2 <= r * r
    n = CELL // 2
    frac = inside.reshape(side, n, side, n).mean(axis=(1, 3)).reshape(-1)
    shape[frac > covered] = SHAPES.index(item.shape)
    return centre, shape


def image_item(split: str, index: int) -> ImageItem:
    """Example ``index`` of ``split`` ("train" or "heldout"): the seed stream decides the split."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    return draw_image(random.Random(f"image:{split}:{index}"))


def image_qa(item: ImageItem, rng: random.Random, kind: str | None = None) -> tuple[str, str, str]:
    """(kind, question, answer) about ``item``; ``kind`` random when None."""
    kind = kind or rng.choice(sorted(IMAGE_QUESTIONS))
    answer = {"shape": item.shape, "colour": item.colour, "count": str(item.count)}[kind]
    return kind, rng.choice(IMAGE_QUESTIONS[kind]), answer


# ---------------------------------------------------------------------------------------------- audio

def espeak_variants() -> list[str]:
    """The espeak-ng voice variants installed here, minus whispers and names with spaces."""
    root = Path(subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True, check=True)
                .stdout.split("Data at:")[1].strip()) / "voices" / "!v"
    return sorted(p.name for p in root.iterdir() if " " not in p.name and not p.name.startswith("whisper"))


def is_heldout_variant(variant: str) -> bool:
    return hashlib.sha256(variant.encode()).digest()[0] % 8 == 0


@dataclass(frozen=True)
class Clip:
    """What espeak-ng is asked to say, and how."""

    digit: int
    voice: str
    variant: str
    speed: int  # words per minute
    pitch: int  # 0-99

    @property
    def heldout(self) -> bool:
        return is_heldout_variant(self.variant)


def clip_specs(split: str, n: int, variants: list[str]) -> list[Clip]:
    """``n`` clips of ``split``: digits cycle 0-9; voice, variant, speed and pitch from the split's seed."""
    rng = random.Random(f"audio:{split}:{n}")
    if split == "train":
        vs, voices = [v for v in variants if not is_heldout_variant(v)], [v for v in VOICES if v != HELDOUT_VOICE]
    elif split == "heldout":
        vs, voices = [v for v in variants if is_heldout_variant(v)], list(VOICES)
    else:
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    return [Clip(i % 10, rng.choice(voices), rng.choice(vs), rng.randint(120, 230), rng.randint(20, 80))
            for i in range(n)]


def synthesize(clip: Clip) -> np.ndarray:
    """The clip as int16 mono at 22,050 Hz (espeak-ng's own rate), silence trimmed to 40 ms each side."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed: apt-get install -y espeak-ng")
    out = subprocess.run(["espeak-ng", "-v", f"{clip.voice}+{clip.variant}", "-s", str(clip.speed),
                          "-p", str(clip.pitch), "--stdout", DIGITS[clip.digit]], capture_output=True, check=True)
    with wave.open(io.BytesIO(out.stdout)) as w:
        if w.getframerate() != ESPEAK_RATE or w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise RuntimeError(f"espeak-ng wrote {w.getframerate()} Hz x {w.getnchannels()} ch x "
                               f"{w.getsampwidth()} B, expected {ESPEAK_RATE} Hz mono 16-bit")
        # espeak-ng streams to stdout with an unknown length in the header: read every frame there is
        data = np.frombuffer(out.stdout[44:], dtype="<i2")
    loud = np.flatnonzero(np.abs(data.astype(np.int32)) > 0.02 * max(1, int(np.abs(data).max())))
    if loud.size == 0:
        raise RuntimeError(f"espeak-ng produced silence for {clip}")
    margin = int(0.04 * ESPEAK_RATE)
    return data[max(0, loud[0] - margin): loud[-1] + margin].copy()


def build_audio(out: Path, n_train: int, n_heldout: int) -> None:
    """Write ``out/audio_{train,heldout}.npz``: int16 clips at 22,050 Hz, concatenated, with specs and offsets."""
    variants = espeak_variants()
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        specs = clip_specs(split, n, variants)
        clips = [synthesize(c) for c in specs]
        offsets = np.cumsum([0] + [len(c) for c in clips])
        np.savez_compressed(out / f"audio_{split}.npz", samples=np.concatenate(clips), offsets=offsets,
                            digit=np.array([c.digit for c in specs]), rate=ESPEAK_RATE,
                            spec=np.array([json.dumps(c.__dict__) for c in specs]))
        secs = offsets[-1] / ESPEAK_RATE
        print(f"{split}: {n} clips, {secs:.0f} s, {len({c.variant for c in specs})} variants, "
              f"{len({c.voice for c in specs})} voices -> {out / f'audio_{split}.npz'}")


def load_audio_split(path: Path) -> tuple[list[np.ndarray], list[int], list[dict], int]:
    """(int16 clips, digits, specs, rate) from :func:`build_audio`'s file."""
    z = np.load(path)
    off, samples = z["offsets"], z["samples"]  # each z[...] reads (and decompresses) the array again
    clips = [samples[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    return clips, [int(d) for d in z["digit"]], [json.loads(s) for s in z["spec"]], int(z["rate"])


# ------------------------------------------------------------------------------------------- fixtures

def write_fixtures(folder: Path, n_images: int = 120, n_audio: int = 60) -> None:
    """Committed held-out media for tests/unit/test_demo_mm.py: PNGs, 24 kHz 16-bit WAVs, manifest.json.

    Images are held-out items 0..n-1 with one question each (kinds in turn); clips are held-out clips
    (digits 0-9 in turn), resampled to 24 kHz by ``musecore.media.load_audio`` (the path musecore
    takes for a WAV file at another rate) and written as 16-bit PCM.
    """
    import soundfile as sf

    from musecore.media import load_audio

    folder.mkdir(parents=True, exist_ok=True)
    items = []
    kinds = sorted(IMAGE_QUESTIONS)
    for i in range(n_images):
        item = image_item("heldout", i)
        kind, question, answer = image_qa(item, random.Random(f"fixture-question:{i}"), kinds[i % 3])
        name = f"image_{i:02d}.png"
        item.image.save(folder / name, optimize=True)
        items.append({"file": name, "kind": "image", "question": question, "answer": answer, "asks": kind,
                      "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()})
    specs = clip_specs("heldout", n_audio, espeak_variants())
    for i, clip in enumerate(specs):
        raw = synthesize(clip).astype(np.float32) / 32768.0
        wav24 = load_audio(raw, sampling_rate=ESPEAK_RATE).numpy()
        name = f"digit_{i:02d}.wav"
        sf.write(folder / name, wav24, AUDIO_RATE, subtype="PCM_16")
        items.append({"file": name, "kind": "audio", "question": AUDIO_QUESTIONS[i % len(AUDIO_QUESTIONS)],
                      "answer": str(clip.digit), "espeak": clip.__dict__,
                      "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()})
    manifest = {"about": "held-out demo media for musecore/data/muse-tiny-mm, made by "
                         "training/media_data.py --fixtures (never trained on; see training/README.md)",
                "items": items}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(items)} fixtures -> {folder}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write audio_{train,heldout}.npz here")
    ap.add_argument("--train-clips", type=int, default=4000)
    ap.add_argument("--heldout-clips", type=int, default=300)
    ap.add_argument("--fixtures", type=Path, help="write the committed test media here")
    ap.add_argument("--fixture-images", type=int, default=120, help="held-out images 0..N-1 (question kinds in turn)")
    ap.add_argument("--fixture-clips", type=int, default=60, help="held-out clips (digits 0-9 in turn)")
    args = ap.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        build_audio(args.out, args.train_clips, args.heldout_clips)
    if args.fixtures:
        write_fixtures(args.fixtures, args.fixture_images, args.fixture_clips)


if __name__ == "__main__":
    main()
