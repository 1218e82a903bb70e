"""Plugin fault injection (issue 29, item 3): real dist-info plugins whose import or probe sleeps,
exits, raises KeyboardInterrupt or returns malformed values. None of them may hang or end the
process; each is recorded as a broken plugin with its reason, shown by ``musecore doctor``; and
``device="cpu"`` never imports them at all."""

import json
import re
import sys
import time

import pytest

import musecore
from musecore.api import resolve_device
from musecore.backends.registry import TIMEOUT_ENV, BackendError, discover, get_backend_class, unavailable_reason
from musecore.cli import main
from tests.unit.test_plugins import install_plugin

TIMEOUT = 0.5  # seconds given to each import and probe in these tests
SLACK = 5.0    # seconds a command may take beyond the timeouts it waits for (2 shared CPU cores)

BACKEND = '''
import sys, time
from musecore.backends.base import Backend, Probe, Support
{at_import}

class FaultBackend(Backend):
    name = "{name}"
    api_version = (1, 0)
    def probe(self):
{probe}
    def supports(self, op, spec):
        return Support.no("fault-injection plugin runs nothing")
'''
GOOD_PROBE = '        return Probe(available=True, score=1000, devices=["cpu"], reason="fault test")'
FAULTS = {  # name -> (code run at import, body of probe(), what the recorded error must say)
    "sleepyprobe": ("", "        time.sleep(30)", f"probe\\(\\) did not return within {TIMEOUT:g} s"),
    "sleepyimport": ("time.sleep(30)", GOOD_PROBE, f"importing .* did not return within {TIMEOUT:g} s"),
    "exitimport": ("sys.exit(3)", GOOD_PROBE, "failed to import: SystemExit: 3"),
    "interruptprobe": ("", "        raise KeyboardInterrupt", "probe\\(\\) raised KeyboardInterrupt"),
    "dictprobe": ("", '        return {"available": True, "score": 1000, "devices": ["cpu"]}',
                  "returned a dict, not a musecore.backends.base.Probe"),
    "stringscore": ("", '        return Probe(available=True, score="1000", devices=["cpu"], reason="x")',
                    "score='1000'; it must be a finite number"),
    "autodevice": ("", '        return Probe(available=True, score=1000, devices=["auto"], reason="x")',
                   "'auto' is what device='auto' resolves to, not a device"),
    "nandevice": ("", '        return Probe(available=True, score=float("nan"), devices=["cpu"], reason="x")',
                  "score=nan"),
    "unknowndevice": ("", '        return Probe(available=True, score=1000, devices=["warp-drive"], reason="x")',
                      "must be a catalog device"),
}


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    """Every fault above installed as its own distribution (module ``<name>_pkg``), timeouts of TIMEOUT s."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT))
    for name, (at_import, probe, _) in FAULTS.items():
        install_plugin(tmp_path, f"{name}_pkg", {name: f"{name}_pkg:FaultBackend"},
                       BACKEND.format(name=name, at_import=at_import, probe=probe))
    yield
    for name in FAULTS:  # a plugin left half-imported must not leak into later tests
        sys.modules.pop(f"{name}_pkg", None)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_fault_is_recorded_as_a_broken_plugin_with_its_reason(faulty, name):
    start = time.perf_counter()
    record = discover()[name]
    loaded, error = record.loaded, record.error
    probe = record.probe
    took = time.perf_counter() - start
    assert not loaded and probe is None, (name, loaded, probe)
    assert error is not None and re.search(FAULTS[name][2], error), (name, error)
    assert "\n" not in error, error
    assert took < 2 * TIMEOUT + SLACK, f"{name}: {took:.2f} s (tolerance {2 * TIMEOUT + SLACK} s)"
    why = unavailable_reason(discover(), name)  # what plan/load say when this backend is asked for
    assert why is not None and re.search(FAULTS[name][2], why), (name, why)
    if "import" in name:  # the class itself is unusable; a probe fault leaves the class importable
        with pytest.raises(BackendError, match="failed to import|did not return"):
            get_backend_class(name)


def test_device_auto_skips_broken_plugins_without_hanging_or_exiting(faulty):
    """Every fault at once: device='auto' waits at most one timeout per hung call, then picks a real
    device (every fault scores 1000, above any real backend, so a leak would show)."""
    start = time.perf_counter()
    name, _ = resolve_device("auto")
    took = time.perf_counter() - start
    assert name in ("cpu", "xeon", "xeon6", "h200", "h100", "b200", "mi355x"), name
    hung = 2  # sleepyprobe, sleepyimport
    assert took < hung * TIMEOUT + SLACK, f"device='auto' took {took:.2f} s (tolerance {hung * TIMEOUT + SLACK} s)"
    again = time.perf_counter()
    resolve_device("auto")  # the hung calls are still running: they are not started (or waited for) again
    assert time.perf_counter() - again < SLACK, f"second call took {time.perf_counter() - again:.2f} s"


def test_device_cpu_imports_no_other_plugin(faulty):
    start = time.perf_counter()
    plan = musecore.plan("muse-tiny", device="cpu")
    model = musecore.load("muse-tiny", device="cpu")
    took = time.perf_counter() - start
    assert plan.backend == "reference" and model.plan.backend == "reference"
    imported = sorted(n for n in FAULTS if f"{n}_pkg" in sys.modules)
    assert imported == [], f"device='cpu' imported {imported}"
    assert took < 30, f"plan + load of muse-tiny took {took:.1f} s"


def test_cli_plan_on_cpu_exits_0_although_a_plugin_calls_sys_exit_at_import(faulty, capsys):
    assert main(["plan", "--model", "muse-tiny", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference"


def test_doctor_lists_every_broken_plugin_with_its_reason(faulty, capsys):
    start = time.perf_counter()
    assert main(["doctor", "--json"]) == 0
    took = time.perf_counter() - start
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name, (_, _, reason) in FAULTS.items():
        assert rows[name]["loaded"] is False, rows[name]
        assert re.search(reason, rows[name]["error"]), (name, rows[name]["error"])
    assert rows["reference"]["loaded"] is True
    assert took < 2 * TIMEOUT + SLACK, f"doctor took {took:.2f} s"
    assert main(["doctor"]) == 0  # the table form too
    assert "failed" in capsys.readouterr().out


def test_a_bad_timeout_setting_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))
    install_plugin(tmp_path, "timeoutplug", {"timeoutplug": "timeoutplug:FaultBackend"},
                   BACKEND.format(name="timeoutplug", at_import="", probe=GOOD_PROBE))
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(BackendError, match=f"{TIMEOUT_ENV}='soon' is not a positive number of seconds"):
        discover()["timeoutplug"].loaded


ENV_SETTINGS = BACKEND.replace('''    def supports(self, op, spec):''', '''    def env_settings(self):
{env}
    def supports(self, op, spec):''')


@pytest.mark.parametrize("name,body,reason", [
    ("sleepyenv", "        time.sleep(30)", f"env_settings\\(\\) did not return within {TIMEOUT:g} s"),
    ("exitenv", "        sys.exit(4)", "env_settings\\(\\) raised SystemExit: 4"),
])
def test_doctor_survives_env_settings_that_hang_or_exit(tmp_path, monkeypatch, capsys, name, body, reason):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT))
    install_plugin(tmp_path, f"{name}_pkg", {name: f"{name}_pkg:FaultBackend"},
                   ENV_SETTINGS.format(name=name, at_import="", probe=GOOD_PROBE, env=body))
    start = time.perf_counter()
    assert main(["doctor", "--json"]) == 0
    took = time.perf_counter() - start
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    shown = " ".join(e["value"] or "" for e in rows[name]["env"])
    assert re.search(reason, shown), rows[name]["env"]
    assert took < TIMEOUT + SLACK, f"doctor took {took:.2f} s (tolerance {TIMEOUT + SLACK} s)"
    sys.modules.pop(f"{name}_pkg", None)
