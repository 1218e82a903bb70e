"""Images in, vision-tower patches out: the transformers 5.24 ``MuseGlimmerImageProcessor`` in plain torch.

transformers' processor is a torchvision class; torchvision does not load beside the CPU torch
here, so this module does the same steps with the same torch calls, to the bit:

1. RGB, as transformers makes it: a file is read as ``image_utils.load_image`` reads it (EXIF
   orientation, ``convert("RGB")``); a PIL image with transparency is composited on white; a uint8
   array with an alpha channel is blended on white in float32 (torchvision's ``to_dtype`` rules).
2. ``smart_resize``: the integer grid of 28-pixel cells (patch 14 x merge 2) closest to the
   image's aspect ratio with at most ``max_image_tokens`` (4096) cells, then a resize of the uint8
   image to it with ``F.interpolate(mode="lanczos", antialias=True)``, which is what torchvision
   >= 0.27 calls for ``InterpolationMode.LANCZOS`` on CPU (bitwise equal to Pillow-SIMD).
3. Rescale and normalise fused as transformers fuses them: ``(x - 0.5*255) / (0.5*255)`` in float32.
4. Patches in raster order, each row ``[t=2, c=3, 14, 14]`` with the single image repeated over
   the two temporal slots: ``pixel_values [P, 1176]`` and ``grid_thw [n, 3] = (1, h/14, w/14)``.
"""

from __future__ import annotations

import itertools
import math
import platform
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .errors import MediaError, require
from .sources import describe, is_source, resolve, subject

# The largest image decoded, in pixels: 8192 x 8192 RGB is 192 MiB as uint8. Larger inputs are
# refused before decoding (they would be shrunk to at most 4096 cells of 28 x 28 pixels anyway).
MAX_PIXELS = 8192 * 8192

# transformers.utils.constants.IMAGENET_STANDARD_MEAN / _STD
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

# PIL resample ids (PILImageResampling) -> interpolate modes torchvision uses for them
_RESAMPLE = {0: "nearest-exact", 1: "lanczos", 2: "bilinear", 3: "bicubic"}


@dataclass(frozen=True)
class PatchSettings:
    """What the image and video processors share (patching, resizing, normalisation), transformers' defaults."""

    KIND: ClassVar[str] = "image"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    do_resize: bool = True
    resample: int = 1  # PIL LANCZOS
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple = IMAGENET_STANDARD_MEAN
    image_std: tuple = IMAGENET_STANDARD_STD

    def check(self, *counts: str) -> None:
        """A one-line MediaError for an unsupported resample or a non-positive size among ``counts``."""
        if self.resample not in _RESAMPLE:
            names = ", ".join(f"{k} ({v})" for k, v in _RESAMPLE.items())
            raise MediaError(f"{self.KIND} processor setting resample={self.resample} is not supported; use one of "
                             f"{names}")
        for key in ("patch_size", "temporal_patch_size", "merge_size", *counts):
            if int(getattr(self, key)) < 1:
                raise MediaError(f"{self.KIND} processor setting {key}={getattr(self, key)} must be a positive integer")


@dataclass(frozen=True)
class ImageSettings(PatchSettings):
    """The image processor's settings (``preprocessor_config.json``), transformers' defaults."""

    max_image_tokens: int = 4096

    def __post_init__(self) -> None:
        self.check("max_image_tokens")

    @property
    def patch_dim(self) -> int:
        """Values per row of ``pixel_values``: 2 * 3 * 14 * 14 = 1176."""
        return self.temporal_patch_size * 3 * self.patch_size * self.patch_size


