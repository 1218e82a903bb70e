"""Video in, sampled frames with timestamps and vision-tower patches out (transformers 5.24
``MuseGlimmerVideoProcessor`` with its PyAV reader, in plain torch).

Frames are sampled as transformers samples them: ``fps`` (2) frames per second of the source, at
most ``num_frames`` (96), a multiple of the temporal patch (2), spread by ``torch.linspace`` over
the whole clip; each kept frame's timestamp is its index / the stream's average frame rate.
Each frame is resized to at most ``max_video_frame_tokens`` (144) cells of 28 x 28 pixels, the
frame count is padded to a multiple of 2 by repeating the last frame, and every pair of frames is
one temporal patch: ``pixel_values [t*h*w, 1176]``, ``grid_thw = (frames / 2, h / 14, w / 14)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
import torch

from .errors import MediaError, require
from .image import (MAX_PIXELS, PatchSettings, as_tensor, load_image, rescale_and_normalize, resize_uint8,
                    smart_resize)
from .sources import describe, is_source, resolve, subject

DEFAULT_FPS = 24.0  # what transformers assumes for frames given without a frame rate


@dataclass(frozen=True)
class VideoSettings(PatchSettings):
    """The video processor's settings (``video_preprocessor_config.json``), transformers' defaults."""

    KIND: ClassVar[str] = "video"
    max_video_frame_tokens: int = 144
    num_frames: int = 96
    fps: float = 2.0
    do_sample_frames: bool = True
    frame_timestamp_format: str = "Time: {timestamp:.1f}s"

    def __post_init__(self) -> None:
        self.check("max_video_frame_tokens", "num_frames")
        try:
            self.frame_timestamp_format.format(timestamp=0.0)
        except (KeyError, IndexError, ValueError) as exc:
            raise MediaError(f"video processor setting frame_timestamp_format={self.frame_timestamp_format!r} does "
                             f"not format a {{timestamp}} ({exc}); use e.g. 'Time: {{timestamp:.1f}}s'") from None


@dataclass
class Video:
    """Decoded, sampled frames: ``frames`` uint8 ``[F, H, W, 3]``, the source ``fps``, and the
    ``timestamps`` (seconds) of the sampled frames, ``frame_indices`` into the source's frames."""

    frames: torch.Tensor
    fps: float
    timestamps: list
    frame_indices: list = field(default_factory=list)
    total_frames: int = 0


