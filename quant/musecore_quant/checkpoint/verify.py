"""Verify a checkpoint end to end: what ``musecore-quant verify`` runs.

Opening already validates headers, the index, companions and the producer config; verification
adds the byte-level checks that need every weight read once: each shard's sha256 against the
index (``metadata.sha256``, written by ``CheckpointWriter``), every weight decoded with its
companions, its decoded shape equal to the header's logical shape, no NaN/Inf anywhere, and no
``*.safetensors`` file in the folder that the index does not reference (a stray shard left by
another writer). It collects every problem instead of stopping at the first, so one run lists
all that is wrong.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

from ..progress import progress as stage
from ..qtensor import QTensor
from .errors import CheckpointError
from .reader import INDEX_NAME, open_checkpoint
from .safetensors_io import read_json, sha256_file


@dataclass
class VerifyReport:
    """The outcome of ``verify_checkpoint``: ``ok`` is False when ``problems`` is not empty."""

    folder: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    format: str = ""
    producer: str = ""
    shards: int = 0
    weights: int = 0
    sha256_verified: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_checkpoint(folder: Union[str, Path], *, progress: bool = False) -> VerifyReport:
    """Check sha256 per shard, headers, companions, decoded shapes and NaN/Inf of every weight.
    ``progress``: a bar on stderr when it is a terminal, else one line when done (:mod:`..progress`).

    Example::

        report = verify_checkpoint("Muse-Spark-Open-MXFP4")
        assert report.ok, report.problems
    """
    folder = Path(folder)
    report = VerifyReport(str(folder))
    try:
        reader = open_checkpoint(folder)
    except CheckpointError as e:
        report.ok, report.problems = False, [str(e)]
        return report
    report.format, report.producer, report.shards = reader.format, reader.producer, len(reader.shards)
    try:
        _check_hashes(reader.folder, [s.name for s in reader.shards], report)
    except CheckpointError as e:
        report.problems.append(str(e))
    _check_strays(reader.folder, {s.name for s in reader.shards}, report)
    names = reader.weight_names()
    with reader, stage("verify", total=len(names), unit="weight", enabled=progress) as bar:
        for name in names:
            bar.update(1)
            try:
                value = reader.read(name)
            except CheckpointError as e:
                report.problems.append(str(e))
                continue
            shape = value.shape if isinstance(value, QTensor) else tuple(value.shape)
            if tuple(shape) != reader.weight_shape(name):
                report.problems.append(f"{reader.folder}: weight {name!r} decodes to shape {list(shape)} but "
                                       f"its headers say {list(reader.weight_shape(name))}")
            report.weights += 1
    report.ok = not report.problems
    return report


def _check_hashes(folder: Path, shard_names: list[str], report: VerifyReport) -> None:
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        report.notes.append("single-file checkpoint without an index: no sha256 recorded to check against")
        return
    metadata = read_json(index_path, "the safetensors index").get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        report.problems.append(f"{index_path}: metadata is a JSON {type(metadata).__name__}, expected an object; "
                               "regenerate the index")
        return
    recorded = (metadata or {}).get("sha256")
    if recorded is not None and not (isinstance(recorded, dict) and all(isinstance(v, str) for v in recorded.values())):
        report.problems.append(f"{index_path}: metadata.sha256 is not an object of hex strings; regenerate the index")
        return
    if not recorded:
        report.notes.append(f"{index_path.name} records no metadata.sha256 (not written by musecore-quant): "
                            "shard bytes checked only through headers and values")
        return
    for name in shard_names:
        expected = recorded.get(name)
        if expected is None:
            report.problems.append(f"{index_path}: no sha256 recorded for shard {name!r}; regenerate the index")
        elif sha256_file(folder / name) != expected:
            report.problems.append(f"{folder / name}: sha256 differs from the one recorded in {index_path.name}; "
                                   "the shard changed after it was written: re-download or re-convert it")
        else:
            report.sha256_verified += 1
    for name in sorted(set(recorded) - set(shard_names)):
        report.problems.append(f"{index_path}: sha256 recorded for {name!r}, which the index maps no tensor to")


def _check_strays(folder: Path, referenced: set[str], report: VerifyReport) -> None:
    """Every ``*.safetensors`` in the folder must be one the index (or the single-file layout) names."""
    for path in sorted(folder.glob("*.safetensors")):
        if path.name not in referenced:
            report.problems.append(f"{path}: shard is in the checkpoint folder but the index references no tensor "
                                   "in it (left by another or an interrupted writer?); delete it, or regenerate "
                                   "the index if it belongs to the checkpoint")