@dataclass
class ImageInputs:
    """Processed images: ``pixel_values [P, 1176]`` float32 (all images' patches, in order) and
    ``grid_thw [n, 3]`` int64 (temporal, height, width patches of each image)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    merge_size: int = 2
    sizes: list = field(default_factory=list)  # (height, width) of each image after resizing

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    def num_tokens(self, index: int) -> int:
        """Placeholder tokens (merged patches) of image ``index``: t*h*w / merge**2."""
        return int(self.grid_thw[index].prod()) // self.merge_size ** 2

    def patches(self, index: int) -> torch.Tensor:
        """The rows of ``pixel_values`` that belong to image ``index``."""
        counts = self.grid_thw.prod(dim=1).tolist()
        start = sum(counts[:index])
        return self.pixel_values[start:start + counts[index]]


def smart_resize(height: int, width: int, patch_size: int, max_tokens: int) -> tuple[int, int]:
    """The resize target (height, width): a grid of ``patch_size`` cells closest to the image's aspect
    ratio with at most ``max_tokens`` cells (transformers' ``muse_glimmer.smart_resize``)."""
    ideal_h = height / patch_size
    ideal_w = width / patch_size
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > max_tokens:
        ideal_h = (max_tokens / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    candidates = set(itertools.product([math.floor(ideal_h), math.ceil(ideal_h)],
                                       [math.floor(ideal_w), math.ceil(ideal_w)]))
    candidates = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= max_tokens]
    if not candidates:
        candidates = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    # transformers takes min() over an unordered set: on a tie the winner is the set's iteration order;
    # iterating a set of the same int tuples built the same way gives the same order here
    grid_h, grid_w = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return grid_h * patch_size, grid_w * patch_size


def load_image(src: Any, *, name: Optional[str] = None, max_pixels: int = MAX_PIXELS):
    """Any supported image input -> an RGB ``PIL.Image.Image``, converted as transformers converts it.

    ``src``: a path (str / Path), bytes, a ``data:image/...;base64,`` URL, a PIL image, or a uint8
    array / tensor ``[H, W]`` or ``[H, W, 1|3|4]``. Files are read as transformers' ``load_image``
    reads them (EXIF orientation applied, ``convert("RGB")``, so an alpha channel is dropped);
    in-memory images are converted as its processor converts them (transparency over white).

    Example::

        image = load_image("photo.jpg")          # PIL.Image.Image, mode "RGB"
        image = load_image(np.zeros((37, 91, 3), np.uint8))
    """
    Image = require("PIL.Image")
    label = subject("image", describe(src, name) if is_source(src) or name else
                    "array" if isinstance(src, (np.ndarray, torch.Tensor)) else "input")
    if isinstance(src, Image.Image):
        _check_budget(src.width, src.height, label, max_pixels)
        return _pil_to_rgb(src, label)
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return _array_to_rgb(src, label, max_pixels)
    if not is_source(src):
        raise MediaError(f"{label}: expected a path, bytes, data: URL, PIL image or uint8 array, "
                         f"got {type(src).__name__}")
    resolved = resolve(src, "image", name)
    label = resolved.name
    ImageOps = require("PIL.ImageOps")
    try:
        image = Image.open(resolved.file())
    except Image.UnidentifiedImageError:
        raise MediaError(f"{label} is not an image Pillow recognises (corrupt, or another kind of file); pass a "
                         f"PNG, JPEG, WebP, GIF, BMP or TIFF file") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaError(f"{label} cannot be decoded: {_reason(exc)}; pass a PNG, JPEG, WebP, GIF, BMP "
                         f"or TIFF file") from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"{label} is above the pixel budget of {max_pixels:,} pixels ({_reason(exc)}); downscale "
                         f"it first") from None
    with image:
        _check_budget(image.width, image.height, label, max_pixels)
        try:
            image.load()
            image = ImageOps.exif_transpose(image)
            # transformers' image_utils.load_image: upright, then convert("RGB"), which drops alpha
            return image.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
            raise MediaError(f"{label} is corrupt or truncated: {_reason(exc)}; re-export or re-download "
                             f"it") from None