@dataclass
class VideoInputs:
    """Processed videos: ``pixel_values [P, 1176]`` float32, ``grid_thw [n, 3]`` int64, and per video
    the ``timestamps`` of its sampled frames (the placeholder uses one per temporal patch)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    timestamps: list
    merge_size: int = 2
    temporal_patch_size: int = 2

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    def tokens_per_frame_group(self, index: int) -> int:
        """Placeholder tokens per temporal patch of video ``index``: h*w / merge**2."""
        return int(self.grid_thw[index, 1:].prod()) // self.merge_size ** 2

    def num_tokens(self, index: int) -> int:
        """All placeholder tokens of video ``index``: t * h * w / merge**2."""
        return int(self.grid_thw[index, 0]) * self.tokens_per_frame_group(index)

    def group_timestamps(self, index: int) -> list:
        """One timestamp per temporal patch (every 2nd frame's), padded with the last, as transformers."""
        groups = int(self.grid_thw[index, 0])
        stamps = list(self.timestamps[index][::self.temporal_patch_size])[:groups]
        while len(stamps) < groups:
            stamps.append(stamps[-1] if stamps else 0.0)
        return stamps

    def patches(self, index: int) -> torch.Tensor:
        """The rows of ``pixel_values`` that belong to video ``index``."""
        counts = self.grid_thw.prod(dim=1).tolist()
        start = sum(counts[:index])
        return self.pixel_values[start:start + counts[index]]


def sample_frame_indices(total_frames: int, video_fps: float, settings: VideoSettings = VideoSettings(),
                         fps: Optional[float] = None, num_frames: Optional[int] = None) -> list:
    """Indices of the frames to keep (transformers' ``MuseGlimmerVideoProcessor.sample_frames``)."""
    fps = settings.fps if fps is None else fps
    num_frames = settings.num_frames if num_frames is None else num_frames
    step = settings.temporal_patch_size
    count = min(int(total_frames * fps / video_fps), num_frames, total_frames)
    count = max(step, (count // step) * step)
    count = min(count, total_frames)
    return torch.linspace(0, total_frames - 1, count).long().tolist()


def load_video(src: Any, *, name: Optional[str] = None, settings: VideoSettings = VideoSettings(),
               fps: Optional[float] = None, num_frames: Optional[int] = None, video_fps: Optional[float] = None,
               max_pixels: int = MAX_PIXELS) -> Video:
    """Decode a video and keep the frames transformers would sample, with their timestamps.

    ``src``: a path, bytes or ``data:video/...;base64,`` URL (decoded with PyAV), or frames: a uint8
    array / tensor ``[F, H, W, 3]`` or a list of images, at ``video_fps`` frames per second
    (transformers assumes 24 when it is not given). ``fps`` / ``num_frames`` override the sampling
    rate (2 per second) and cap (96); ``settings.do_sample_frames=False`` keeps every frame.

    Example::

        video = load_video("clip.mp4")
        video.frames.shape, video.timestamps      # [F, H, W, 3], [0.0, 0.5, 1.0, ...]
    """
    if is_source(src):
        return _decode(resolve(src, "video", name), settings, fps, num_frames, max_pixels)
    label = subject("video", describe(src, name) if name else "frames")
    frames = _frames_tensor(src, label, max_pixels)
    rate = float(video_fps) if video_fps else DEFAULT_FPS
    total = int(frames.shape[0])
    indices = sample_frame_indices(total, rate, settings, fps, num_frames) if settings.do_sample_frames \
        else list(range(total))
    return Video(frames[indices], rate, [i / rate for i in indices], indices, total)


def process_videos(videos: Sequence[Video], settings: VideoSettings = VideoSettings()) -> VideoInputs:
    """Sampled videos -> :class:`VideoInputs` (resize, normalise, 2-frame patches), as transformers."""
    rows, grids, stamps = [], [], []
    p, t = settings.patch_size, settings.temporal_patch_size
    for index, video in enumerate(videos):
        label = f"video #{index + 1}"
        if not isinstance(video, Video):
            raise MediaError(f"{label} is a {type(video).__name__}; pass musecore.media.Video objects "
                             f"(load_video returns them)")
        frames = video.frames
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8 or frames.shape[0] == 0:
            raise MediaError(f"{label} has frames of shape {tuple(frames.shape)} and dtype {frames.dtype}; "
                             f"expected uint8 [frames >= 1, height, width, 3]")
        clip = frames.permute(0, 3, 1, 2).contiguous()                              # [F, 3, H, W]
        if settings.do_resize:
            height, width = smart_resize(clip.shape[2], clip.shape[3], p * settings.merge_size,
                                         settings.max_video_frame_tokens)
            clip = resize_uint8(clip, height, width, settings.resample)
        clip = rescale_and_normalize(clip, settings)                                 # float32
        if pad := -clip.shape[0] % t:
            clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
        count, channels, height, width = clip.shape
        if height % p or width % p:
            raise MediaError(f"{label} frames are {width}x{height}, not a multiple of the {p}-pixel patch; turn "
                             f"do_resize on")
        grid_t, grid_h, grid_w = count // t, height // p, width // p
        patches = clip.reshape(grid_t, t, channels, grid_h, p, grid_w, p).permute(0, 3, 5, 1, 2, 4, 6)
        rows.append(patches.reshape(grid_t * grid_h * grid_w, t * channels * p * p))
        grids.append([grid_t, grid_h, grid_w])
        stamps.append([float(s) for s in video.timestamps])
    pixel_values = torch.cat(rows) if rows else torch.zeros(0, t * 3 * p * p)
    grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return VideoInputs(pixel_values, grid_thw, stamps, settings.merge_size, t)


def _frames_tensor(src: Any, label: str, max_pixels: int) -> torch.Tensor:
    """Frames given in memory -> uint8 ``[F, H, W, 3]``."""
    if isinstance(src, (list, tuple)):
        if not src:
            raise MediaError(f"{label} is an empty list; pass at least one frame")
        images = [np.asarray(load_image(frame, name=f"{label} frame #{i + 1}", max_pixels=max_pixels))
                  for i, frame in enumerate(src)]
        if len({im.shape for im in images}) > 1:
            raise MediaError(f"{label}: frames have different sizes {sorted({im.shape[:2] for im in images})}; "
                             f"pass frames of one size")
        return torch.from_numpy(np.stack(images))
    if isinstance(src, (np.ndarray, torch.Tensor)):
        frames = src.detach().cpu() if isinstance(src, torch.Tensor) else as_tensor(src)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
            raise MediaError(f"{label} has shape {tuple(frames.shape)} and dtype {frames.dtype}; pass uint8 "
                             f"[frames, height, width, 3] (RGB, channels last)")
        if frames.shape[0] == 0:
            raise MediaError(f"{label} has no frames; pass at least one frame")
        _check_frame_budget(int(frames.shape[2]), int(frames.shape[1]), label, max_pixels)
        return frames
    raise MediaError(f"{label}: expected a path, bytes, data: URL, uint8 [F, H, W, 3] array or a list of frames, "
                     f"got {type(src).__name__}")


def _decode(resolved, settings: VideoSettings, fps: Optional[float], num_frames: Optional[int],
            max_pixels: int) -> Video:
    """PyAV decode with transformers' ``read_video_pyav`` metadata: frame count and average rate."""
    av = require("av")
    label = resolved.name
    try:
        with av.open(resolved.file()) as container:
            if not container.streams.video:
                raise MediaError(f"{label} has no video stream; pass a video file (MP4, WebM, MKV, AVI, MOV)")
            stream = container.streams.video[0]
            _check_frame_budget(stream.codec_context.width, stream.codec_context.height, label, max_pixels)
            rate = float(stream.average_rate) if stream.average_rate else 0.0
            total = int(stream.frames)
            if total <= 0 or rate <= 0:
                # the container does not record them (e.g. WebM): count by decoding, as the header would say
                total, rate = _count_frames(container, stream, rate, label)
                container.seek(0)
            indices = sample_frame_indices(total, rate, settings, fps, num_frames) if settings.do_sample_frames \
                else list(range(total))
            wanted, last = set(indices), indices[-1]
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if i > last:
                    break
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError) as exc:
        raise MediaError(f"{label} cannot be decoded: {_reason(exc)}; it is corrupt or an unsupported "
                         f"codec/container: re-encode it as H.264 MP4 (ffmpeg -i in -c:v libx264 out.mp4)") from None
    if not frames:
        raise MediaError(f"{label} has no decodable frames; re-encode it as H.264 MP4")
    return Video(torch.from_numpy(np.stack(frames)), rate, [i / rate for i in indices], indices, total)


def _count_frames(container, stream, rate: float, label: str) -> tuple[int, float]:
    count, first, last = 0, None, None
    for frame in container.decode(stream):
        count += 1
        if frame.time is not None:
            first = frame.time if first is None else first
            last = frame.time
    if count == 0:
        raise MediaError(f"{label} has no frames; pass a non-empty video")
    if rate <= 0:  # no average rate either: frames over the time they span, else transformers' 24
        spans = count > 1 and first is not None and last is not None and last > first
        rate = (count - 1) / (last - first) if spans else DEFAULT_FPS
    return count, rate


def _check_frame_budget(width: int, height: int, label: str, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise MediaError(f"{label} has {width}x{height} frames ({width * height:,} pixels), above the pixel budget "
                         f"of {max_pixels:,} pixels; downscale it first (or pass a larger max_pixels)")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
