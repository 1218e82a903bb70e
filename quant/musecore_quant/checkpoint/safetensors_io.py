"""Safetensors files, validated before a single weight byte is trusted.

The ``safetensors`` library reads the bytes, but only after this module has parsed the 8-byte
header length and the JSON header itself and checked them against the file size: a truncated
download, a header of absurd size, JSON garbage, offsets past the end of the file or overlapping
tensors all become a ``CheckpointError`` naming the file and tensor, instead of a crash or an
allocation of gigabytes. Index entries are resolved here too, so that no shard outside the
checkpoint folder (``../x``, absolute paths, escaping symlinks) is ever opened. Pickle files are
never read. Writing goes through ``safetensors.torch.save_file`` followed by an fsync and a
sha256 of the bytes on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .errors import CheckpointError, CheckpointIOError, translate

# A real header is a few MB even for 100k tensors; anything larger is corruption or an attack.
# (safetensors' own limit is 100,000,000 bytes; a header between the two fails when a tensor is
# read, as a CheckpointError too.)
MAX_HEADER_BYTES = 100 * 1024 * 1024
# safetensors computes element counts and byte sizes in usize (checked, left to right).
_USIZE_MAX = 2**64 - 1
_HASH_CHUNK = 16 * 1024 * 1024

# safetensors dtype string -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "I16": (torch.int16, 2), "U16": (torch.uint16, 2), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I32": (torch.int32, 4), "U32": (torch.uint32, 4),
    "F32": (torch.float32, 4), "I64": (torch.int64, 8), "U64": (torch.uint64, 8),
    "F64": (torch.float64, 8),
}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
# Short names used for plain (unquantized) weights in formats and reports.
DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8",
               "F8_E5M2": "fp8_e5m2"}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name formats and reports give a plain dtype (``bf16``, ``fp32``, ``u8``...)."""
    for key, (torch_dtype, _) in SAFETENSORS_DTYPES.items():
        if torch_dtype == dtype:
            return DTYPE_NAMES.get(key, key.lower())
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as its safetensors header describes it (no bytes read)."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


def _fail(path: Path, what: str, tensor: str | None = None) -> CheckpointError:
    where = f"{path}" + (f", tensor {_short(tensor)}" if tensor else "")
    return CheckpointError(f"{where}: {what}", path=path, tensor=tensor)


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: an error quotes what it found, not a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        for text in (key, value) if isinstance(value, str) else (key,):
            text.encode("utf-8")  # a lone surrogate (\ud800) is not Unicode text: UnicodeEncodeError
        if key in obj:
            raise ValueError(f"duplicate key {_short(key)}")
        obj[key] = value
    return obj


