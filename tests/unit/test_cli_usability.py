"""The command line's rough edges from issue 27: python -m, --version, suggestions for typos,
-v/--quiet through logging, tables that print data literally and are not cut when piped,
doctor --json naming each backend's distribution."""

import json
import logging
import subprocess
import sys

import pytest

from musecore.backends.registry import PluginRecord
from musecore.cli import main, version


def test_python_dash_m_runs_the_cli_and_prints_the_version():
    run = subprocess.run([sys.executable, "-m", "musecore", "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"musecore {version()}" and version()[0].isdigit(), run.stdout


def test_a_mistyped_option_suggests_the_closest_one(capsys):
    assert main(["plan", "--devcie", "h200"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized argument '--devcie'; did you mean --device?" in err, err
    assert main(["generate", "--max-new-tokes=3"]) == 2
    assert "did you mean --max-new-tokens?" in capsys.readouterr().err


def test_a_mistyped_command_suggests_the_closest_one(capsys):
    assert main(["genrate", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'genrate'; did you mean generate?" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, level", [([], logging.WARNING), (["-v"], logging.INFO), (["-vv"], logging.DEBUG),
                                         (["--quiet"], logging.ERROR)])
def test_verbosity_sets_the_musecore_log_level_before_or_after_the_command(argv, level, capsys):
    for order in (argv + ["devices", "--json"], ["devices", "--json"] + argv):
        assert main(order) == 0
        assert logging.getLogger("musecore").level == level, order
    capsys.readouterr()


def test_verbose_load_logs_what_it_loads(capsys):
    assert main(["generate", "-v", "--device", "cpu", "--prompt", "x", "--max-new-tokens", "1", "--json"]) == 0
    assert "musecore.load: INFO: loaded muse-tiny on cpu" in capsys.readouterr().err


def test_debug_shows_the_traceback_instead_of_one_line():
    from musecore.cli import UsageError

    with pytest.raises(UsageError, match="no checkpoint folder"):
        main(["--debug", "plan", "--model", "./no/such/folder"])


def test_piped_tables_keep_every_column():
    run = subprocess.run([sys.executable, "-m", "musecore", "devices"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout, run.stdout
    header = next(line for line in run.stdout.splitlines() if "device" in line and "backend" in line)
    for column in ("arch", "memory", "weights", "activations", "NVFP4 checkpoint", "BF16 checkpoint"):
        assert column in header, header


def test_doctor_prints_bracketed_text_literally(monkeypatch, capsys):
    import musecore.backends.registry as registry

    broken = PluginRecord("fake", "fake_pkg:Backend", "fake-dist",
                          error="flags [avx512f, amx_bf16] are [bold]absent[/]")
    monkeypatch.setattr(registry, "discover", lambda *a, **k: {"fake": broken})
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "flags [avx512f, amx_bf16] are [bold]absent[/]" in out, out


def test_doctor_json_names_the_distribution_of_every_backend(capsys):
    assert main(["doctor", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and all(r["distribution"] for r in records), [(r["name"], r["distribution"]) for r in records]
    assert {r["name"]: r["distribution"] for r in records}["reference"] == "musecore"


def test_doctor_says_where_every_first_party_backend_has_run(capsys):
    assert main(["doctor", "--json"]) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if r["distribution"].startswith("musecore")]
    assert records and all(r["verified_on"] for r in records if r["loaded"]), [(r["name"], r["verified_on"])
                                                                              for r in records]
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "real hardware each backend's kernels have run on" in out, out
    assert all(r["verified_on"] in out for r in records), out


def test_doctor_shows_an_unstated_or_malformed_verified_on_as_such(monkeypatch, capsys):
    import musecore.backends.registry as registry
    from musecore.backends.base import Backend, Probe

    class Silent(Backend):
        name = "silent"

        def probe(self) -> Probe:
            return Probe(False, reason="no device")

    class Malformed(Silent):
        name = "malformed"
        verified_on = 3  # type: ignore[assignment]

    fakes = {cls.name: PluginRecord(cls.name, f"fake:{cls.__name__}", "fake-dist", backend_class=cls)
             for cls in (Silent, Malformed)}
    monkeypatch.setattr(registry, "discover", lambda *a, **k: fakes)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "not stated by the plugin (Backend.verified_on)" in out, out
    assert "(malformed verified_on: int, not a string)" in out, out
    assert main(["doctor", "--json"]) == 0
    said = {r["name"]: r["verified_on"] for r in json.loads(capsys.readouterr().out)}
    assert said == {"silent": "", "malformed": "(malformed verified_on: int, not a string)"}, said


def test_readme_quotes_the_verified_on_lines_as_doctor_prints_them(capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| backend | verified on |"):].split("\n\n", 1)[0].splitlines()[2:]
    quoted = dict(row.strip("| ").split(" | ", 1) for row in table)
    assert main(["doctor", "--json"]) == 0
    said = {r["name"]: r["verified_on"] for r in json.loads(capsys.readouterr().out) if r["loaded"]}
    assert quoted and {name: said.get(name) for name in quoted} == quoted, (quoted, said)
