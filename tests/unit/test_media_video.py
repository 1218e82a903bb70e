"""Video through musecore.media equals transformers 5.24 (PyAV reader + MuseGlimmerVideoProcessor).

Which reference is which:
- transformers code, executed: ``video_utils.read_video_pyav`` (imported: decoding, frame count,
  fps, timestamps), ``MuseGlimmerVideoProcessor.sample_frames`` and ``.patchify`` and
  ``smart_resize`` (their source lifted out of ``video_processing_muse_glimmer.py`` with ``ast``,
  since that file imports torchvision), ``MuseSparkProcessor.replace_video_token`` (called on a stub);
- formulas from transformers / torchvision 0.29: the uint8 lanczos resize and the fused normalise.
Test videos are written with PyAV into tmp (lossless PNG-in-MOV for odd sizes, H.264 MP4).
Tolerance: exact; the max difference is printed on failure.
"""

import ast
import functools
import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

av = pytest.importorskip("av", reason="the media extra (av) is not installed")
pytest.importorskip("PIL", reason="the media extra (pillow) is not installed")

from musecore.media import MediaProcessor, Video, VideoSettings, load_video, process_videos  # noqa: E402
from tests.helpers import transformers_function  # noqa: E402

GLIMMER = Path(importlib.util.find_spec("transformers").submodule_search_locations[0]) / "models" / "muse_glimmer"
SOURCE = GLIMMER / "video_processing_muse_glimmer.py"


tf_smart_resize = transformers_function(SOURCE, "smart_resize", logger=logging.getLogger("transformers"))
tf_sample_frames = transformers_function(SOURCE, "sample_frames", "MuseGlimmerVideoProcessor",
                                         logger=logging.getLogger("transformers"))
tf_patchify = transformers_function(SOURCE, "patchify", "MuseGlimmerVideoProcessor",
                                  logger=logging.getLogger("transformers"))
PROCESSOR_DEFAULTS = SimpleNamespace(fps=2.0, num_frames=96)  # MuseGlimmerVideoProcessor class attributes


def write_video(path: Path, frames: int, fps: int, height: int, width: int, codec: str = "png") -> None:
    rng = np.random.default_rng(frames * 1000 + height)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        for _ in range(frames):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


def reference(path: Path):
    """transformers: PyAV read with the processor's sampling, then resize, normalise, patchify."""
    from transformers.video_utils import read_video_pyav
    sample = functools.partial(tf_sample_frames, PROCESSOR_DEFAULTS, temporal_patch_size=2)
    frames, metadata = read_video_pyav(str(path), sample_indices_fn=sample)
    clip = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    height, width = tf_smart_resize(clip.shape[2], clip.shape[3], patch_size=28, max_tokens=144)
    if (height, width) != tuple(clip.shape[2:]):
        clip = F.interpolate(clip, size=[height, width], mode="lanczos", align_corners=False, antialias=True)
    clip = (clip.to(torch.float32) - 127.5) / 127.5
    patches, grid_t, grid_h, grid_w = tf_patchify(None, clip[None], patch_size=14, temporal_patch_size=2)
    return frames, metadata, patches[0], [grid_t, grid_h, grid_w]


@pytest.mark.parametrize("frames,fps,height,width,codec,suffix", [
    (5, 4, 37, 53, "png", "mov"),        # the brief's short odd-size clip: 5 frames at 4 fps
    (30, 10, 120, 90, "libx264", "mp4"),
    (1, 1, 30, 31, "png", "mov"),        # one frame: padded to a temporal pair by repeating it
    (61, 30, 48, 64, "mpeg4", "mp4"),
])
def test_video_frames_timestamps_and_patches_equal_transformers(tmp_path, frames, fps, height, width, codec, suffix):
    path = tmp_path / f"clip.{suffix}"
    write_video(path, frames, fps, height, width, codec)
    want_frames, metadata, want_patches, want_grid = reference(path)
    video = load_video(path)
    assert np.array_equal(video.frames.numpy(), want_frames)
    assert video.fps == metadata.fps and video.frame_indices == list(metadata.frames_indices)
    assert video.timestamps == metadata.timestamps
    got = process_videos([video])
    assert got.grid_thw.tolist() == [want_grid]
    diff = (got.pixel_values - want_patches).abs().max().item()
    assert diff == 0.0, f"max |musecore - transformers| = {diff}"


def test_the_brief_clip_samples_two_frames_and_one_temporal_patch(tmp_path):
    write_video(tmp_path / "clip.mov", 5, 4, 37, 53)
    video = load_video(tmp_path / "clip.mov")
    # 5 frames at 4 fps sampled at 2 fps: int(5 * 2 / 4) = 2 frames, linspace(0, 4, 2) = frames 0 and 4
    assert video.frame_indices == [0, 4] and video.timestamps == [0.0, 1.0]
    inputs = process_videos([video])
    assert inputs.grid_thw.tolist() == [[1, 2, 4]] and inputs.pixel_values.shape == (8, 1176)
    assert inputs.group_timestamps(0) == [0.0] and inputs.num_tokens(0) == 2


@pytest.mark.parametrize("total,video_fps", [(1, 24.0), (2, 24.0), (5, 4.0), (7, 25.0), (100, 30.0), (1000, 24.0),
                                             (10000, 60.0), (3, 0.5), (97, 2.0), (250, 2.0)])
def test_frame_sampling_equals_transformers(total, video_fps):
    from transformers.video_utils import VideoMetadata
    from musecore.media import sample_frame_indices
    want = tf_sample_frames(PROCESSOR_DEFAULTS, VideoMetadata(total_num_frames=total, fps=video_fps),
                            temporal_patch_size=2).tolist()
    assert sample_frame_indices(total, video_fps) == want


