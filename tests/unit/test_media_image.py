"""Images through musecore.media equal transformers 5.24's MuseGlimmerImageProcessor, bit for bit.

transformers' image processor is a torchvision class and torchvision does not load beside the CPU
torch here, so the reference is assembled from transformers' own code where it runs without
torchvision, and from the torchvision calls it makes otherwise:
- transformers code, executed: ``smart_resize`` and ``patchify`` (their source, lifted out of
  ``image_processing_muse_glimmer.py`` with ``ast`` and run as is), ``image_transforms.convert_to_rgb``
  (imported), the class defaults (read from the class body);
- formulas from the transformers / torchvision 0.29 code: the resize is ``tvF.resize`` ->
  ``F.interpolate(uint8, mode="lanczos", antialias=True)`` on CPU, and rescale + normalise is the
  fused ``(x - mean/rescale) / (std/rescale)`` in float32.
Tolerance: exact (0.0); the measured max difference is printed on failure.
"""

import ast
import base64
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("PIL", reason="the media extra (pillow) is not installed")
from PIL import Image  # noqa: E402

from musecore.media import ImageSettings, MediaError, load_image, process_images, smart_resize  # noqa: E402
from tests.helpers import transformers_function  # noqa: E402

GLIMMER = Path(importlib.util.find_spec("transformers").submodule_search_locations[0]) / "models" / "muse_glimmer"


def class_defaults(path: Path, cls: str) -> dict:
    """Class-body constants (``name = literal``) of a transformers class."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<default>", "eval"), {})
            except NameError:
                out[node.targets[0].id] = ast.unparse(node.value)
    return out


tf_smart_resize = transformers_function(GLIMMER / "image_processing_muse_glimmer.py", "smart_resize")
tf_patchify = transformers_function(GLIMMER / "image_processing_muse_glimmer.py", "patchify",
                                    "MuseGlimmerImageProcessor")


def reference_pixel_values(image) -> tuple[torch.Tensor, list]:
    """transformers' pipeline for one PIL image (see the module docstring for which step is which)."""
    from transformers.image_transforms import convert_to_rgb
    chw = torch.from_numpy(convert_to_rgb(image, return_numpy=True)).permute(2, 0, 1).contiguous()[None]
    height, width = tf_smart_resize(chw.shape[2], chw.shape[3], patch_size=28, max_tokens=4096)
    if (height, width) != tuple(chw.shape[2:]):
        chw = F.interpolate(chw, size=[height, width], mode="lanczos", align_corners=False, antialias=True)
    mean = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    pixels = chw.to(torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    patches, grid_h, grid_w = tf_patchify(None, pixels, patch_size=14, temporal_patch_size=2)
    return patches[0], [1, grid_h, grid_w]


def random_image(height: int, width: int, mode: str = "RGB", seed: int = 0):
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def test_defaults_match_the_transformers_image_processor_class():
    found = class_defaults(GLIMMER / "image_processing_muse_glimmer.py", "MuseGlimmerImageProcessor")
    ours = ImageSettings()
    for key in ("do_resize", "do_rescale", "rescale_factor", "do_normalize", "patch_size", "temporal_patch_size",
                "merge_size", "max_image_tokens"):
        assert getattr(ours, key) == found[key], key
    assert found["resample"] == "PILImageResampling.LANCZOS" and ours.resample == 1
    from transformers.utils.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    assert found["image_mean"] == "IMAGENET_STANDARD_MEAN" and ours.image_mean == tuple(IMAGENET_STANDARD_MEAN)
    assert found["image_std"] == "IMAGENET_STANDARD_STD" and ours.image_std == tuple(IMAGENET_STANDARD_STD)


@pytest.mark.parametrize("max_tokens", [144, 4096])
def test_smart_resize_matches_transformers_for_many_sizes(max_tokens):
    sizes = [(1, 1), (37, 91), (333, 500), (500, 333), (28, 28), (27, 29), (1, 5000), (5000, 1), (3000, 2000),
             (1792, 1792), (1793, 1791), (7, 1000), (448, 1344), (896, 1344), (100, 4000), (8192, 8192)]
    sizes += [(h, w) for h in range(1, 400, 37) for w in range(1, 400, 41)]
    for height, width in sizes:
        assert smart_resize(height, width, 28, max_tokens) == tf_smart_resize(height, width, 28, max_tokens), \
            (height, width)


@pytest.mark.parametrize("height,width,mode", [(37, 91, "RGB"), (333, 500, "RGB"), (45, 70, "L"), (60, 33, "RGBA"),
                                               (50, 50, "LA"), (1, 1, "RGB"), (900, 20, "RGB"), (56, 84, "RGB")])
def test_pixel_values_equal_transformers(height, width, mode):
    image = random_image(height, width, mode, seed=height * width)
    expected, grid = reference_pixel_values(image)
    got = process_images([load_image(image)])
    assert got.grid_thw.tolist() == [grid]
    assert got.pixel_values.dtype == torch.float32 and got.pixel_values.shape == expected.shape
    diff = (got.pixel_values - expected).abs().max().item()
    assert diff == 0.0, f"max |musecore - transformers| = {diff} for a {width}x{height} {mode} image"


def test_palette_image_with_transparency_is_composited_on_white_like_transformers():
    image = random_image(40, 40).convert("P")
    image.info["transparency"] = 0
    expected, _ = reference_pixel_values(image)
    diff = (process_images([load_image(image)]).pixel_values - expected).abs().max().item()
    assert diff == 0.0, f"max diff {diff}"


def test_a_batch_is_the_images_one_after_another():
    images = [random_image(37, 91, seed=1), random_image(333, 500, seed=2), random_image(45, 70, "L", seed=3),
              random_image(37, 91, seed=4)]
    batch = process_images([load_image(im) for im in images])
    refs = [reference_pixel_values(im) for im in images]
    assert batch.grid_thw.tolist() == [grid for _, grid in refs]
    diff = (batch.pixel_values - torch.cat([p for p, _ in refs])).abs().max().item()
    assert diff == 0.0, f"max diff {diff}"
    for i, (patches, _) in enumerate(refs):
        assert torch.equal(batch.patches(i), patches)
        assert batch.num_tokens(i) == patches.shape[0] // 4


def test_each_row_is_one_14x14_patch_in_raster_order_repeated_over_two_frames():
    image = random_image(37, 91, seed=5)
    got = process_images([image])
    _, grid_h, grid_w = got.grid_thw[0].tolist()
    resized = F.interpolate(torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].contiguous(),
                            size=[grid_h * 14, grid_w * 14], mode="lanczos", antialias=True)[0]
    normalized = (resized.float() - 127.5) / 127.5
    for row in (0, 1, grid_w, got.pixel_values.shape[0] - 1):
        patch = got.pixel_values[row].view(2, 3, 14, 14)
        y, x = divmod(row, grid_w)
        assert torch.equal(patch[0], patch[1])
        assert torch.equal(patch[0], normalized[:, y * 14:(y + 1) * 14, x * 14:(x + 1) * 14])


