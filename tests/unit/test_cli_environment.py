"""Settings from the environment and output places, checked once and said in one line (a QA pass found each
of these as a traceback, a crash or a wrong table)."""

from __future__ import annotations

import pytest

from musecore.cli import main
from musecore.commands.devices import _bits
from musecore.devices import CATALOG


def one_error(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and all(f in lines[0] for f in fragments), err


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_plugin_timeout_is_one_line_not_a_traceback_per_probe_thread(capsys, monkeypatch, value):
    monkeypatch.setenv("MUSECORE_PLUGIN_TIMEOUT", value)
    one_error(capsys, ["doctor"], "MUSECORE_PLUGIN_TIMEOUT")


def test_a_thread_count_past_4x_the_cores_is_refused_before_openmp_crashes(capsys, monkeypatch):
    monkeypatch.setenv("MUSECORE_NUM_THREADS", "100000")
    one_error(capsys, ["generate", "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "1"],
              "MUSECORE_NUM_THREADS=100000", "usable cores")


def test_musecore_debug_0_means_off(capsys, monkeypatch):
    monkeypatch.setenv("MUSECORE_DEBUG", "0")
    one_error(capsys, ["plan", "--device", "nosuch"], "unknown device")


def test_a_file_where_an_output_folder_goes_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    one_error(capsys, ["bench", "--backend", "xeon", "--case", "attention", "--out-dir", str(blocker / "sub")],
              "a file is in the way")


@pytest.mark.parametrize("seq_len", ["0", "-5", "1"])
def test_matrix_seq_len_is_checked_up_front(capsys, seq_len):
    one_error(capsys, ["matrix", "--rows", "cpu", "--tokens", "64", "--op-sizes", "", "--seq-len", seq_len],
              "--seq-len")


def test_matrix_op_sizes_are_checked_before_any_row_runs(capsys):
    one_error(capsys, ["matrix", "--rows", "cpu", "--tokens", "64", "--op-sizes", "tiny,huge"], "huge")


def test_the_devices_table_names_the_bits_loading_leaves():
    assert _bits(CATALOG["h200"].conversion("nvfp4")) == "W4A16"
    assert _bits(CATALOG["b200"].conversion("nvfp4")) == "W4A4"
    assert _bits(CATALOG["h200-fp8"].conversion("nvfp4")) == "W8A8"
    assert _bits(CATALOG["tpu-v6e-int8"].conversion("nvfp4")) == "W8A8"


@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_a_table_into_a_closed_pipe_exits_0(command):
    """rich exits 1 when its reader leaves (``musecore devices | true``); the command line says 0."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "musecore", command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the table is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, (proc.returncode, err.decode()[-2000:])