def process_images(images: Sequence[Any], settings: ImageSettings = ImageSettings()) -> ImageInputs:
    """RGB PIL images (or anything :func:`load_image` takes) -> :class:`ImageInputs`, as transformers.

    Example::

        inputs = process_images([load_image("cat.png")])
        inputs.pixel_values.shape    # [P, 1176]
    """
    rows, grids, sizes = [], [], []
    for index, image in enumerate(images):
        pil = load_image(image, name=f"image #{index + 1}") if not _is_rgb_pil(image) else image
        chw = torch.from_numpy(np.asarray(pil, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
        if settings.do_resize:
            factor = settings.patch_size * settings.merge_size
            height, width = smart_resize(chw.shape[1], chw.shape[2], factor, settings.max_image_tokens)
            chw = resize_uint8(chw[None], height, width, settings.resample)[0]
        pixels = rescale_and_normalize(chw[None], settings)                     # [1, 3, H, W] float32
        patches, grid_h, grid_w = patchify_image(pixels, settings, f"image #{index + 1}")
        rows.append(patches[0])
        grids.append([1, grid_h, grid_w])
        sizes.append((int(chw.shape[1]), int(chw.shape[2])))
    pixel_values = torch.cat(rows) if rows else torch.zeros(0, settings.patch_dim)
    grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return ImageInputs(pixel_values, grid_thw, settings.merge_size, sizes)


def resize_uint8(images: torch.Tensor, height: int, width: int, resample: int = 1) -> torch.Tensor:
    """Resize uint8 ``[B, C, H, W]`` as torchvision 0.29 ``resize_image`` does on CPU with antialias=True.

    Lanczos, bicubic and nearest run natively on uint8; bilinear does only on AVX2/AVX512/arm64 CPUs,
    elsewhere it goes through float32 and is rounded back, exactly as torchvision decides.
    """
    if tuple(images.shape[-2:]) == (height, width):
        return images
    mode = _RESAMPLE[resample]
    native = mode != "bilinear" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
        or platform.machine() in ("aarch64", "arm64")
    kwargs = {} if mode == "nearest-exact" else {"align_corners": False, "antialias": True}
    if native:
        return F.interpolate(images, size=[height, width], mode=mode, **kwargs)
    out = F.interpolate(images.to(torch.float32), size=[height, width], mode=mode, **kwargs)
    return out.round_().to(torch.uint8)


def rescale_and_normalize(images: torch.Tensor, settings: Any) -> torch.Tensor:
    """uint8 -> float32 ``(x - mean/scale) / (std/scale)``: transformers' fused rescale + normalise."""
    if settings.do_rescale and settings.do_normalize:
        mean = torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)
        std = torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)
        return images.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if settings.do_normalize:
        mean = torch.tensor(settings.image_mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(settings.image_std, dtype=torch.float32).view(-1, 1, 1)
        return images.to(torch.float32).sub_(mean).div_(std)
    if settings.do_rescale:
        return images * settings.rescale_factor
    return images.to(torch.float32)


def patchify_image(images: torch.Tensor, settings: ImageSettings, label: str) -> tuple[torch.Tensor, int, int]:
    """``[B, C, H, W]`` -> ``[B, gh*gw, T*C*p*p]`` raster-order patches, each image repeated over T."""
    batch, channels, height, width = images.shape
    p, t = settings.patch_size, settings.temporal_patch_size
    if height % p or width % p:
        raise MediaError(f"{label} is {width}x{height}, not a multiple of the {p}-pixel patch; turn do_resize on "
                         f"or crop it")
    grid_h, grid_w = height // p, width // p
    patches = images.reshape(batch, channels, grid_h, p, grid_w, p).permute(0, 2, 4, 1, 3, 5)
    patches = patches.unsqueeze(3).expand(-1, -1, -1, t, -1, -1, -1)            # [B, gh, gw, T, C, p, p]
    return patches.reshape(batch, grid_h * grid_w, t * channels * p * p), grid_h, grid_w


def _is_rgb_pil(image: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(image, Image.Image) and image.mode == "RGB"


def _check_budget(width: int, height: int, label: str, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"{label} has no pixels ({width}x{height}); pass a non-empty image")
    if width * height > max_pixels:
        raise MediaError(f"{label} is {width}x{height} ({width * height:,} pixels), above the pixel budget of "
                         f"{max_pixels:,} pixels; downscale it first (or pass a larger max_pixels)")


def _pil_to_rgb(image: Any, label: str):
    """transformers' ``image_transforms.convert_to_rgb`` for PIL images: transparency over white."""
    Image = require("PIL.Image")
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise MediaError(f"{label} (mode {image.mode}) cannot be converted to RGB: {_reason(exc)}; "
                         f"save it as an 8-bit RGB PNG or JPEG") from None


def _array_to_rgb(array: Any, label: str, max_pixels: int):
    """A uint8 ``[H, W]`` / ``[H, W, 1|3|4]`` array -> RGB PIL, as transformers' tensor path converts it."""
    Image = require("PIL.Image")
    tensor = array.detach().cpu() if isinstance(array, torch.Tensor) else as_tensor(array)
    if tensor.dtype != torch.uint8:
        raise MediaError(f"{label} is a {tensor.dtype} array; pass uint8 values in 0..255 "
                         f"(e.g. (x * 255).round().astype(np.uint8)) or a PIL image")
    if tensor.ndim == 2:
        tensor = tensor[:, :, None]
    if tensor.ndim != 3 or tensor.shape[-1] not in (1, 3, 4):
        raise MediaError(f"{label} has shape {tuple(tensor.shape)}; pass [height, width] or "
                         f"[height, width, 1|3|4 channels] (channels last)")
    _check_budget(int(tensor.shape[1]), int(tensor.shape[0]), label, max_pixels)
    if tensor.shape[-1] == 1:
        tensor = tensor.expand(-1, -1, 3)
    elif tensor.shape[-1] == 4:
        # torchvision to_dtype(scale=True) both ways, and transformers' blend on white
        rgba = tensor.to(torch.float32).mul_(1.0 / 255)
        blended = rgba[..., :3] * rgba[..., 3:] + (1 - rgba[..., 3:])
        tensor = blended.mul(255 + 1.0 - 1e-3).to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(tensor.numpy()))


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor, copied only when numpy marks it read-only or non-contiguous."""
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
