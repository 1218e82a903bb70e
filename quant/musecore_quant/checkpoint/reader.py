"""Open a Hugging Face-style safetensors checkpoint of any supported producer, strictly.

``open_checkpoint`` reads ``config.json``, the optional ``hf_quant_config.json``, the index and
every shard header (no weight bytes), validates them against each other, detects the producer
and groups companion tensors under their logical weight. Weights are then read one at a time
(``read``) or streamed shard by shard (``iter_shards``), decoded into plain tensors or the
canonical ``QTensor``, and checked for NaN/Inf as they are read.

Example::

    from musecore_quant.checkpoint import open_checkpoint
    ckpt = open_checkpoint("Muse-Spark-Open-NVFP4")
    print(ckpt.format, ckpt.producer, len(ckpt.weight_names()))
    for shard, weights in ckpt.iter_shards():      # peak memory ~ one shard
        ...
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from . import autoround, compressed_tensors, dense, gpt_oss
from .detect import Scheme, check_entries, detect_scheme
from .errors import CheckpointError, translate
from .experts import check_fused_headers
from .layout import Weight, WeightEntry, check_finite, decode_plain, group_tensors, plain_entry
from .safetensors_io import TensorHeader, read_header, read_json, require_inside, resolve_inside
from .scales import check_scales

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PARTIAL_MARKER = ".partial"  # file inside a folder the writer has not finished
_PARTIAL_NAME = re.compile(r"\.partial(-|$)")

_CLASSIFIERS = {"dense": dense.classify_dense, "gptq": autoround.classify_int4,
                "compressed-tensors": compressed_tensors.classify_packed, "gpt-oss": gpt_oss.classify_blocks}
_DECODERS = {"plain": decode_plain, **dense.DECODERS, **autoround.DECODERS,
             **compressed_tensors.DECODERS, **gpt_oss.DECODERS}


def is_partial_name(name: str) -> bool:
    """True for a folder name readers take for an unfinished conversion (``*.partial``, ``*.partial-*``)."""
    return bool(_PARTIAL_NAME.search(name))


def is_partial(folder: Path) -> bool:
    """True for a folder the checkpoint writer has not finished (by name or marker file)."""
    return is_partial_name(folder.name) or (folder / PARTIAL_MARKER).exists()


def open_checkpoint(folder: str | Path) -> "CheckpointReader":
    """Open and validate the checkpoint in ``folder`` from its headers; no weight bytes are read.

    Every failure is a ``CheckpointError`` naming the file: what the operating system refuses
    (a name too long, a symlink loop, permissions) is translated here, at the boundary.
    """
    folder = Path(folder)
    try:
        return _open(folder)
    except (OSError, RecursionError, UnicodeError, OverflowError) as e:
        raise translate(e, getattr(e, "filename", None) or folder, "opening the checkpoint") from e


def _open(folder: Path) -> "CheckpointReader":
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder (it does not exist or is not a "
                              "directory); pass the folder holding config.json and *.safetensors", path=folder)
    if is_partial(folder):
        raise CheckpointError(f"{folder}: incomplete conversion; rerun the converter to resume (this .partial "
                              "folder was left by an interrupted writer), or delete it", path=folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: config.json is missing; a Hugging Face checkpoint folder "
                              "needs it: copy it from the model repository", path=config_path)
    config = read_json(require_inside(folder, config_path, "config.json"), "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: config.json is a JSON {type(config).__name__}, expected an "
                              "object; fix it", path=config_path)
    hf_quant = None
    if (folder / "hf_quant_config.json").is_file():
        hf_quant = read_json(require_inside(folder, folder / "hf_quant_config.json", "hf_quant_config.json"),
                             "hf_quant_config.json")
        if not isinstance(hf_quant, dict):
            raise CheckpointError(f"{folder / 'hf_quant_config.json'}: expected a JSON object",
                                  path=folder / "hf_quant_config.json")
    shards, headers = _read_headers(folder)
    check_fused_headers(headers)
    scheme = detect_scheme(folder, config, hf_quant)
    entries = _build_entries(headers, scheme)
    check_entries(scheme, entries, folder)
    return CheckpointReader(folder, config, hf_quant, shards, entries, scheme)


def _read_headers(folder: Path) -> tuple[list[Path], dict[str, TensorHeader]]:
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        index = read_json(require_inside(folder, index_path, "the safetensors index"), "the safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: expected an object with a non-empty 'weight_map' "
                                  "{tensor: shard}; regenerate the index", path=index_path)
        by_file: dict[Path, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(resolve_inside(folder, name, source=index_path, tensor=key), []).append(key)
        headers: dict[str, TensorHeader] = {}
        for shard, keys in by_file.items():
            if shard.is_dir():
                raise CheckpointError(
                    f"{index_path}: shard {shard.name!r} (listed for {len(keys)} tensors, e.g. {keys[0]!r}) is a "
                    "directory, not a file; put the shard file there (re-download it)", path=shard, tensor=keys[0])
            if not shard.is_file():
                raise CheckpointError(
                    f"{index_path}: shard {shard.name!r} (listed for {len(keys)} tensors, e.g. {keys[0]!r}) "
                    "is missing from the folder; re-download it", path=shard, tensor=keys[0])
            found = read_header(shard)
            listed = set(keys)
            for key in keys:
                if key not in found:
                    raise CheckpointError(
                        f"{index_path}: tensor {key!r} is listed in shard {shard.name!r} but that shard's "
                        "header does not contain it; the index and shards disagree: re-download the "
                        "checkpoint or regenerate the index", path=shard, tensor=key)
            for key in found:
                if key not in listed:
                    elsewhere = weight_map.get(key)
                    where = f"lists it in {elsewhere!r}" if elsewhere else "does not list it"
                    raise CheckpointError(
                        f"{shard}: tensor {key!r} is in this shard but the index {where}; the index and "
                        "shards disagree: regenerate the index", path=shard, tensor=key)
            headers.update(found)
        return sorted(by_file, key=lambda p: p.name), headers
    single = folder / SINGLE_NAME
    if single.is_file():
        single = resolve_inside(folder, SINGLE_NAME, source=single)
        return [single], read_header(single)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    hint = (f" Found {pickles[:3]}: pickle weights are never read (they can run code); convert them to "
            "safetensors first." if pickles else " Download the weights next to config.json.")
    raise CheckpointError(f"{folder}: no {SINGLE_NAME} and no {INDEX_NAME}.{hint}", path=folder)


def _build_entries(headers: dict[str, TensorHeader], scheme: Scheme) -> dict[str, WeightEntry]:
    groups, plain = group_tensors(headers, scheme.rules)
    entries = {key: plain_entry(key, h) for key, h in plain.items()}
    for name, (rule, parts) in groups.items():
        if name in entries:
            h = entries[name].parts["tensor"]
            raise CheckpointError(f"{h.file}: tensor {name!r} collides with the logical name of a "
                                  f"{rule.name} weight; re-export the checkpoint", path=h.file, tensor=name)
        entries[name] = _CLASSIFIERS[rule.name](name, parts, scheme.options)
    # the order in which iter_shards completes them: by the last of their parts on disk
    last = lambda e: max((h.file.name, h.offsets[0]) for h in e.parts.values())  # noqa: E731
    return dict(sorted(entries.items(), key=lambda kv: last(kv[1])))


class CheckpointReader:
    """A validated checkpoint: its config, producer, format and logical weights.

    Weights are decoded on demand; ``QTensor``s are in the canonical layout of
    ``musecore_quant.qtensor`` whatever the producer.
    """

    def __init__(self, folder: Path, config: dict[str, Any], hf_quant_config: Optional[dict[str, Any]],
                 shards: list[Path], entries: dict[str, WeightEntry], scheme: Scheme) -> None:
        self.folder = folder
        self.config = config
        self.hf_quant_config = hf_quant_config
        self.shards = shards
        self.producer = scheme.producer
        self.quant_method = scheme.quant_method
        self._entries = entries
        self._handles: dict[Path, Any] = {}
        formats = {e.format for e in entries.values() if e.quantized}
        if len(formats) > 1:
            self.format = "mixed"
        elif formats:
            self.format = formats.pop()
        else:
            sizes = Counter({})
            for e in entries.values():
                if len(e.shape) >= 2:
                    sizes[e.format] += e.nbytes
            self.format = sizes.most_common(1)[0][0] if sizes else "bf16"

    def __repr__(self) -> str:
        return (f"CheckpointReader({str(self.folder)!r}, format={self.format!r}, producer={self.producer!r}, "
                f"weights={len(self._entries)}, shards={len(self.shards)})")

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the open (memory-mapped) shard handles."""
        self._handles.clear()

    def weight_names(self) -> list[str]:
        """Logical weight names in file order; companions are grouped under their weight."""
        return list(self._entries)

    def entry(self, name: str) -> WeightEntry:
        """The on-disk description of one logical weight (parts, format, shape, group size)."""
        try:
            return self._entries[name]
        except KeyError:
            near = [n for n in self._entries if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise CheckpointError(f"{self.folder}: no weight named {name!r} (checkpoint has "
                                  f"{len(self._entries)} weights, e.g. {near or list(self._entries)[:3]})",
                                  path=self.folder, tensor=name) from None

    def weight_format(self, name: str) -> str:
        """``nvfp4``/``mxfp4``/``int4``/``fp8`` for quantized weights, else the dtype (``bf16``...)."""
        return self.entry(name).format

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """Logical (unpacked) shape, from the headers."""
        return self.entry(name).shape

    def tensor_nbytes(self, name: Optional[str] = None) -> int:
        """Bytes on disk of one weight with its companions, or of the whole checkpoint."""
        if name is not None:
            return self.entry(name).nbytes
        return sum(e.nbytes for e in self._entries.values())

    def read_parts(self, name: str, roles: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        """Stored tensors of one weight by role (``weight``, ``weight_scale``...), undecoded.

        ``roles`` limits reading to those parts (e.g. only the scales, for statistics).
        """
        entry = self.entry(name)
        wanted = entry.parts if roles is None else {r: entry.parts[r] for r in roles if r in entry.parts}
        return {role: self._get(h) for role, h in wanted.items()}

    def read(self, name: str, *, check_finite: bool = True) -> Weight:
        """One weight, decoded: a plain tensor or a canonical ``QTensor``. NaN/Inf raise."""
        entry = self.entry(name)
        return self._decode(entry, self.read_parts(name), check_finite)

    def iter_shards(self, names: Optional[Iterable[str]] = None, *, check_finite: bool = True,
                    leading: Optional[Mapping[str, Sequence[tuple[int, int]]]] = None,
                    ) -> Iterator[tuple[Path, dict[str, Weight]]]:
        """Yield ``(shard, {name: weight})`` one shard at a time, in file order.

        A weight whose companions sit in a later shard is held until that shard is read and then
        yielded with it. ``names`` restricts reading to those weights (others' bytes are not read).
        ``leading`` maps unquantized weights to ``(start, stop)`` ranges of their first dimension: only
        those rows are read from the file, joined in order (one rank's experts of a stacked ``[E, ...]``
        tensor, its heads of a projection); see :meth:`can_slice`.
        """
        leading = leading or {}
        wanted = set(self._entries) if names is None else {self.entry(n).name for n in names}
        by_file: dict[Path, list[tuple[str, str, TensorHeader]]] = {}
        for name in wanted:
            for role, h in self._entries[name].parts.items():
                by_file.setdefault(h.file, []).append((name, role, h))
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for shard in self.shards:
            if shard not in by_file:
                continue
            out: dict[str, Weight] = {}
            for name, role, h in sorted(by_file[shard], key=lambda x: x[2].offsets):
                parts = pending.setdefault(name, {})
                entry = self._entries[name]
                parts[role] = self._get(h, leading.get(name) if self.can_slice(name) else None)
                if len(parts) == len(entry.parts):
                    out[name] = self._decode(entry, pending.pop(name), check_finite)
            self._handles.pop(shard, None)
            if out:
                yield shard, out
        assert not pending, f"weights never completed: {sorted(pending)[:3]}"

    def _decode(self, entry: WeightEntry, tensors: dict[str, torch.Tensor], finite: bool) -> Weight:
        if finite:
            check_finite(entry, tensors)
        check_scales(entry, tensors)  # finite scales that would decode silently wrong: always refused
        try:
            return _DECODERS[entry.kind](entry, tensors)
        except CheckpointError:
            raise
        except ValueError as e:  # a codec's refusal (act-order g_idx, inconsistent packed shapes): name the file
            h = next(iter(entry.parts.values()))
            raise CheckpointError(f"{h.file}: weight {entry.name!r}: {e}", path=h.file, tensor=entry.name) from e

    def can_slice(self, name: str) -> bool:
        """Whether :meth:`iter_shards` can read a range of ``name``'s first dimension alone (one stored,
        unquantized tensor)."""
        entry = self.entry(name)
        return entry.kind == "plain" and len(entry.parts) == 1

    def _get(self, h: TensorHeader, rows: Optional[Sequence[tuple[int, int]]] = None) -> torch.Tensor:
        try:
            handle = self._handles.get(h.file)
            if handle is None:
                handle = self._handles[h.file] = safe_open(str(h.file), framework="pt", device="cpu")
            if rows is not None:
                view = handle.get_slice(h.key)
                pieces = [view[a:b] for a, b in rows]
                return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return handle.get_tensor(h.key)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # the file changed after its header was read
            raise CheckpointError(f"{h.file}: cannot read tensor {h.key!r} ({e}); the file changed or is "
                                  "corrupt: re-download it", path=h.file, tensor=h.key) from e
