"""A resumed conversion never keeps outputs made from source values that changed since (issue 29, item 2).

The resume journal keys every finished output on the sha256 of the source weights it was made
from (all of them for NVFP4 siblings and fused experts), and the resume key covers the options
and the code version; the tests kill a conversion (an injected crash, or SIGKILL of a real
process), change source values without changing any size, rerun, and compare the result byte for
byte with a fresh conversion of the changed source.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import musecore_quant.convert as convert_module
from musecore_quant.checkpoint import verify_checkpoint
from musecore_quant.convert import convert
from test_checkpoint_helpers import MUSE_EXPERT_RULE, PREFIX, bf16_checkpoint  # noqa: F401

KWARGS = dict(include=[MUSE_EXPERT_RULE], progress=False, max_shard_bytes=200_000)
GATE = PREFIX + "layers.1.mlp.experts.0.gate_proj.weight"


def _crash_after(monkeypatch, calls):
    original, count = convert_module._Converter._add, {"n": 0}

    def add(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise RuntimeError("simulated crash")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(convert_module._Converter, "_add", add)


def _journaled_weights(partial: Path) -> set[str]:
    names = set()
    for line in (partial / "journal.jsonl").read_text().splitlines()[1:]:
        try:
            names.update(r["name"] for r in json.loads(line)["weights"])
        except json.JSONDecodeError:  # a line being written right now
            break
    return names


def _change_values_keep_sizes(src: Path, name: str) -> None:
    """Rewrite the shard holding ``name`` with that tensor's values changed: same dtype, shape and file size."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    size = shard.stat().st_size
    tensors = load_file(str(shard))
    tensors[name] = (tensors[name].float() * -3.0 + 0.01).to(tensors[name].dtype)
    save_file(tensors, str(shard))
    assert shard.stat().st_size == size


def _same_bytes(a: Path, b: Path) -> None:
    """Every shard, the index and the configs are identical (the report holds timings, so it is left out)."""
    names = sorted(p.name for p in a.iterdir() if p.name != "conversion_report.json")
    assert names == sorted(p.name for p in b.iterdir() if p.name != "conversion_report.json")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs from a fresh conversion"


@pytest.mark.parametrize("to", ["nvfp4", "mxfp4"])
def test_changed_source_values_between_crash_and_resume_are_reconverted(tmp_path, bf16_checkpoint, monkeypatch, to):
    src, _ = bf16_checkpoint
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError, match="simulated crash"):
            convert(src, tmp_path / "out", to=to, **KWARGS)
    partial = next(tmp_path.glob("out.partial-*"))
    assert GATE in _journaled_weights(partial), "the weight changed below was finished before the crash"

    _change_values_keep_sizes(src, GATE)
    report = convert(src, tmp_path / "out", to=to, **KWARGS)
    assert report.resumed_weights < 60, "the shard made from the old values, and every later one, is redone"
    convert(src, tmp_path / "fresh", to=to, **KWARGS)
    _same_bytes(tmp_path / "out", tmp_path / "fresh")
    assert verify_checkpoint(tmp_path / "out").ok


def test_unchanged_source_still_resumes(tmp_path, bf16_checkpoint, monkeypatch):
    src, _ = bf16_checkpoint
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError):
            convert(src, tmp_path / "out", to="nvfp4", **KWARGS)
    done = _journaled_weights(next(tmp_path.glob("out.partial-*")))
    report = convert(src, tmp_path / "out", to="nvfp4", **KWARGS)
    assert report.resumed_weights == len(done) > 0
    convert(src, tmp_path / "fresh", to="nvfp4", **KWARGS)
    _same_bytes(tmp_path / "out", tmp_path / "fresh")


def test_nvfp4_sibling_change_redoes_the_sibling_that_shares_its_scale(tmp_path, bf16_checkpoint, monkeypatch):
    """gate and up share weight_scale_2: a changed up must also redo a finished gate."""
    src, _ = bf16_checkpoint
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError):
            convert(src, tmp_path / "out", to="nvfp4", **KWARGS)
    _change_values_keep_sizes(src, GATE.replace("gate_proj", "up_proj"))
    convert(src, tmp_path / "out", to="nvfp4", **KWARGS)
    convert(src, tmp_path / "fresh", to="nvfp4", **KWARGS)
    _same_bytes(tmp_path / "out", tmp_path / "fresh")


def test_resume_key_covers_the_code_version(tmp_path, bf16_checkpoint, monkeypatch):
    src, _ = bf16_checkpoint
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError):
            convert(src, tmp_path / "out", to="fp8", **KWARGS)
    monkeypatch.setattr(convert_module, "code_version", lambda: "another-version")
    report = convert(src, tmp_path / "out", to="fp8", **KWARGS)
    assert report.resumed_weights == 0
    assert any("partial conversion with other arguments" in w for w in report.warnings)


_CHILD = textwrap.dedent("""
    import sys, time
    import musecore_quant.convert as c
    from musecore_quant.convert import convert
    original = c._Converter._add
    def slow_add(self, *a, **k):
        time.sleep(0.02)   # slow enough to be killed mid-way, after some shards are finished
        return original(self, *a, **k)
    c._Converter._add = slow_add
    convert(sys.argv[1], sys.argv[2], to="nvfp4", include=[sys.argv[3]], progress=False, max_shard_bytes=200_000)
""")


@pytest.mark.slow
def test_sigkill_then_changed_source_then_rerun_equals_a_fresh_conversion(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(convert_module.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(script), str(src), str(tmp_path / "out"), MUSE_EXPERT_RULE], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        partial = next(tmp_path.glob("out.partial-*"), None)
        if partial is not None and (partial / "journal.jsonl").exists() and GATE in _journaled_weights(partial):
            break
        time.sleep(0.05)
    assert child.poll() is None, "the child finished before it could be killed; slow it down"
    child.send_signal(signal.SIGKILL)
    child.wait()
    _change_values_keep_sizes(src, GATE)
    convert(src, tmp_path / "out", to="nvfp4", **KWARGS)
    convert(src, tmp_path / "fresh", to="nvfp4", **KWARGS)
    _same_bytes(tmp_path / "out", tmp_path / "fresh")
    assert verify_checkpoint(tmp_path / "out").ok


@pytest.mark.slow
def test_random_sigkills_then_rerun_is_byte_identical_to_a_fresh_conversion(tmp_path, bf16_checkpoint):
    """Three SIGKILLs at random moments (seeded), each followed by a rerun that is killed again, then a
    rerun to the end: the result equals a conversion never interrupted, byte for byte, and verifies."""
    import random
    src, _ = bf16_checkpoint
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(convert_module.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(29)
    killed = 0
    for _ in range(3):
        child = subprocess.Popen([sys.executable, str(script), str(src), str(tmp_path / "out"), MUSE_EXPERT_RULE],
                                 env=env)
        time.sleep(rng.uniform(0.5, 2.5))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            killed += 1
        child.wait(timeout=120)
    assert killed >= 1, "every child finished before its kill; slow the child down"
    out = tmp_path / "out"
    assert not out.exists() or verify_checkpoint(out).ok, "a killed conversion left a folder that looks complete"
    convert(src, out, to="nvfp4", **KWARGS)
    convert(src, tmp_path / "fresh", to="nvfp4", **KWARGS)
    _same_bytes(out, tmp_path / "fresh")
    assert verify_checkpoint(out).ok
