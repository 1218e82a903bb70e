"""Progress on musecore's long commands: a bar only on a terminal, one line per stage in a log (no
carriage returns), nothing with --quiet: ``musecore bench`` per case, and loading a checkpoint."""

import re

import musecore
from musecore.cli import main
from musecore.commands import bench


def _fake_cases(_backend):
    return {"linear": lambda: [{"backend": "xeon", "case": "linear", "M": 1, "time_us": 1.5}],
            "e2e": lambda: [{"backend": "xeon", "case": "e2e", "M": 1, "time_us": 2.5}] * 2}


def test_bench_writes_one_line_per_case_to_a_log_and_nothing_with_quiet(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "benchmark_cases", _fake_cases)
    assert main(["bench", "--backend", "xeon", "--out-dir", str(tmp_path), "--json"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 2, repr(err)
    assert re.fullmatch(r"bench xeon linear: 1 row in [\d.]+ s", lines[0]), lines
    assert re.fullmatch(r"bench xeon e2e: 2 row in [\d.]+ s", lines[1]), lines
    assert main(["bench", "--backend", "xeon", "--out-dir", str(tmp_path), "--json", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_loading_a_checkpoint_writes_one_line_to_a_log(capsys):
    musecore.load("muse-tiny", device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^loading: \d+ tensor in [\d.]+ s$", err, re.M), repr(err)
    musecore.load("muse-tiny", device="cpu", progress=False)
    assert "loading" not in capsys.readouterr().err
