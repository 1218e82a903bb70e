"""One object per checkpoint that turns media into tower inputs and prompt placeholders.

It reads the checkpoint's processor files when they are there (``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_config.json``) and the placeholder token strings
from ``tokenizer_config.json``, falling back to transformers 5.24's defaults, and reproduces
``MuseSparkProcessor``: the chat template writes one placeholder per medium (``<|image|>`` in
muse-tiny, transformers' default ``<|patch|>``), and :meth:`MediaProcessor.placeholder` is the
string that replaces it (``replace_image_token`` / ``replace_video_token`` / ``replace_audio_token``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .audio import AudioInputs, AudioSettings, load_audio, process_audio
from .errors import MediaError
from .image import ImageInputs, ImageSettings, load_image, process_images
from .video import Video, VideoInputs, VideoSettings, load_video, process_videos

# MuseSparkProcessor.__init__: getattr(tokenizer, key, default)
TOKEN_DEFAULTS = {
    "image_token": "<|patch|>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>",
    "video_token": "<|video|>", "video_sep_token": "<|vid_frame_separator|>", "video_start_token": "<|vid_start|>",
    "video_end_token": "<|vid_end|>",
    "audio_token": "<|audio|>", "audio_start_token": "<|soft_audio_start|>", "audio_end_token": "<|soft_audio_end|>",
}
KINDS = ("image", "video", "audio")


class MediaProcessor:
    """Images, videos and audio -> tower inputs and placeholder strings, as transformers' processor.

    Example::

        processor = MediaProcessor.from_pretrained("musecore/data/muse-tiny", config)
        images = processor.images([load_image("cat.png")])
        prompt = prompt.replace(processor.token_strings["image"], processor.placeholder("image", images, 0), 1)
    """

    def __init__(self, image: ImageSettings = ImageSettings(), video: VideoSettings = VideoSettings(),
                 audio: AudioSettings = AudioSettings(), tokens: Optional[Mapping[str, str]] = None,
                 source: str = "transformers defaults") -> None:
        self.image_settings, self.video_settings, self.audio_settings = image, video, audio
        self.tokens = {**TOKEN_DEFAULTS, **(tokens or {})}
        self.source = source

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path, None] = None, config: Any = None) -> "MediaProcessor":
        """Settings from ``folder``'s processor files and token strings from its ``tokenizer_config.json``,
        checked against the model ``config`` (``MuseConfig``, a config.json dict, or None)."""
        image, video, audio, tokens, found = {}, {}, {}, {}, []
        if folder is not None:
            folder = Path(folder)
            pre = _read_json(folder / "preprocessor_config.json")
            if pre is not None:
                found.append("preprocessor_config.json")
                image.update(_pick(pre, ImageSettings))
                audio.update(_pick(pre, AudioSettings))
            vid = _read_json(folder / "video_preprocessor_config.json")
            if vid is not None:
                found.append("video_preprocessor_config.json")
                video.update(_pick(vid, VideoSettings))
            proc = _read_json(folder / "processor_config.json")
            if proc is not None:
                found.append("processor_config.json")
                image.update(_pick(proc.get("image_processor") or {}, ImageSettings))
                video.update(_pick(proc.get("video_processor") or {}, VideoSettings))
                audio.update(_pick(proc.get("feature_extractor") or proc.get("audio_processor") or {}, AudioSettings))
            tok = _read_json(folder / "tokenizer_config.json")
            if tok is not None:
                found.append("tokenizer_config.json")
                tokens = _token_strings(tok, folder / "tokenizer_config.json")
        _reconcile(image, video, audio, config)
        try:
            settings = (ImageSettings(**_tuples(image)), VideoSettings(**_tuples(video)),
                        AudioSettings(**_tuples(audio)))
        except TypeError as exc:
            raise MediaError(f"processor settings in {folder} are not valid ({exc}); fix or remove the file") from None
        source = f"{folder} ({', '.join(found)})" if found else "transformers defaults"
        return cls(*settings, tokens=tokens, source=source)

    @property
    def token_strings(self) -> dict:
        """The single placeholder the chat template writes for each kind: {"image": ..., "video": ..., "audio": ...}."""
        return {kind: self.tokens[f"{kind}_token"] for kind in KINDS}

    # loading with this checkpoint's settings
    def load_image(self, src: Any, name: Optional[str] = None):
        return load_image(src, name=name)

    def load_video(self, src: Any, name: Optional[str] = None, **kwargs: Any) -> Video:
        return load_video(src, name=name, settings=self.video_settings, **kwargs)

    def load_audio(self, src: Any, sampling_rate: Optional[int] = None, name: Optional[str] = None) -> torch.Tensor:
        return load_audio(src, sampling_rate, name=name, target_rate=self.audio_settings.sampling_rate)

    # processing
    def images(self, images: Sequence[Any]) -> ImageInputs:
        """PIL images (or anything load_image takes) -> ``ImageInputs(pixel_values [P, 1176], grid_thw [n, 3])``."""
        return process_images(images, self.image_settings)

    def videos(self, videos: Sequence[Any]) -> VideoInputs:
        """Videos (``Video`` from load_video, or anything it takes) -> ``VideoInputs``."""
        loaded = [v if isinstance(v, Video) else self.load_video(v, name=f"video #{i + 1}")
                  for i, v in enumerate(videos)]
        return process_videos(loaded, self.video_settings)

    def audio(self, clips: Sequence[Any]) -> AudioInputs:
        """24 kHz mono tensors (or anything load_audio takes) -> ``AudioInputs(input_values, mask)``."""
        waves = [c if isinstance(c, torch.Tensor) and c.ndim == 1 and c.is_floating_point()
                 else self.load_audio(c, name=f"audio #{i + 1}") for i, c in enumerate(clips)]
        return process_audio(waves, self.audio_settings)

    # placeholders
    def placeholder(self, kind: str, inputs: Any, index: int) -> str:
        """The string that replaces the ``index``-th ``kind`` placeholder (transformers' replace_*_token)."""
        t = self.tokens
        if kind == "image":
            count = int(inputs.grid_thw[index].prod()) // self.image_settings.merge_size ** 2
            return t["image_start_token"] + t["image_token"] * count + t["image_end_token"]
        if kind == "video":
            groups = int(inputs.grid_thw[index, 0])
            per_group = int(inputs.grid_thw[index, 1:].prod()) // self.video_settings.merge_size ** 2
            stamps = list(inputs.timestamps[index][::self.video_settings.temporal_patch_size])[:groups]
            while len(stamps) < groups:
                stamps.append(stamps[-1] if stamps else 0.0)
            text = t["video_start_token"]
            for g, stamp in enumerate(stamps):
                text += self.video_settings.frame_timestamp_format.format(timestamp=stamp)
                text += t["video_token"] * per_group
                text += t["video_sep_token"] if g < groups - 1 else t["video_end_token"]
            return text
        if kind == "audio":
            samples = int(inputs.mask[index].sum()) if inputs.mask is not None else int(inputs.input_values.shape[-1])
            count = -(-samples // self.audio_settings.samples_per_token)
            return t["audio_start_token"] + t["audio_token"] * count + t["audio_end_token"]
        raise MediaError(f"unknown media kind {kind!r}; use one of {', '.join(KINDS)}")

    def expand(self, text: str, images: Optional[ImageInputs] = None, videos: Optional[VideoInputs] = None,
               audio: Optional[AudioInputs] = None) -> str:
        """Replace each placeholder of ``text`` in order with its expansion (transformers'
        ``get_text_with_replacements``); the counts must match the inputs."""
        given = {"image": images, "video": videos, "audio": audio}
        groups = []
        for kind in KINDS:
            token = self.token_strings[kind]
            found = text.count(token)
            have = len(given[kind]) if given[kind] is not None else 0
            if found != have:
                raise MediaError(f"the prompt has {found} {kind} placeholders ({token}) but {have} {kind} inputs were "
                                 f"given; pass one {kind} per placeholder")
            if have:
                groups.append(f"(?P<{kind}>{re.escape(token)})")
        if not groups:
            return text
        counters = dict.fromkeys(KINDS, 0)

        def swap(match: re.Match) -> str:
            kind = match.lastgroup
            counters[kind] += 1
            return self.placeholder(kind, given[kind], counters[kind] - 1)

        return re.sub("|".join(groups), swap, text)

    def __repr__(self) -> str:
        return f"MediaProcessor(source={self.source!r}, tokens={self.token_strings})"


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MediaError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(data, dict):
        raise MediaError(f"{path} holds a {type(data).__name__}, not a JSON object; fix or remove it")
    return data


def _pick(data: Mapping, settings_cls: type) -> dict:
    names = {f.name for f in fields(settings_cls)}
    return {k: v for k, v in data.items() if k in names and v is not None}


def _tuples(values: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def _token_strings(tok: Mapping, path: Path) -> dict:
    """Token strings of tokenizer_config.json: top-level keys or the ``extra_special_tokens`` mapping."""
    extra = tok.get("extra_special_tokens")
    extra = extra if isinstance(extra, Mapping) else {}
    out = {}
    for key in TOKEN_DEFAULTS:
        value = tok.get(key, extra.get(key))
        if isinstance(value, Mapping):                      # AddedToken as a dict
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise MediaError(f"{path}: {key} must be a non-empty string, got {value!r}; fix the tokenizer config")
        out[key] = value
    return out


def _reconcile(image: dict, video: dict, audio: dict, config: Any) -> None:
    """Fill patch/merge/temporal sizes from the model config where no processor file set them, and
    refuse a processor file that disagrees with the towers the config describes."""
    if config is None:
        return
    vision = _sub(config, "vision_config")
    audio_cfg = _sub(config, "audio_config")
    if vision:
        pairs = {"patch_size": vision.get("patch_size"), "merge_size": vision.get("merge_size"),
                 "temporal_patch_size": vision.get("patch_temporal", vision.get("temporal_patch_size"))}
        for target, label in ((image, "image"), (video, "video")):
            for key, value in pairs.items():
                if value is None:
                    continue
                if key in target and int(target[key]) != int(value):
                    raise MediaError(f"the {label} processor's {key}={target[key]} differs from the vision tower's "
                                     f"{value} in config.json; fix the processor config")
                target.setdefault(key, int(value))
    if audio_cfg and audio_cfg.get("patch_sizes"):
        per_token = math.prod(int(p) for p in audio_cfg["patch_sizes"])
        if "samples_per_token" in audio and int(audio["samples_per_token"]) != per_token:
            raise MediaError(f"the feature extractor's samples_per_token={audio['samples_per_token']} differs from the "
                             f"audio tower's {per_token} (product of patch_sizes) in config.json; fix the processor "
                             f"config")
        audio.setdefault("samples_per_token", per_token)


def _sub(config: Any, key: str) -> dict:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    if value is None:
        return {}
    return dict(value) if isinstance(value, Mapping) else dict(vars(value))
