"""Write a checkpoint in a producer's own layout, atomically and resumably.

``CheckpointWriter`` turns logical weights (plain tensors and ``QTensor``s) into the keys and
configs the producer of the target format writes (ModelOpt for NVFP4/FP8, Quark for MXFP4,
AutoRound for INT4, plain HF for BF16), so vLLM, SGLang, TensorRT-LLM or transformers load the
result as if that producer had made it.

Fused MoE experts (transformers 5 ``P.experts.gate_up_proj [E, 2I, h]`` / ``P.experts.down_proj``) added
as stacked QTensors are written the way ModelOpt, Quark and AutoRound export them: per-expert keys
``P.experts.{e}.{gate,up,down}_proj.*`` (``experts.py`` cites their code); BF16 fused tensors stay fused,
and their ``P.experts`` module is listed among the unquantized modules of the producer config.

Crash safety: everything goes into a sibling folder ``DST.partial-<key>`` holding a ``.partial``
marker; each shard is fsynced, hashed (sha256) and appended to ``journal.jsonl`` only once
complete. ``close`` writes the index (with ``metadata.sha256 = {shard: hex}``) and configs, removes
the journal and marker and renames the folder to ``DST``: a reader never sees a half-written
checkpoint (``open_checkpoint`` refuses ``.partial`` folders). With a stable ``resume_key`` a
rerun reopens the partial folder, keeps the journaled shards whose sha256 still matches (and that
the caller's ``keep_shard`` accepts: the converter checks the source content each was made
from), and reports their weights in ``completed`` so the caller skips them.

One writer per destination: the writer holds an exclusive ``flock`` on ``.DST.lock`` beside the
destination from construction to ``close``/``release``, covering ``DST`` and every
``DST.partial-*``; a second writer fails at once with ``ConversionLockedError`` naming the
holder's pid. The destination is checked before any work (an existing path or dangling symlink,
a parent that is a file), so a conversion never fails after the work is done.

Example::

    with CheckpointWriter("out", config=cfg, format="nvfp4") as w:
        w.add("model.layers.1.mlp.experts.0.up_proj.weight", quantize(w_up, "nvfp4"))
        w.add("model.norm.weight", norm)
    # leaving the block calls close(); an exception leaves the .partial folder for resume
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

from ..qtensor import QTensor
from . import autoround, modelopt, quark
from .errors import CheckpointError, ConversionLockedError, translate
from .experts import FUSED_EXPERT, check_fused_qtensor, unfuse
from .reader import INDEX_NAME, PARTIAL_MARKER, is_partial_name
from .safetensors_io import dtype_name, fsync_path, sha256_file, write_error, write_json, write_safetensors

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
JOURNAL = "journal.jsonl"
TARGET_PRODUCERS = {"nvfp4": "modelopt", "fp8": "modelopt", "mxfp4": "quark", "int4": "auto-round",
                    "bf16": "none"}
_ACCEPTED = {"modelopt": {"nvfp4", "fp8"}, "quark": {"mxfp4"}, "auto-round": {"int4"}, "none": set()}


class CheckpointWriter:
    """Write weights into ``folder`` in the layout of ``format``'s producer; see the module doc.

    ``config`` is the model's config.json content (any ``quantization_config`` is replaced);
    ``producer_config`` holds keys merged into the producer's quantization config (e.g.
    ``{"producer": {"version": ...}}`` for ModelOpt, ``{"iters": 200}`` for AutoRound).
    """

    def __init__(self, folder: Union[str, Path], *, config: Mapping[str, Any], format: str,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 producer_config: Optional[Mapping[str, Any]] = None,
                 resume_key: Optional[str] = None, resume: bool = True,
                 keep_shard: Optional[Callable[[Mapping[str, Any]], bool]] = None) -> None:
        if format not in TARGET_PRODUCERS:
            raise CheckpointError(f"unknown target format {format!r}; expected one of {sorted(TARGET_PRODUCERS)}")
        if max_shard_bytes <= 0:
            raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.folder = Path(folder)
        self._lock_fd: Optional[int] = None
        self._check_destination()
        self._lock_fd = _acquire_lock(self.lock_path, self.folder)
        try:
            self._check_destination()  # again, under the lock: another writer may have just finished it
            self._open(format, producer_config, config, max_shard_bytes, resume_key, resume, keep_shard)
        except BaseException:
            self.release()
            raise

    @property
    def lock_path(self) -> Path:
        """The lock file every writer of this destination takes (beside it, hidden)."""
        return self.folder.parent / f".{self.folder.name}.lock"

    def _check_destination(self) -> None:
        parent = self.folder.parent
        if is_partial_name(self.folder.name):
            raise CheckpointError(f"{self.folder}: a destination named *.partial or *.partial-* could never be "
                                  "read (readers take such a folder for an unfinished conversion); choose another "
                                  "name", path=self.folder)
        if os.path.lexists(self.folder):
            what = "is a symlink (dangling or not)" if self.folder.is_symlink() else "already exists"
            raise CheckpointError(f"{self.folder}: destination {what}; choose a new folder or "
                                  "delete it first (the writer never overwrites a checkpoint)", path=self.folder)
        for up in (parent, *parent.parents):
            if os.path.lexists(up):
                if not up.is_dir():
                    raise CheckpointError(f"{self.folder}: {up} is a file (or a dangling symlink), not a folder; "
                                          "choose a destination under a folder", path=self.folder)
                break
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise translate(e, parent, "creating the destination's parent folder") from e
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointError(f"{parent}: folder is not writable; choose a destination you can write",
                                  path=parent)

    def release(self) -> None:
        """Give up the destination lock (``close`` does; call it when abandoning a writer)."""
        if self._lock_fd is None:
            return
        try:
            os.unlink(self.lock_path)  # unlinked while held: a waiting writer re-checks the inode it locked
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def abort(self) -> None:
        """Abandon the conversion: remove the partial folder if no shard was finished, release the lock."""
        try:
            if not self._shards and self.partial_folder.exists():
                shutil.rmtree(self.partial_folder)
        finally:
            self.release()

    def _open(self, format: str, producer_config: Optional[Mapping[str, Any]], config: Mapping[str, Any],
              max_shard_bytes: int, resume_key: Optional[str], resume: bool,
              keep_shard: Optional[Callable[[Mapping[str, Any]], bool]]) -> None:
        self.format = format
        self.producer = TARGET_PRODUCERS[format]
        self.config = dict(config)
        self.producer_config = dict(producer_config or {})
        self.max_shard_bytes = int(max_shard_bytes)
        key = resume_key or uuid.uuid4().hex[:12]
        self.partial_folder = self.folder.parent / f"{self.folder.name}.partial-{key}"
        self.completed: dict[str, dict[str, Any]] = {}  # logical name -> record, from finished shards
        self._shards: list[dict[str, Any]] = []         # journal entries of finished shards
        self._names: set[str] = set()  # logical names added (finished or queued)
        self._keys: set[str] = set()
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_records: list[dict[str, Any]] = []
        self._buffer_bytes = 0
        self._closed = False
        self._keep_shard = keep_shard
        try:
            if not (self.partial_folder.exists() and resume_key is not None and resume and self._resume()):
                if self.partial_folder.exists():
                    shutil.rmtree(self.partial_folder)
                self.partial_folder.mkdir()
                (self.partial_folder / PARTIAL_MARKER).write_text("musecore-quant writer: incomplete\n")
                self._append_journal({"writer": 1, "format": format})
        except OSError as e:
            raise translate(e, self.partial_folder, "preparing the partial folder") from e

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the partial folder stays (when it holds finished shards): rerun with the same resume_key
            self.abort()

    @property
    def tensor_bytes(self) -> int:
        """Tensor bytes written or queued so far (the index's ``total_size`` at close)."""
        return sum(e["tensor_bytes"] for e in self._shards) + self._buffer_bytes

    @property
    def shard_count(self) -> int:
        """Shards finished so far."""
        return len(self._shards)

    # ------------------------------------------------------------------ adding weights
    def accepts(self, value: Union[torch.Tensor, QTensor], name: Optional[str] = None) -> bool:
        """Whether ``add`` can store ``value`` as is in this target's producer layout.

        A stacked ``[E, out, in]`` QTensor is accepted under a fused expert name (``*.experts.gate_up_proj``
        / ``*.experts.down_proj``): it is written as the producer's per-expert keys (see ``experts.py``).
        """
        if not isinstance(value, QTensor):
            return True
        fused = name is not None and FUSED_EXPERT.match(name) is not None and len(value.shape) == 3
        if value.format == "fp8" and value.scale.numel() != (value.shape[0] if fused else 1):
            return False  # ModelOpt FP8 is per-tensor (per expert)
        return value.format in _ACCEPTED[self.producer] and (len(value.shape) == 2 or fused)

    def add(self, name: str, value: Union[torch.Tensor, QTensor], meta: Optional[Mapping[str, Any]] = None) -> None:
        """Queue one logical weight (``X.weight`` for a QTensor); ``meta`` goes to the journal."""
        if self._closed:
            raise CheckpointError(f"{self.folder}: writer is closed; create a new one")
        if name in self._names:
            raise CheckpointError(f"weight {name!r} was already added to {self.folder}", tensor=name)
        try:
            tensors, record = self._encode(name, value)
        except (ValueError, TypeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"weight {name!r} cannot be written in the {self.producer} layout: {e}",
                                  tensor=name) from e
        record["meta"] = dict(meta or {})
        clash = sorted(self._keys.intersection(tensors))
        if clash:
            raise CheckpointError(f"weight {name!r} writes tensor {clash[0]!r}, which another weight "
                                  "already wrote; names must be unique", tensor=clash[0])
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._names.add(name)
        self._keys.update(tensors)
        self._buffer.update(tensors)
        self._buffer_records.append(record)
        self._buffer_bytes += nbytes

    def add_file(self, source: Union[str, Path], name: Optional[str] = None) -> None:
        """Copy a side file (tokenizer, generation config...) into the checkpoint. A symlink is copied as
        the file it points to: the caller checks that it stays inside the source folder
        (``safetensors_io.require_inside``)."""
        target = self.partial_folder / (name or Path(source).name)
        try:
            shutil.copyfile(source, target)
            fsync_path(target)
        except OSError as e:
            raise write_error(e, target) from e

    def _encode(self, name: str, value: Union[torch.Tensor, QTensor]) -> tuple[dict[str, torch.Tensor], dict]:
        if not isinstance(value, QTensor):
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"weight {name!r} is a {type(value).__name__}; expected a torch.Tensor "
                                      "or a QTensor", tensor=name)
            return {name: value}, {"name": name, "format": dtype_name(value.dtype), "keys": [name],
                                   "ndim": value.dim()}
        if FUSED_EXPERT.match(name) and len(value.shape) == 3:
            return self._encode_fused(name, value)
        if value.layout != "canonical":
            raise CheckpointError(f"weight {name!r} is a QTensor in backend layout {value.layout!r}; write "
                                  "the canonical QTensor a reader or quantize() returned", tensor=name)
        if not name.endswith(".weight"):
            raise CheckpointError(f"quantized weight {name!r} must be named '<module>.weight' so that its "
                                  "companions can be named after the module", tensor=name)
        if len(value.shape) != 2:
            raise CheckpointError(f"weight {name!r} is a stacked QTensor {list(value.shape)}; checkpoints keep "
                                  "one [out, in] tensor per expert: add each expert separately", tensor=name)
        if not self.accepts(value):
            raise CheckpointError(
                f"weight {name!r} is {value.format}{list(value.shape)}; the {self.format} target "
                f"({self.producer} layout) stores {sorted(_ACCEPTED[self.producer]) or 'no quantized'} "
                "[out, in] weights (FP8 per-tensor only): requantize or dequantize it first", tensor=name)
        record: dict[str, Any] = {"name": name, "format": value.format, "ndim": len(value.shape),
                                  "group_size": value.group_size}
        if self.producer == "modelopt":
            tensors = modelopt.encode(name, value)
            record["algo"] = modelopt.quant_algo(value)
        elif self.producer == "quark":
            tensors = quark.encode(name, value)
        else:
            tensors = autoround.encode_int4(name, value)
            record["sym"] = value.zero is None
        record["keys"] = list(tensors)
        return tensors, record

    def _encode_fused(self, name: str, value: QTensor) -> tuple[dict[str, torch.Tensor], dict]:
        """A quantized fused expert tensor, written as the producer's per-expert keys (``experts.unfuse``)."""
        check_fused_qtensor(name, value)
        if not self.accepts(value, name):
            raise CheckpointError(
                f"fused expert weight {name!r} is {value.format}{list(value.shape)}; the {self.format} target "
                f"({self.producer} layout) stores {sorted(_ACCEPTED[self.producer]) or 'no quantized'} experts "
                "(FP8 one scale per expert): requantize or dequantize it first", tensor=name)
        tensors: dict[str, torch.Tensor] = {}
        modules: dict[str, Any] = {}
        record: dict[str, Any] = {"name": name, "format": value.format, "ndim": 3, "group_size": value.group_size}
        for sub, qt in unfuse(name, value):
            sub_tensors, sub_record = self._encode(sub, qt)
            tensors.update(sub_tensors)
            modules[sub[: -len(".weight")]] = sub_record.get("algo", sub_record.get("sym"))
            for k in ("algo", "sym"):
                if k in sub_record:
                    record[k] = sub_record[k]
        record["modules"] = modules
        record["keys"] = list(tensors)
        return tensors, record

    # ------------------------------------------------------------------ shards and journal
    def flush(self) -> None:
        """Write the queued weights as one shard, fsync and journal it."""
        if not self._buffer:
            return
        name = f"shard-{len(self._shards) + 1:05d}.safetensors"
        sha = write_safetensors(self.partial_folder / name, self._buffer)
        entry = {"shard": name, "sha256": sha, "tensor_bytes": self._buffer_bytes,
                 "weights": self._buffer_records}
        self._append_journal(entry)
        self._shards.append(entry)
        self.completed.update((r["name"], r) for r in self._buffer_records)
        self._buffer, self._buffer_records, self._buffer_bytes = {}, [], 0

    def _append_journal(self, entry: Mapping[str, Any]) -> None:
        path = self.partial_folder / JOURNAL
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(e, path) from e

    def _resume(self) -> bool:
        """Reload the journal of an interrupted run; False when there is nothing to resume."""
        journal = self.partial_folder / JOURNAL
        lines = journal.read_text(encoding="utf-8").splitlines() if journal.exists() else []
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line: the shard it described is redone
        if not entries:
            return False  # crashed before the journal was written: start over
        if entries[0].get("format") != self.format:
            raise CheckpointError(
                f"{self.partial_folder}: partial conversion was to {entries[0].get('format')!r}, not "
                f"{self.format!r}; delete it or rerun with resume disabled", path=self.partial_folder)
        kept = [entries[0]]
        for entry in entries[1:]:
            path = self.partial_folder / str(entry.get("shard"))
            if not path.is_file() or sha256_file(path) != entry.get("sha256"):
                break  # this and later shards are redone
            if self._keep_shard is not None and not self._keep_shard(entry):
                break  # made from source content that has changed since: redone
            kept.append(entry)
            self._shards.append(entry)
            self.completed.update((r["name"], r) for r in entry["weights"])
            self._names.update(r["name"] for r in entry["weights"])
            self._keys.update(k for r in entry["weights"] for k in r["keys"])
        keep_files = {e["shard"] for e in self._shards}
        for stray in self.partial_folder.glob("*.safetensors"):
            if stray.name not in keep_files:
                stray.unlink()  # unjournaled: half-written, or renamed by an interrupted close
        journal.write_text("".join(json.dumps(e) + "\n" for e in kept), encoding="utf-8")
        fsync_path(journal)
        return True

    # ------------------------------------------------------------------ finishing
    def close(self, extra_json: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Finish: index with sha256, configs, ``extra_json`` files, then rename to ``folder``."""
        if self._closed:
            raise CheckpointError(f"{self.folder}: writer already closed")
        self.flush()
        if not self._shards:
            raise CheckpointError(f"{self.folder}: no weights were added; nothing to write")
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        sha: dict[str, str] = {}
        for i, entry in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            try:
                os.replace(self.partial_folder / entry["shard"], self.partial_folder / final)
            except OSError as e:
                raise translate(e, self.partial_folder / entry["shard"], "renaming the shard") from e
            sha[final] = entry["sha256"]
            for record in entry["weights"]:
                weight_map.update((k, final) for k in record["keys"])
        records = [r for e in self._shards for r in e["weights"]]
        index = {"metadata": {"total_size": sum(e["tensor_bytes"] for e in self._shards), "sha256": sha,
                              "format": self.format, "writer": "musecore-quant"},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.partial_folder / INDEX_NAME, index)
        config, hf_quant = self._configs(records)
        write_json(self.partial_folder / "config.json", config)
        if hf_quant is not None:
            write_json(self.partial_folder / "hf_quant_config.json", hf_quant)
        for file_name, obj in (extra_json or {}).items():
            write_json(self.partial_folder / file_name, obj)
        try:
            (self.partial_folder / JOURNAL).unlink()
            (self.partial_folder / PARTIAL_MARKER).unlink()
            fsync_path(self.partial_folder)
            os.rename(self.partial_folder, self.folder)
            fsync_path(self.folder.parent)
        except OSError as e:
            raise translate(e, self.folder, "moving the finished checkpoint into place") from e
        self._closed = True
        self.release()
        return index

    def _configs(self, records: list[dict[str, Any]]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        config = {k: v for k, v in self.config.items() if k not in ("quantization_config", "compression_config")}
        quantized = [r for r in records if "group_size" in r]  # only QTensor records carry one
        if not quantized:
            return config, None
        module = lambda r: r["name"][: -len(".weight")]  # noqa: E731
        # a quantized fused expert record covers its per-expert modules (``modules``)
        modules = lambda r: list(r["modules"]) if "modules" in r else [module(r)]  # noqa: E731
        unquantized = [module(r) for r in records
                       if r not in quantized and r["ndim"] == 2 and r["name"].endswith(".weight")]
        # BF16 fused experts (layers kept unquantized): the experts module is excluded, as vLLM's FusedMoE
        # checks its prefix ``...mlp.experts`` against the exclude list
        unquantized += sorted({FUSED_EXPERT.match(r["name"])["prefix"] for r in records
                               if r not in quantized and FUSED_EXPERT.match(r["name"])})
        hf_quant = None
        if self.producer == "modelopt":
            qc, hf_quant = modelopt.quantization_configs({m: r["algo"] for r in quantized for m in modules(r)},
                                                         unquantized, self.producer_config)
        elif self.producer == "quark":
            qc = quark.quantization_config(unquantized, self.producer_config)
        else:
            qc = autoround.autoround_quantization_config(
                {m: (r["group_size"], r["sym"]) for r in quantized for m in modules(r)}, unquantized,
                self.producer_config)
        config["quantization_config"] = qc
        return config, hf_quant


def _acquire_lock(lock_path: Path, folder: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``lock_path`` (created, holding our pid); its fd.

    The holder unlinks the file before closing it, so after locking we check that the file we
    locked is still the one at ``lock_path`` (else a finishing writer just removed it: retry).
    """
    for _ in range(100):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise translate(e, lock_path, "creating the destination lock file") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConversionLockedError(
                    f"another conversion is writing {folder} (pid {holder}); wait for it to finish, or stop it "
                    f"(its lock is {lock_path})", path=folder) from None
            raise translate(e, lock_path, "locking the destination") from e
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise ConversionLockedError(f"{lock_path}: could not take the destination lock (it keeps being replaced); "
                                "is another conversion starting and finishing in a loop?", path=folder)
