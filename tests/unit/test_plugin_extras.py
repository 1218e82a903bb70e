"""What a plugin offers besides its ops: benchmark cases through the ``musecore.benchmarks`` entry-point
group (``musecore bench``), and environment settings that ``musecore doctor`` shows when set."""

import json

import pytest

from musecore.cli import main

BACKEND = '''
from musecore.backends.base import Backend, EnvSetting, Probe, Support

class BenchyBackend(Backend):
    name = "benchy"
    def probe(self):
        return Probe(available=True, devices=["cpu"], reason="test plugin")
    def supports(self, op, spec):
        return Support.no("test plugin runs nothing")
    def env_settings(self):
        import os
        return [EnvSetting("BENCHY_KNOB", os.environ.get("BENCHY_KNOB"), "off", "turns the knob")]
'''

CASES = '''
def benchmarks():
    def square():
        return [{"backend": "benchy", "case": "square", "shape": f"{n}x{n}", "M": n, "time_us": float(n * n),
                 "speedup_vs_bf16": 1.0, "pct_memory_ceiling": 50.0} for n in (2, 3)]
    return {"square": square, "sweep": lambda: 1 / 0}
'''


def install(root, dist: str, groups: dict[str, dict[str, str]], files: dict[str, str]) -> None:
    """A package ``dist`` with ``files`` and a .dist-info declaring ``groups`` of entry points, on sys.path."""
    (root / dist).mkdir()
    for name, body in files.items():
        (root / dist / name).write_text(body)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) for group, entries in groups.items()))


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    return tmp_path / "site"


def test_cases_come_from_the_entry_point_and_the_backend_never_imports_them(root, tmp_path, capsys):
    install(root, "benchy", {"musecore.backends": {"benchy": "benchy:BenchyBackend"},
                             "musecore.benchmarks": {"benchy": "benchy.bench:benchmarks"}},
            {"__init__.py": BACKEND, "bench.py": CASES})
    out = tmp_path / "out"
    assert main(["bench", "--backend", "benchy", "--json", "--out-dir", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["M"] for r in rows] == [2, 3], rows  # 'sweep' is not run by default
    saved = json.loads((out / "benchy_square.json").read_text())
    assert saved["command"] == "musecore bench --backend benchy --case square" and len(saved["rows"]) == 2


def test_a_backend_without_benchmarks_says_so(root, capsys):
    install(root, "nobench", {"musecore.backends": {"nobench": "nobench:BenchyBackend"}}, {"__init__.py": BACKEND})
    assert main(["bench", "--backend", "nobench"]) != 0
    assert "offers no benchmarks" in capsys.readouterr().err


def test_a_broken_benchmark_module_is_named(root, capsys):
    install(root, "badbench", {"musecore.backends": {"badbench": "badbench:BenchyBackend"},
                               "musecore.benchmarks": {"badbench": "badbench.missing:benchmarks"}},
            {"__init__.py": BACKEND})
    assert main(["bench", "--backend", "badbench"]) != 0
    err = capsys.readouterr().err
    assert "failed to load" in err and "badbench.missing" in err, err


def test_an_unknown_case_lists_the_offered_ones(root, capsys):
    install(root, "benchy2", {"musecore.backends": {"benchy2": "benchy2:BenchyBackend"},
                              "musecore.benchmarks": {"benchy2": "benchy2.bench:benchmarks"}},
            {"__init__.py": BACKEND, "bench.py": CASES})
    assert main(["bench", "--backend", "benchy2", "--case", "nope"]) != 0
    assert "['square', 'sweep']" in capsys.readouterr().err


def test_doctor_shows_the_environment_overrides_in_force(root, monkeypatch, capsys):
    install(root, "knobby", {"musecore.backends": {"knobby": "knobby:BenchyBackend"}}, {"__init__.py": BACKEND})
    from musecore.backends.registry import discover
    from musecore.commands.doctor import settings

    for record in discover().values():  # other tests' setup may set some (the Triton tests' TRITON_INTERPRET=1)
        for setting in settings(record):
            monkeypatch.delenv(setting.name, raising=False)
    assert main(["doctor", "--json"]) == 0
    unset = {r["name"]: r["env"] for r in json.loads(capsys.readouterr().out)}["knobby"]
    assert unset == [{"name": "BENCHY_KNOB", "value": None, "default": "off", "effect": "turns the knob"}], unset
    assert main(["doctor"]) == 0
    assert "environment overrides in force" not in capsys.readouterr().out
    monkeypatch.setenv("BENCHY_KNOB", "on")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "environment overrides in force" in out and "BENCHY_KNOB" in out, out


def test_bench_without_the_backends_hardware_says_why_in_one_line(root, capsys):
    absent = BACKEND.replace('Probe(available=True, devices=["cpu"], reason="test plugin")',
                             'Probe(available=False, reason="no benchy card: the driver is not loaded")')
    install(root, "nohw", {"musecore.backends": {"nohw": "nohw:BenchyBackend"},
                           "musecore.benchmarks": {"nohw": "nohw.bench:benchmarks"}},
            {"__init__.py": absent, "bench.py": CASES.replace("for n in (2, 3)", "for n in (1 / 0,)")})
    assert main(["bench", "--backend", "nohw", "--case", "square"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs that backend's hardware" in err and "no benchy card" in err, err