def test_arrays_convert_like_transformers_tensor_path():
    """uint8 arrays go through transformers' torchvision path: gray repeated, alpha blended on white in float32
    (formula from TorchvisionBackend.convert_to_rgb with torchvision 0.29's to_dtype)."""
    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (31, 47, 4), dtype=np.uint8)
    x = torch.from_numpy(rgba).to(torch.float32).mul_(1.0 / 255)
    blended = (x[..., :3] * x[..., 3:] + (1 - x[..., 3:])).mul(255 + 1.0 - 1e-3).to(torch.uint8)
    assert np.array_equal(np.asarray(load_image(rgba)), blended.numpy())
    assert np.array_equal(np.asarray(load_image(torch.from_numpy(rgba))), blended.numpy())
    gray = rng.integers(0, 256, (31, 47), dtype=np.uint8)
    assert np.array_equal(np.asarray(load_image(gray)), np.repeat(gray[..., None], 3, axis=-1))
    assert np.array_equal(np.asarray(load_image(gray[..., None])), np.repeat(gray[..., None], 3, axis=-1))


def test_every_source_form_gives_the_same_image(tmp_path):
    image = random_image(29, 31, seed=9)
    path = tmp_path / "x.png"
    image.save(path)
    data = path.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    want = np.asarray(image)
    for src in (str(path), path, data, bytearray(data), url, f"file://{path}", image, want,
                torch.from_numpy(want.copy())):
        got = load_image(src)
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), want), type(src)


def test_exif_orientation_is_applied_to_files_as_transformers_load_image_does(tmp_path):
    image = random_image(20, 40, seed=11)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif)
    loaded = load_image(buffer.getvalue())
    from transformers.image_utils import load_image as tf_load_image
    path = tmp_path / "rotated.png"
    path.write_bytes(buffer.getvalue())
    assert loaded.size == (20, 40)
    assert np.array_equal(np.asarray(loaded), np.asarray(tf_load_image(str(path))))


def test_files_with_transparency_are_read_as_transformers_load_image_reads_them(tmp_path):
    """transformers' load_image (the loader for paths) converts files with convert("RGB"), dropping alpha;
    only images handed over in memory are composited on white by the processor."""
    from transformers.image_utils import load_image as tf_load_image
    for mode in ("RGBA", "LA"):
        image = random_image(23, 17, mode, seed=13)
        image.save(tmp_path / f"{mode}.png")
        want = np.asarray(tf_load_image(str(tmp_path / f"{mode}.png")))
        assert np.array_equal(np.asarray(load_image(tmp_path / f"{mode}.png")), want), mode
        assert np.array_equal(np.asarray(load_image((tmp_path / f"{mode}.png").read_bytes())), want), mode
    palette = random_image(20, 20).convert("P")
    palette.save(tmp_path / "p.png", transparency=0)
    assert np.array_equal(np.asarray(load_image(tmp_path / "p.png")),
                          np.asarray(tf_load_image(str(tmp_path / "p.png"))))


def test_images_outside_the_pixel_budget_are_refused_with_both_sizes():
    with pytest.raises(MediaError, match=r"image #1 is 300x200 \(60,000 pixels\), above the pixel budget of "
                                         r"50,000 pixels; downscale it first"):
        load_image(np.zeros((200, 300, 3), np.uint8), name="image #1", max_pixels=50_000)


def test_pixel_values_equal_the_real_transformers_processor_where_torchvision_loads():
    """The full transformers class, run where torchvision >= 0.27 loads beside torch (not on the CPU-torch CI
    machine: skipped there with the reason). Checked once by hand on torchvision 0.29.1: all exact."""
    try:
        from transformers.models.muse_glimmer.image_processing_muse_glimmer import MuseGlimmerImageProcessor
        reference_processor = MuseGlimmerImageProcessor()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"transformers' torchvision image processor does not load here ({type(exc).__name__})")
    images = [random_image(37, 91, seed=1), random_image(333, 500, seed=2), random_image(45, 70, "L", seed=3),
              random_image(60, 33, "RGBA", seed=4)]
    want = reference_processor(images, return_tensors="pt")
    got = process_images([load_image(im) for im in images])
    assert torch.equal(got.grid_thw, want["image_grid_thw"])
    diff = (got.pixel_values - want["pixel_values"]).abs().max().item()
    assert diff == 0.0, f"max |musecore - transformers| = {diff}"
