"""Discovering backend plugins through the ``musecore.backends`` entry-point group (stevedore).

Discovery never swallows an error: a plugin that fails to import, declares another major API
version, or shares its name with another plugin is recorded with the reason (and traceback), shown
by ``musecore doctor``, and raised with that cause when somebody asks for that backend.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from musecore.backends.base import API_VERSION, Backend, Probe

GROUP = "musecore.backends"


class BackendError(RuntimeError):
    """A backend was asked for that is not installed, failed to load, or is not usable here."""


@dataclass
class PluginRecord:
    name: str
    target: str                      # "module:attr" of the entry point
    distribution: str = ""
    backend_class: Optional[type] = None
    error: Optional[str] = None      # one line: why it is unusable
    traceback: Optional[str] = None
    probe: Optional[Probe] = None

    @property
    def loaded(self) -> bool:
        return self.backend_class is not None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        probe = self.probe
        return {"name": self.name, "target": self.target, "distribution": self.distribution,
                "loaded": self.loaded, "error": self.error, "traceback": self.traceback,
                "api_version": list(getattr(self.backend_class, "api_version", ()) or ()),
                "available": probe.available if probe else False, "score": probe.score if probe else 0,
                "devices": probe.devices if probe else [], "probe": probe.reason if probe else ""}


def _distributions() -> dict[tuple[str, str], str]:
    """(entry-point name, target) -> the distribution that declares it. stevedore's cached entry points
    carry no ``dist``, so ``importlib.metadata`` (whose entry points do) is asked."""
    from importlib.metadata import entry_points

    return {(ep.name, ep.value): ep.dist.name for ep in entry_points(group=GROUP) if ep.dist is not None}


def _check_api(name: str, cls: Any) -> Optional[str]:
    version = getattr(cls, "api_version", None)
    if not isinstance(cls, type) or not issubclass(cls, Backend):
        return f"backend {name!r}: entry point does not name a musecore.backends.base.Backend subclass ({cls!r})"
    if not (isinstance(version, tuple) and len(version) == 2):
        return f"backend {name!r} declares no api_version (a (major, minor) tuple)"
    if version[0] != API_VERSION[0]:
        return (f"backend {name!r} implements musecore backend API {version[0]}.{version[1]}, but this musecore "
                f"speaks API {API_VERSION[0]}.{API_VERSION[1]}; install a {name!r} plugin built for API "
                f"{API_VERSION[0]}.x or a musecore that speaks {version[0]}.x")
    return None


def _probe(record: PluginRecord) -> None:
    try:
        record.probe = record.backend_class().probe()
    except Exception as err:  # a probe must not raise; if it does, that is the plugin's bug, shown as such
        record.error = f"backend {record.name!r}: probe() raised {type(err).__name__}: {err}"
        record.traceback = "".join(traceback.format_exception(err))


def discover(probe: bool = True) -> dict[str, PluginRecord]:
    """Every plugin registered under ``musecore.backends``, loaded or failed, with its probe."""
    from stevedore import ExtensionManager

    failures: dict[str, tuple[str, BaseException]] = {}

    def on_failure(_manager: Any, entry_point: Any, err: BaseException) -> None:
        failures[f"{entry_point.name}={entry_point.value}"] = (entry_point.name, err)

    ExtensionManager.ENTRY_POINT_CACHE.pop(GROUP, None)  # see plugins installed since the last call
    manager = ExtensionManager(GROUP, invoke_on_load=False, on_load_failure_callback=on_failure)
    records: dict[str, PluginRecord] = {}
    duplicates: dict[str, list[str]] = {}
    owners = _distributions()
    for ep in manager.list_entry_points():
        dist = getattr(getattr(ep, "dist", None), "name", "") or owners.get((ep.name, ep.value), "")
        duplicates.setdefault(ep.name, []).append(f"{ep.value} ({dist or 'unknown distribution'})")
        records[ep.name] = PluginRecord(ep.name, ep.value, dist)
    for ext in manager.extensions:
        record = records[ext.name]
        if record.target == ext.entry_point.value:
            record.backend_class = ext.plugin
            record.error = _check_api(ext.name, ext.plugin)
    for key, (name, err) in failures.items():
        record = records[name]
        if key == f"{name}={record.target}":
            record.error = f"backend {name!r} failed to import: {type(err).__name__}: {err}"
            record.traceback = "".join(traceback.format_exception(err))
    for name, targets in duplicates.items():
        if len(targets) > 1:
            records[name].backend_class = None
            records[name].error = (f"two plugins are registered as backend {name!r}: {', '.join(targets)}; "
                                   "uninstall one of them")
    if probe:
        for record in records.values():
            if record.loaded:
                _probe(record)
    return records


def install_hint(backend: str) -> str:
    """How to install a backend package: they are not published, so from a musecore checkout."""
    return (f"musecore-{backend} is not on PyPI: install it from a musecore checkout with "
            f"`pip install -e ./backends/{backend}`")


def unavailable_reason(records: dict[str, PluginRecord], backend: str, device: Optional[str] = None) -> Optional[str]:
    """None when backend ``backend`` is installed, loaded, available here and (when ``device`` is given)
    serving that catalog device; else why not, in one line. The one availability check: ``load``,
    ``plan``, ``resolve_device`` and the matrix all ask it."""
    record = records.get(backend)
    if record is None:
        return f"backend {backend!r} is not installed ({install_hint(backend)})"
    if not record.loaded:
        return f"backend {backend!r} failed to load: {record.error}"
    found = record.probe.reason if record.probe else "not probed"
    if not (record.probe and record.probe.available):
        return f"no {device or backend + ' hardware'} here ({backend} backend: {found})"
    if device is not None and device not in record.probe.devices:
        return f"no {device} here ({backend} backend: {found})"
    return None


def best_device(records: dict[str, PluginRecord]) -> str:
    """The catalog device ``device="auto"`` means: the first device of the highest-scoring available
    backend (the reference backend, always available, serves ``cpu``)."""
    ready = [r for r in records.values() if unavailable_reason(records, r.name) is None and r.probe.devices]
    if not ready:
        raise BackendError("no backend is available here, not even the reference backend; reinstall musecore "
                           f"(installed: {sorted(records) or 'none'})")
    return max(ready, key=lambda r: r.probe.score).probe.devices[0]


def get_backend_class(name: str, records: Optional[dict[str, PluginRecord]] = None) -> type:
    """The class of backend ``name``, or a :class:`BackendError` with the recorded cause."""
    records = discover(probe=False) if records is None else records
    if name not in records:
        raise BackendError(f"backend {name!r} is not installed (installed: {sorted(records) or 'none'}); "
                           f"{install_hint(name)}")
    record = records[name]
    if not record.loaded:
        raise BackendError(record.error + (f"\n{record.traceback}" if record.traceback else ""))
    return record.backend_class