def test_frames_in_memory_sample_at_24_fps_as_transformers_assumes():
    from transformers.video_utils import VideoMetadata
    frames = torch.randint(0, 256, (50, 30, 40, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    video = load_video(frames)
    metadata = VideoMetadata(total_num_frames=50, fps=None)
    indices = tf_sample_frames(PROCESSOR_DEFAULTS, metadata, temporal_patch_size=2)
    metadata.frames_indices = indices
    assert video.fps == 24.0 and video.frame_indices == indices.tolist()
    assert video.timestamps == metadata.timestamps and torch.equal(video.frames, frames[indices])
    as_list = load_video([f.numpy() for f in frames], video_fps=10)   # 5 s at 2 fps: 10 frames
    assert as_list.fps == 10.0 and as_list.frame_indices == torch.linspace(0, 49, 10).long().tolist()


def test_video_placeholder_equals_transformers_replace_video_token(tmp_path):
    from transformers.models.muse_spark.processing_muse_spark import MuseSparkProcessor
    write_video(tmp_path / "clip.mp4", 30, 10, 120, 90, "libx264")
    _, metadata, _, _ = reference(tmp_path / "clip.mp4")
    processor = MediaProcessor()
    inputs = processor.videos([processor.load_video(tmp_path / "clip.mp4")])
    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2,
                                                           frame_timestamp_format="Time: {timestamp:.1f}s"),
                           **{k: v for k, v in processor.tokens.items() if k.startswith("video")})
    want = MuseSparkProcessor.replace_video_token(stub, {"video_grid_thw": inputs.grid_thw,
                                                         "video_metadata": [metadata]}, 0)
    got = processor.placeholder("video", inputs, 0)
    assert got == want
    assert got.startswith("<|vid_start|>Time: 0.0s<|video|>") and got.endswith("<|vid_end|>")
    assert got.count("<|vid_frame_separator|>") == 2 and got.count("<|video|>") == inputs.num_tokens(0) == 36


def test_a_batch_of_videos_of_different_sizes_is_one_after_another(tmp_path):
    write_video(tmp_path / "a.mov", 5, 4, 37, 53)
    write_video(tmp_path / "b.mov", 9, 6, 64, 40)
    a, b = load_video(tmp_path / "a.mov"), load_video(tmp_path / "b.mov")
    both = process_videos([a, b])
    single = [process_videos([a]), process_videos([b])]
    assert torch.equal(both.pixel_values, torch.cat([s.pixel_values for s in single]))
    assert torch.equal(both.patches(1), single[1].pixel_values)
    assert both.timestamps == [a.timestamps, b.timestamps]


def test_webm_without_a_frame_count_is_counted_by_decoding(tmp_path):
    """Matroska/WebM headers do not record the frame count (transformers' PyAV reader then fails on an
    empty index list); musecore counts the frames by decoding once."""
    path = tmp_path / "clip.mkv"
    write_video(path, 7, 25, 32, 48, "ffv1")
    video = load_video(path)
    assert video.total_frames == 7 and video.fps == 25.0
    assert video.frame_indices == [0, 6] and video.timestamps == [0.0, 0.24]


def test_settings_change_sampling():
    frames = torch.zeros((40, 28, 28, 3), dtype=torch.uint8)
    assert len(load_video(frames, video_fps=4, fps=4).frame_indices) == 40
    assert len(load_video(frames, video_fps=4, fps=4, num_frames=9).frame_indices) == 8
    assert len(load_video(frames, settings=VideoSettings(do_sample_frames=False)).frame_indices) == 40
    assert isinstance(load_video(frames), Video)


def test_patches_equal_the_real_transformers_video_processor_where_torchvision_loads(tmp_path):
    """The full transformers class, run where torchvision >= 0.27 loads beside torch (skipped otherwise, with the
    reason). Checked once by hand on torchvision 0.29.1: frames, timestamps and pixel values all exact."""
    try:
        from transformers.models.muse_glimmer.video_processing_muse_glimmer import MuseGlimmerVideoProcessor
        reference_processor = MuseGlimmerVideoProcessor()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"transformers' torchvision video processor does not load here ({type(exc).__name__})")
    from transformers.video_utils import read_video_pyav
    write_video(tmp_path / "clip.mp4", 30, 10, 120, 90, "libx264")
    sample = functools.partial(reference_processor.sample_frames, temporal_patch_size=2)
    frames, metadata = read_video_pyav(str(tmp_path / "clip.mp4"), sample_indices_fn=sample)
    want = reference_processor(torch.from_numpy(frames), video_metadata=metadata, do_sample_frames=False,
                               return_tensors="pt")
    got = process_videos([load_video(tmp_path / "clip.mp4")])
    assert torch.equal(got.grid_thw, want["video_grid_thw"])
    diff = (got.pixel_values - want["pixel_values_videos"]).abs().max().item()
    assert diff == 0.0, f"max |musecore - transformers| = {diff}"


def test_defaults_match_the_transformers_video_processor_class():
    tree = ast.parse(SOURCE.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MuseGlimmerVideoProcessor").body
    found = {n.targets[0].id: ast.unparse(n.value) for n in body
             if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    ours = VideoSettings()
    for key in ("patch_size", "temporal_patch_size", "merge_size", "max_video_frame_tokens", "num_frames", "fps",
                "do_sample_frames", "frame_timestamp_format", "do_resize", "do_rescale", "do_normalize"):
        assert getattr(ours, key) == ast.literal_eval(found[key]), key
    assert found["resample"] == "PILImageResampling.LANCZOS" and ours.resample == 1
    assert found["image_mean"] == "IMAGENET_STANDARD_MEAN" and found["image_std"] == "IMAGENET_STANDARD_STD"
