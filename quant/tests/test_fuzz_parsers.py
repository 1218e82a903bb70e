"""Fuzzing the parsers that read untrusted checkpoint files (issue 29): every input parses or raises
``CheckpointError``; never another exception, never a hang.

Parsers: the safetensors header (``read_header``; whatever it accepts, the safetensors library must
read too), the index (``model.safetensors.index.json`` through ``open_checkpoint`` and
``verify_checkpoint``) and the quantization configs (ModelOpt with ``hf_quant_config.json``, Quark,
AutoRound/GPTQ/AWQ, compressed-tensors, GPT-OSS, FP8) through ``open_checkpoint`` on folders holding
each producer's tensors.

Each example runs under a wall-clock deadline (``SIGALRM``; a hang is a failure). The CI budget is
``MAX_EXAMPLES`` per parser (the file runs well under a minute on 2 cores); a longer run is opt-in:

    MUSECORE_FUZZ_EXAMPLES=20000 MUSECORE_FUZZ_REPORT=fuzz.json python -m pytest -q quant/tests/test_fuzz_parsers.py

``MUSECORE_FUZZ_REPORT`` writes the counts (tried / parsed / clean error / crash / hang) per parser.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import struct
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from musecore_quant import quantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.safetensors_io import SAFETENSORS_DTYPES, read_header
from musecore_quant.formats.int4 import int4_to_gptq

MAX_EXAMPLES = int(os.environ.get("MUSECORE_FUZZ_EXAMPLES", "150"))
DEADLINE_S = float(os.environ.get("MUSECORE_FUZZ_DEADLINE_S", "10"))
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=MAX_EXAMPLES <= 150,
                suppress_health_check=list(HealthCheck))
COUNTS: dict[str, Counter] = {}


class Hang(BaseException):
    """Raised by the per-example alarm; a BaseException so that no parser can swallow it."""


def _on_alarm(signum, frame):
    raise Hang(f"example took longer than {DEADLINE_S} s")


def _report() -> None:
    path = os.environ.get("MUSECORE_FUZZ_REPORT")
    if path and COUNTS:
        Path(path).write_text(json.dumps({k: dict(v) for k, v in COUNTS.items()}, indent=2) + "\n")


atexit.register(_report)


def run_example(parser: str, call) -> None:
    """Run ``call()`` under the deadline; count the outcome; anything but success or CheckpointError fails."""
    counts = COUNTS.setdefault(parser, Counter())
    counts["tried"] += 1
    if counts["tried"] % 500 == 0:
        _report()  # a long run stopped early still leaves its counts
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        call()
        counts["parsed"] += 1
    except CheckpointError:
        counts["clean_error"] += 1
    except Hang:
        counts["hang"] += 1
        raise
    except Exception:
        counts["crash"] += 1
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------ JSON strategies
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12), st.sampled_from(["\ud800", "NaN", "..", "/etc/passwd", "x" * 300]))
json_values = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)


def _deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a": ' * depth + "1" + "}" * depth)


def _dump(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


def _mutate(raw: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    data = bytearray(raw)
    for pos, byte in edits:
        if data:
            data[pos % len(data)] = byte
    return bytes(data[:cut] if cut is not None else data)


# ------------------------------------------------------------------------------ safetensors header
_dims = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**64 + 1, -1]),
                  st.floats(0, 4), st.text(max_size=2), st.none())
_entries = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(sorted(SAFETENSORS_DTYPES) + ["F4", "E8M0", "bf16", ""]), json_values),
     "shape": st.one_of(st.lists(_dims, max_size=4), json_values),
     "data_offsets": st.one_of(st.lists(st.integers(-1, 80), min_size=2, max_size=2),
                               st.lists(st.integers(0, 2**64 + 2), max_size=3), json_values)},
    optional={"extra": json_values})
_headers = st.dictionaries(st.one_of(st.text(max_size=6), st.just("__metadata__")),
                           st.one_of(_entries, json_values), max_size=4)


@st.composite
def safetensors_files(draw) -> bytes:
    kind = draw(st.sampled_from(["structured", "valid", "mutated", "deep", "bytes"]))
    data = draw(st.binary(max_size=64))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        raw = _deep(draw(st.integers(500, 200_000)), draw(st.sampled_from(["list", "dict"]))).encode()
    elif kind == "valid":  # a real file, then mutated below or not
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        dtype = draw(st.sampled_from(sorted(SAFETENSORS_DTYPES)))
        n = 1
        for s in shape:
            n *= s
        n *= SAFETENSORS_DTYPES[dtype][1]
        meta = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.one_of(st.text(max_size=4),
                                                                                         json_values), max_size=2)))
        header = {"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}}
        if meta is not None:
            header["__metadata__"] = meta
        raw, data = _dump(header), bytes(n)
    else:
        raw = _dump(draw(_headers))
    if kind == "mutated" or draw(st.booleans()):
        raw = _mutate(raw, draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3)),
                      draw(st.one_of(st.none(), st.integers(0, len(raw)))))
    declared = draw(st.one_of(st.just(len(raw)), st.integers(0, len(raw) + 16), st.sampled_from([2**63, 2**64 - 1])))
    return struct.pack("<Q", declared) + raw + data


@FUZZ
@given(safetensors_files())
def test_fuzz_safetensors_header(blob):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(blob)

        def parse():
            tensors = read_header(path)
            # what we accept, the library reads: no SafetensorError later, in verify or a load
            with safe_open(str(path), framework="pt") as f:
                for key in tensors:
                    f.get_tensor(key)

        run_example("safetensors header", parse)


# ------------------------------------------------------------------------------ index
_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
_KEYS = ("a.weight", "b.weight")


def _base_folder(root: Path) -> Path:
    folder = root / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for key, shard in zip(_KEYS, _SHARDS):
        save_file({key: torch.ones(4, 4, dtype=torch.bfloat16)}, str(folder / shard))
    (folder / "model.bin").write_bytes(b"pickle")
    (folder / "loop.safetensors").symlink_to(folder / "loop.safetensors")
    (folder / "out.safetensors").symlink_to("/etc/hostname")
    return folder


_shard_names = st.one_of(st.sampled_from(list(_SHARDS) + ["missing.safetensors", "../x.safetensors",
                                                          "/abs.safetensors", "model.bin", "loop.safetensors",
                                                          "out.safetensors", "x" * 300 + ".safetensors", "",
                                                          "sub/../model-00001-of-00002.safetensors", "\ud800"]),
                         json_values)


@st.composite
def index_files(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "valid", "structured", "structured", "random", "deep", "mutated"]))
    if kind == "deep":
        return ('{"weight_map": ' + _deep(draw(st.integers(500, 100_000)), "list") + "}").encode()
    if kind == "random":
        return _dump(draw(json_values))
    weight_map = dict(zip(_KEYS, _SHARDS)) if kind == "valid" else draw(st.one_of(
        st.dictionaries(st.one_of(st.sampled_from(_KEYS + ("c.weight",)), st.text(max_size=4)), _shard_names,
                        max_size=4),
        json_values))
    index = {"weight_map": weight_map}
    if draw(st.booleans()):
        index["metadata"] = draw(st.one_of(json_values, st.fixed_dictionaries(
            {"sha256": st.one_of(json_values, st.dictionaries(st.sampled_from(_SHARDS), json_values))})))
    raw = _dump(index)
    if kind == "mutated":
        raw = _mutate(raw, draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3)),
                      draw(st.one_of(st.none(), st.integers(0, len(raw)))))
    return raw


@pytest.fixture(scope="module")
def index_folder(tmp_path_factory):
    return _base_folder(tmp_path_factory.mktemp("index"))


@FUZZ
@given(raw=index_files())
def test_fuzz_index(index_folder, raw):
    (index_folder / "model.safetensors.index.json").write_bytes(raw)

    def parse():
        report = verify_checkpoint(index_folder)  # collects problems; must not raise
        assert isinstance(report.ok, bool)
        open_checkpoint(index_folder).close()

    run_example("index", parse)


# ------------------------------------------------------------------------------ quantization configs
MOD = "model.layers.1.mlp.experts.0.up_proj"


def _producer_tensors() -> dict[str, dict[str, torch.Tensor]]:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    nv, mx, fp8 = quantize(w, "nvfp4"), quantize(w, "mxfp4"), quantize(w, "fp8")
    gptq = int4_to_gptq(quantize(w, "int4", group_size=64))
    plain = {"model.layers.1.self_attn.q_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16),
             "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    return {
        "nvfp4": {**plain, f"{MOD}.weight": nv.data, f"{MOD}.weight_scale": nv.scale,
                  f"{MOD}.weight_scale_2": nv.global_scale, f"{MOD}.input_scale": torch.tensor(0.01)},
        "mxfp4": {**plain, f"{MOD}.weight": mx.data, f"{MOD}.weight_scale": mx.scale},
        "fp8": {**plain, f"{MOD}.weight": fp8.data, f"{MOD}.weight_scale": fp8.scale},
        "int4": {**plain, **{f"{MOD}.{k}": v for k, v in gptq.items()}},
        "ct-nvfp4": {**plain, f"{MOD}.weight_packed": nv.data, f"{MOD}.weight_scale": nv.scale,
                     f"{MOD}.weight_global_scale": (1 / nv.global_scale).reshape(1)},
        "plain": plain,
    }


_METHODS = ["modelopt", "modelopt_fp4", "quark", "auto-round", "auto_round", "gptq", "awq", "compressed-tensors",
            "mxfp4", "fp8", "unknown"]
_KNOWN = {
    "quant_algo": st.sampled_from(["NVFP4", "W4A16_NVFP4", "FP8", "MIXED_PRECISION", "INT8"]),
    "group_size": st.sampled_from([16, 32, 64, 128, -1, 0, "16"]),
    "ignore": st.lists(st.sampled_from(["lm_head", "re:.*q_proj", "*q_proj", "re:(", MOD]), max_size=3),
    "exclude_modules": st.lists(st.sampled_from(["lm_head", "*q_proj", "re:[", MOD]), max_size=3),
    "exclude": st.lists(st.sampled_from(["lm_head", "re:.*q_proj", MOD]), max_size=3),
    "quantized_layers": st.dictionaries(st.sampled_from([MOD, "x"]), st.fixed_dictionaries(
        {"quant_algo": st.sampled_from(["NVFP4", "FP8", "bad"])}, optional={"group_size": st.sampled_from([16, 8])}),
        max_size=2),
    "global_quant_config": st.fixed_dictionaries({"weight": st.fixed_dictionaries(
        {"dtype": st.sampled_from(["fp4", "fp8_e4m3", "int4"])},
        optional={"group_size": st.sampled_from([32, 16]), "scale_format": st.sampled_from(["e8m0", "fp8"])})}),
    "packing_format": st.sampled_from(["auto_round:auto_gptq", "auto_round", "auto_awq", "bogus"]),
    "bits": st.sampled_from([4, 8, "4"]),
    "sym": st.booleans(),
    "data_type": st.sampled_from(["int", "fp"]),
    "checkpoint_format": st.sampled_from(["gptq", "gptq_v2", "marlin"]),
    "version": st.sampled_from(["gemm", "gemv"]),
    "extra_config": st.dictionaries(st.sampled_from([MOD, "re:.*"]), st.fixed_dictionaries(
        {}, optional={"group_size": st.sampled_from([64, 128, -1]), "bits": st.sampled_from([4, 16])}), max_size=2),
    "format": st.sampled_from(["nvfp4-pack-quantized", "float-quantized", "pack-quantized", "dense"]),
    "config_groups": st.dictionaries(st.text(max_size=3), st.fixed_dictionaries(
        {}, optional={"format": st.sampled_from(["nvfp4-pack-quantized", "int-quantized"]),
                      "weights": st.fixed_dictionaries({}, optional={"num_bits": st.sampled_from([4, 8]),
                                                                     "type": st.sampled_from(["float", "int"]),
                                                                     "group_size": st.sampled_from([16, 32])})}),
        max_size=2),
    "dynamic": st.dictionaries(st.text(max_size=3), json_values, max_size=1),
}


@st.composite
def quant_configs(draw):
    qc = {"quant_method": draw(st.one_of(st.sampled_from(_METHODS), json_values))}
    for key in draw(st.lists(st.sampled_from(sorted(_KNOWN)), max_size=6, unique=True)):
        qc[key] = draw(st.one_of(_KNOWN[key], _KNOWN[key], json_values))  # mostly meaningful, sometimes junk
    if draw(st.integers(0, 9)) == 0:
        qc = draw(json_values)
    hf_quant = None
    if draw(st.booleans()):
        section = {k: v for k, v in qc.items() if k in ("quant_algo", "group_size", "exclude_modules",
                                                         "quantized_layers")} if isinstance(qc, dict) else {}
        hf_quant = draw(st.one_of(
            st.just({"producer": {"name": "modelopt"}, "quantization": section}),
            st.fixed_dictionaries({"producer": json_values, "quantization": st.one_of(st.just(section), json_values)}),
            json_values))
    config = {"model_type": "x"}
    if draw(st.integers(0, 5)):
        config["quantization_config"] = qc
    if draw(st.integers(0, 20)) == 0:
        config = draw(json_values)
    return draw(st.sampled_from(sorted(_producer_tensors.cache))), config, hf_quant


_producer_tensors.cache = _producer_tensors()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def producer_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("producers")
    folders = {}
    for name, tensors in _producer_tensors.cache.items():  # type: ignore[attr-defined]
        folder = root / name
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        folders[name] = folder
    return folders


@FUZZ
@given(case=quant_configs())
def test_fuzz_quantization_configs(producer_folders, case):
    layout, config, hf_quant = case
    folder = producer_folders[layout]
    (folder / "config.json").write_bytes(_dump(config))
    hf_path = folder / "hf_quant_config.json"
    if hf_quant is None:
        hf_path.unlink(missing_ok=True)
    else:
        hf_path.write_bytes(_dump(hf_quant))

    def parse():
        with open_checkpoint(folder) as ckpt:
            for name in ckpt.weight_names():
                ckpt.read(name)

    run_example("quantization config", parse)
