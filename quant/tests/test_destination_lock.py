"""One writer per destination, destinations checked before the work, no stray shard verified OK (issue 29, items 4 and 7)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import musecore_quant.convert as convert_module
from musecore_quant.checkpoint import CheckpointError, CheckpointWriter, verify_checkpoint
from musecore_quant.checkpoint.errors import ConversionLockedError
from musecore_quant.cli import main
from musecore_quant.convert import convert
from test_checkpoint_helpers import MUSE_EXPERT_RULE, bf16_checkpoint, muse_config  # noqa: F401

KWARGS = dict(include=[MUSE_EXPERT_RULE], progress=False, max_shard_bytes=200_000)
_HOLDER = textwrap.dedent("""
    import sys, time
    from musecore_quant.checkpoint import CheckpointWriter
    w = CheckpointWriter(sys.argv[1], config={}, format="bf16", resume_key="k")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _env():
    quant_root = str(Path(convert_module.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([quant_root, os.environ.get("PYTHONPATH", "")])}


def _start_holder(tmp_path, dst, seconds=60):
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    child = subprocess.Popen([sys.executable, str(script), str(dst), str(seconds)], stdout=subprocess.PIPE,
                             text=True, env=_env())
    assert child.stdout.readline().strip() == "locked"
    return child


def test_second_conversion_of_one_destination_fails_at_once_naming_the_holder(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    dst = tmp_path / "out"
    holder = _start_holder(tmp_path, dst)
    try:
        started = time.monotonic()
        with pytest.raises(ConversionLockedError, match=rf"another conversion is writing {dst} \(pid {holder.pid}\)"):
            convert(src, dst, to="nvfp4", **KWARGS)
        assert time.monotonic() - started < 30, "non-blocking: the loser does not wait"
        partial = next(tmp_path.glob("out.partial-*"))
        assert {p.name for p in partial.iterdir()} == {".partial", "journal.jsonl"}, "the holder's folder untouched"
    finally:
        holder.kill()
        holder.wait()
    convert(src, dst, to="nvfp4", **KWARGS)  # the lock dies with its process
    assert verify_checkpoint(dst).ok
    assert not (tmp_path / ".out.lock").exists(), "a finished writer removes its lock file"


def test_cli_reports_a_held_destination_in_one_line_with_exit_2(tmp_path, bf16_checkpoint, capsys):
    src, _ = bf16_checkpoint
    dst = tmp_path / "out"
    holder = _start_holder(tmp_path, dst)
    try:
        code = main(["convert", str(src), str(dst), "--to", "fp8", "--no-progress"])
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"another conversion is writing {dst} (pid {holder.pid})" in err


def test_two_concurrent_conversions_one_wins_and_the_result_verifies(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "musecore_quant.cli", "convert", str(src), str(dst), "--to", "mxfp4",
           "--no-progress", "--include", MUSE_EXPERT_RULE, "--max-shard-bytes", "200000"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0, results
    if codes[1] != 0:  # they overlapped: the loser says why, in one line
        loser = next(err for code, err in results if code != 0)
        assert codes[1] == 2 and ("another conversion is writing" in loser or "already exists" in loser), loser
        assert "Traceback" not in loser
    assert verify_checkpoint(dst).ok
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]


def test_stray_unreferenced_shard_fails_verify_naming_it(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    dst = tmp_path / "out"
    convert(src, dst, to="fp8", **KWARGS)
    save_file({"x": torch.zeros(2)}, str(dst / "shard-00007.safetensors"))
    report = verify_checkpoint(dst)
    assert not report.ok
    assert any("shard-00007.safetensors" in p and "references no tensor" in p for p in report.problems), report.problems


def test_dangling_symlink_destination_is_refused_before_any_work(tmp_path, bf16_checkpoint, monkeypatch):
    src, _ = bf16_checkpoint
    dst = tmp_path / "out"
    dst.symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(convert_module._Converter, "run", lambda *a: pytest.fail("no work before the check"))
    with pytest.raises(CheckpointError, match="is a symlink"):
        convert(src, dst, to="fp8", **KWARGS)
    assert not list(tmp_path.glob("out.partial-*"))


def test_destination_under_a_file_is_refused_before_any_work(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        convert(src, tmp_path / "file" / "out", to="fp8", **KWARGS)


def test_include_matching_nothing_is_an_error_and_leaves_no_partial_folder(tmp_path, bf16_checkpoint, capsys):
    src, _ = bf16_checkpoint
    with pytest.raises(CheckpointError, match="no weight matches include"):
        convert(src, tmp_path / "out", to="int4", include=["no-such-weight"], progress=False)
    code = main(["convert", str(src), str(tmp_path / "out"), "--to", "int4", "--include", "zzz", "--no-progress"])
    assert code == 2 and "no weight matches include" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"], "no partial folder, no lock file"


def test_include_everything_with_int4_names_the_weight_and_leaves_nothing_that_looks_complete(
        tmp_path, bf16_checkpoint, capsys):
    """``--include ".*"`` selects the 2-row router too: refused before any work, naming it."""
    src, _ = bf16_checkpoint
    code = main(["convert", str(src), str(tmp_path / "out"), "--to", "int4", "--include", ".*", "--no-progress",
                 "--max-shard-bytes", "200000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot be stored as int4" in err and "router" in err, err
    assert not (tmp_path / "out").exists()
    for partial in tmp_path.glob("out.partial-*"):
        assert (partial / ".partial").exists(), "a partial folder left for resume is marked as such"


def test_failure_before_any_shard_removes_the_partial_folder(tmp_path, bf16_checkpoint, monkeypatch):
    src, _ = bf16_checkpoint

    def boom(*args, **kwargs):
        raise CheckpointError("injected")

    monkeypatch.setattr(convert_module._Converter, "run", boom)
    with pytest.raises(CheckpointError, match="injected"):
        convert(src, tmp_path / "out", to="fp8", **KWARGS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]


def test_writer_lock_is_released_by_close_and_by_abort(tmp_path):
    w = CheckpointWriter(tmp_path / "a", config=muse_config(), format="bf16", resume_key="k")
    with pytest.raises(ConversionLockedError):
        CheckpointWriter(tmp_path / "a", config=muse_config(), format="bf16", resume_key="k")
    w.abort()
    w2 = CheckpointWriter(tmp_path / "a", config=muse_config(), format="bf16", resume_key="k")
    w2.add("x.weight", torch.ones(2, 2))
    w2.close()
    assert json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (tmp_path / ".a.lock").exists()