def parse_strict_json(raw: bytes, path: Path, what: str, redo: str, *, constants: bool = False) -> Any:
    """JSON as the Rust parsers of safetensors and tokenizers read it, or a ``CheckpointError``.

    Refused beyond what ``json.loads`` refuses: lone surrogates, duplicate keys, nesting too deep
    to parse (``RecursionError``) and, unless ``constants``, NaN/Infinity literals (which Python's
    json writes into configs, but which safetensors refuses in a header).
    """
    hooks: dict[str, Any] = {} if constants else {"parse_constant": _reject_constant}
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_strict_object, **hooks)
    except RecursionError as e:
        raise _fail(path, f"{what} is JSON nested too deeply to be real; {redo}") from e
    except (UnicodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise _fail(path, f"{what} is not valid UTF-8 JSON ({' '.join(str(e).split())[:200]}); {redo}") from e


def read_header(path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, TensorHeader]:
    """Parse and validate the header of one safetensors file; read no tensor data.

    Checks: the 8-byte length fits the file and the limit, the JSON parses to an object, every
    entry has a known dtype, a non-negative shape and offsets whose size matches the shape, and
    the offsets tile the data section exactly (what the safetensors library itself requires).
    """
    path = Path(path)
    redo = "the file is truncated or corrupt: re-download or re-export it"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"file is {size} bytes, too short for a safetensors header "
                                  f"(needs at least 8); {redo}")
            (n,) = struct.unpack("<Q", head)
            if n > max_header_bytes:
                raise _fail(path, f"header declares {n} bytes, more than the limit of "
                                  f"{max_header_bytes}; this is not a safetensors file or it is corrupt")
            if 8 + n > size:
                raise _fail(path, f"header declares {n} bytes but the file has only {size - 8} "
                                  f"after the length field; {redo}")
            raw = f.read(n)
    except OSError as e:
        raise translate(e, path, "reading the safetensors header",
                        advice="check that the file exists and is readable") from e
    header = parse_strict_json(raw, path, "header", redo)
    if not isinstance(header, dict):
        raise _fail(path, f"header is a JSON {type(header).__name__}, expected an object; {redo}")

    data_size = size - 8 - n
    tensors: dict[str, TensorHeader] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            if entry is not None and not (isinstance(entry, dict)
                                          and all(isinstance(v, str) for v in entry.values())):
                raise _fail(path, f"__metadata__ is {_short(entry)}, expected an object of strings; {redo}")
            continue
        tensors[key] = _parse_entry(path, key, entry, data_size, redo)

    end = 0
    for t in sorted(tensors.values(), key=lambda t: t.offsets):
        if t.offsets[0] != end:
            what = "overlaps the previous tensor" if t.offsets[0] < end else "leaves a gap before it"
            raise _fail(path, f"data offsets {list(t.offsets)} {what} (expected start {end}); {redo}", t.key)
        end = t.offsets[1]
    if end != data_size:
        raise _fail(path, f"tensors cover {end} bytes of a {data_size}-byte data section "
                          f"(trailing bytes); {redo}")
    return tensors


