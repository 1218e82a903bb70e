"""Backend discovery through the musecore.backends entry point, with plugins installed by the test."""

import json
import textwrap

import pytest

from musecore.backends.registry import BackendError, discover, get_backend_class
from musecore.cli import main

PLUGIN = '''
from musecore.backends.base import Backend, Probe, Support

class {cls}(Backend):
    name = "{name}"
    api_version = {version}
    def probe(self):
        return Probe(available=True, score=0, devices=["cpu"], reason="test plugin")
    def supports(self, op, spec):
        return Support.no("test plugin runs nothing")
'''


def install_plugin(root, dist, entries: dict, body: str) -> None:
    """Write a package and its .dist-info (METADATA + entry_points.txt) into ``root`` (on sys.path)."""
    (root / dist).mkdir()
    (root / dist / "__init__.py").write_text(body)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[musecore.backends]\n{lines}\n")


@pytest.fixture
def plugin_root(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_installed_in_the_test_is_discovered_and_probed(plugin_root):
    install_plugin(plugin_root, "goodplug", {"good": "goodplug:GoodBackend"},
                   PLUGIN.format(cls="GoodBackend", name="good", version="(1, 3)"))
    records = discover()
    assert records["good"].loaded and records["good"].probe.reason == "test plugin"
    assert get_backend_class("good").__name__ == "GoodBackend"
    assert records["reference"].loaded  # core's own backend comes through the same entry point


def test_api_major_mismatch_is_rejected_naming_both_versions(plugin_root):
    install_plugin(plugin_root, "futureplug", {"future": "futureplug:FutureBackend"},
                   PLUGIN.format(cls="FutureBackend", name="future", version="(2, 0)"))
    record = discover()["future"]
    assert not record.loaded
    assert "API 2.0" in record.error and "API 1.0" in record.error
    with pytest.raises(BackendError, match="API 2.0"):
        get_backend_class("future")


def test_failing_plugin_is_shown_by_doctor_and_raised_when_requested(plugin_root, capsys):
    install_plugin(plugin_root, "brokenplug", {"broken": "brokenplug:Nope"},
                   "import a_module_that_does_not_exist_anywhere\n")
    assert main(["doctor", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["broken"]["loaded"] is False
    assert "ModuleNotFoundError" in rows["broken"]["error"]
    assert "a_module_that_does_not_exist_anywhere" in rows["broken"]["traceback"]
    with pytest.raises(BackendError, match="failed to import.*a_module_that_does_not_exist_anywhere"):
        get_backend_class("broken")


def test_two_plugins_with_one_name_is_an_error(plugin_root):
    body = PLUGIN.format(cls="TwinBackend", name="twin", version="(1, 0)")
    install_plugin(plugin_root, "twinone", {"twin": "twinone:TwinBackend"}, body)
    install_plugin(plugin_root, "twintwo", {"twin": "twintwo:TwinBackend"}, body)
    with pytest.raises(BackendError, match="two plugins are registered as backend 'twin'"):
        get_backend_class("twin")


def test_unknown_backend_names_what_is_installed():
    with pytest.raises(BackendError, match="not installed.*reference"):
        get_backend_class("quantum")