def _parse_entry(path: Path, key: str, entry: Any, data_size: int, redo: str) -> TensorHeader:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise _fail(path, f"header entry {_short(entry)} lacks dtype/shape/data_offsets; {redo}", key)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise _fail(path, f"dtype {_short(dtype)} is not supported; expected one of "
                          f"{sorted(SAFETENSORS_DTYPES)}", key)
    if (not isinstance(shape, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise _fail(path, f"shape {_short(shape)} is not a list of non-negative integers; {redo}", key)
    count = 1
    for dim in shape:  # as safetensors: a checked product, left to right, then the byte size
        count *= dim
        if count > _USIZE_MAX:
            raise _fail(path, f"shape {_short(shape)} has more elements than a 64-bit size holds; {redo}", key)
    if count * SAFETENSORS_DTYPES[dtype][1] > _USIZE_MAX:
        raise _fail(path, f"shape {_short(shape)} of {dtype} is more bytes than a 64-bit size holds; {redo}", key)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _fail(path, f"data_offsets {_short(offsets)} are not two ordered non-negative integers; {redo}", key)
    if offsets[1] > data_size:
        raise _fail(path, f"data offsets {offsets} end beyond the file (data section is "
                          f"{data_size} bytes); {redo}", key)
    expected = count * SAFETENSORS_DTYPES[dtype][1]
    if offsets[1] - offsets[0] != expected:
        raise _fail(path, f"data offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                          f"{dtype}{shape} needs {expected}; {redo}", key)
    return TensorHeader(key, path, dtype, tuple(shape), (offsets[0], offsets[1]))


def resolve_inside(folder: Path, relative: str, *, source: Path, tensor: str | None = None) -> Path:
    """Resolve a file name taken from an index, refusing anything outside ``folder``.

    Rejects absolute paths, ``..`` components, names that are not ``*.safetensors`` (pickle
    files are never read) and symlinks whose target leaves the folder, except the links of a
    Hugging Face hub cache snapshot to a file directly in its repo's own ``blobs`` directory
    (``<repo>/snapshots/<rev>/x -> <repo>/blobs/<sha>``; see :func:`_hub_blobs`).
    """
    what = f"index entry {relative!r}"
    if not isinstance(relative, str) or not relative:
        raise _fail(source, f"{what} is not a file name", tensor)
    rel = Path(relative)
    if rel.is_absolute() or relative.startswith(("/", "\\")) or ".." in rel.parts or ".." in relative.split("\\"):
        raise _fail(source, f"{what} points outside the checkpoint folder {folder}; only files "
                            "inside the folder are read: fix or regenerate the index", tensor)
    if not relative.endswith(".safetensors"):
        raise _fail(source, f"{what} is not a .safetensors file; only safetensors are read "
                            "(never pickle): convert the weights to safetensors", tensor)
    _require_inside(folder, folder / rel, source, what, tensor)
    return folder / rel


def require_inside(folder: Path, path: Path, what: str) -> Path:
    """``path`` (a file of ``folder``: config.json, a tokenizer...) unless it resolves outside ``folder``
    through a symlink; as :func:`resolve_inside` allows, a Hugging Face cache snapshot's links into its
    repo's ``blobs`` pass. Every file a checkpoint reader or the converter opens goes through one of
    the two, so a link to ``/etc/passwd`` is never read nor copied into a converted checkpoint."""
    _require_inside(folder, path, path, what, None)
    return path


def _require_inside(folder: Path, path: Path, source: Path, what: str, tensor: str | None) -> None:
    try:
        base = folder.resolve()
        target = path.resolve()
        blobs = _hub_blobs(folder)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop before Python 3.13
        if not isinstance(e, OSError):
            e = OSError(40, "symlink loop")
        raise translate(e, source, f"resolving {what}", tensor=tensor) from e
    if base not in target.parents and not (blobs is not None and target.parent == blobs):
        raise _fail(source, f"{what} resolves to {target}, outside the checkpoint folder {base} "
                            "(a symlink escapes it); copy the file into the folder (or remove the link)", tensor)


def _hub_blobs(folder: Path) -> Path | None:
    """The resolved ``blobs`` folder of the Hugging Face cache repo that ``folder`` is a snapshot of
    (``<repo>/snapshots/<rev>``), or None. Trusted only when ``<repo>/blobs`` is a real directory
    (not a symlink) directly inside the repo folder: a ``blobs`` that links elsewhere (to ``/``) would
    make every absolute symlink of the snapshot loadable."""
    if folder.parent.name != "snapshots":
        return None
    repo = folder.parent.parent
    blobs = repo / "blobs"
    if blobs.is_symlink() or not blobs.is_dir():
        return None
    resolved = blobs.resolve()
    return resolved if resolved.parent == repo.resolve() else None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise translate(e, path, "reading the file to hash it") from e
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories: so that a rename or a new entry is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write one shard, fsync it, and return the sha256 of the bytes on disk."""
    ready = {}
    storages: set[int] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors sharing memory (siblings sharing one global scale, views
        # into a larger buffer): give each its own copy.
        if storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        ready[key] = t
    try:
        save_file(ready, str(path), metadata={"format": "pt"})
        fsync_path(path)
    except SafetensorError as e:  # the library wraps OS errors (disk full) in its own type
        raise write_error(e, path) from e
    except OSError as e:
        raise write_error(e, path) from e
    return sha256_file(path)


def write_error(exc: BaseException, path: Path) -> CheckpointError:
    """The ``CheckpointError`` for a failed write of ``path`` (disk full named as such)."""
    text = str(exc)
    if isinstance(exc, SafetensorError) and ("code: 28" in text or "StorageFull" in text):
        exc = OSError(28, "No space left on device")
    if isinstance(exc, OSError):
        return translate(exc, path, "writing", advice="check the destination and rerun; the conversion "
                                                      "resumes from its finished shards")
    return CheckpointIOError(f"{path}: writing failed ({' '.join(text.split())[:300]}); check the destination "
                             "(free space, permissions) and rerun", path=path)


def write_json(path: Path, obj: Any) -> None:
    """Write a JSON file and fsync it."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(e, path) from e


def read_json(path: Path, what: str) -> Any:
    """Read a JSON file, turning every failure into a ``CheckpointError`` naming it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise _fail(path, f"{what} is missing") from e
    except OSError as e:
        raise translate(e, path, f"reading {what}") from e
    return parse_strict_json(raw, path, what, "fix or regenerate it", constants=True)
