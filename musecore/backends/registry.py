"""Discovering backend plugins through the ``musecore.backends`` entry-point group.

Discovery never swallows an error, and no plugin can take core down:

- **lazy**: :func:`discover` only lists the entry points (package metadata, nothing imported); a
  plugin is imported and probed the first time its record is asked about, so ``device="cpu"``
  (the reference) never imports another plugin, and ``device="xeon"`` imports only ``xeon``.
- **isolated**: a plugin's import and its ``probe()`` each run in a worker thread with a timeout
  (:data:`TIMEOUT_ENV`, default :data:`DEFAULT_TIMEOUT_S` seconds). Anything they raise,
  ``SystemExit`` and ``KeyboardInterrupt`` included, is caught; a call that does not return in time
  is left running in the background (Python cannot stop a thread) and never retried in this process.
- **validated**: ``probe()`` must return a :class:`~musecore.backends.base.Probe` with a bool
  ``available``, a finite number ``score``, a list of device-name strings (never ``"auto"``; the
  first one, which ``device="auto"`` picks, a catalog device) and a str ``reason``.

A plugin that fails any of this (or fails to import, declares another major API version, or shares
its name with another plugin) is recorded as broken with the reason and traceback, shown by
``musecore doctor``, and raised with that cause when somebody asks for that backend. What a thread
cannot contain: a plugin that calls ``os._exit`` or crashes the interpreter in C code at import.
"""

from __future__ import annotations

import math
import os
import threading
import traceback
from typing import Any, Callable, Optional

from musecore.backends.base import API_VERSION, Backend, Probe

GROUP = "musecore.backends"
TIMEOUT_ENV = "MUSECORE_PLUGIN_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0
# (entry-point name, target) -> what is still running in a thread that timed out: never started twice.
_STUCK: dict[tuple[str, str], tuple[str, threading.Thread]] = {}


class BackendError(RuntimeError):
    """A backend was asked for that is not installed, failed to load, or is not usable here."""


def timeout_s() -> float:
    """Seconds a plugin's import, and separately its ``probe()``, may take (``$MUSECORE_PLUGIN_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise BackendError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it (default "
                           f"{DEFAULT_TIMEOUT_S:g}) or set e.g. {TIMEOUT_ENV}=30")
    return value


class Isolated:
    """The outcome of :func:`call_isolated`: ``value``, or ``error`` (one line) and ``traceback``."""

    def __init__(self, value: Any = None, error: Optional[str] = None, tb: Optional[str] = None) -> None:
        self.value, self.error, self.traceback = value, error, tb


def call_isolated(fn: Callable[[], Any], what: str, key: Optional[tuple[str, str]] = None) -> Isolated:
    """Run third-party code ``fn()`` in a daemon thread for at most :func:`timeout_s` seconds, catching
    every ``BaseException``. ``what`` names the call in messages ("backend 'x': probe()"); ``key``
    remembers a call that timed out so that it is not started again while it still runs."""
    if key is not None and key in _STUCK and _STUCK[key][1].is_alive():
        return Isolated(error=f"{what} is still running since an earlier call ({_STUCK[key][0]}); restart the "
                              "process or fix the plugin")
    limit = timeout_s()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # SystemExit, KeyboardInterrupt too: third-party code must not end ours
            box["error"] = err

    thread = threading.Thread(target=run, name=f"musecore-plugin: {what}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        why = f"{what} did not return within {limit:g} s"
        if key is not None:
            _STUCK[key] = (why, thread)
        return Isolated(error=f"{why} (it is left running in the background); fix or uninstall the plugin, or "
                              f"raise {TIMEOUT_ENV} if it is only slow")
    if "error" in box:
        err = box["error"]
        return Isolated(error=f"{what} raised {type(err).__name__}: {err}",
                        tb="".join(traceback.format_exception(err)))
    return Isolated(box.get("value"))


class _Loaded:
    """An attribute of a :class:`PluginRecord` that imports the plugin first, on read and on write (kept
    in ``_<name>``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, record: Any, owner: Optional[type] = None) -> Any:
        if record is None:
            return self
        record._load()
        return getattr(record, self.slot)

    def __set__(self, record: Any, value: Any) -> None:
        record._load()
        setattr(record, self.slot, value)


class PluginRecord:
    """One entry point of the group: loaded (``backend_class``) or broken (``error``), and its probe.

    Built by :func:`discover` from the entry point alone; the import happens on first use of
    ``backend_class``, ``error``, ``traceback``, ``loaded`` or ``probe`` (and the probe on first use
    of ``probe``, or of the others when discovered with ``probe=True``). Built with ``backend_class``
    (tests, a backend's own tools), it is loaded as given.
    """

    def __init__(self, name: str, target: str, distribution: str = "", backend_class: Optional[type] = None,
                 error: Optional[str] = None, traceback: Optional[str] = None, probe: Optional[Probe] = None,
                 entry_point: Any = None, probe_on_load: bool = True) -> None:
        self.name, self.target, self.distribution = name, target, distribution
        self._backend_class, self._error, self._traceback, self._probe = backend_class, error, traceback, probe
        self._entry_point = entry_point          # imported on first use when not None
        self._probed = probe is not None or error is not None
        self._probe_on_load = probe_on_load

    # -- lazy state ----------------------------------------------------------------------------

    def _load(self) -> None:
        if self._entry_point is None:
            return
        self._entry_point = None
        done = call_isolated(lambda: load_driver(self.name), f"backend {self.name!r}: importing {self.target}",
                             (self.name, self.target))
        if done.error is not None:
            self._error = done.error.replace(f"importing {self.target} raised", "failed to import:", 1)
            self._traceback = done.traceback
            return
        self._backend_class = done.value
        self._error = _check_api(self.name, done.value)
        if self._probe_on_load:
            self._run_probe()

    def _run_probe(self) -> None:
        self._load()
        if self._probed or self._backend_class is None or self._error is not None:
            return
        self._probed = True
        cls = self._backend_class
        done = call_isolated(lambda: cls().probe(), f"backend {self.name!r}: probe()",
                             (self.name, self.target + " probe"))
        problem = done.error or _check_probe(self.name, done.value)
        if problem is not None:
            self._error, self._traceback = problem, done.traceback
        else:
            self._probe = done.value

    backend_class: Optional[type] = _Loaded()  # type: ignore[assignment]
    error: Optional[str] = _Loaded()  # type: ignore[assignment]
    traceback: Optional[str] = _Loaded()  # type: ignore[assignment]

    @property
    def probe(self) -> Optional[Probe]:
        self._run_probe()
        return self._probe

    @probe.setter
    def probe(self, value: Optional[Probe]) -> None:
        self._load()
        self._probe, self._probed = value, True

    @property
    def imported(self) -> bool:
        """Whether this plugin's module has been imported (or tried) in this process, by this record."""
        return self._entry_point is None

    @property
    def loaded(self) -> bool:
        return self.backend_class is not None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        probe = self.probe
        return {"name": self.name, "target": self.target, "distribution": self.distribution,
                "loaded": self.loaded, "error": self.error, "traceback": self.traceback,
                "api_version": list(getattr(self.backend_class, "api_version", ()) or ()),
                "available": probe.available if probe else False, "score": probe.score if probe else 0,
                "devices": probe.devices if probe else [], "probe": probe.reason if probe else "",
                "verified_on": _verified_on(self.backend_class) if self.loaded else ""}

    def __repr__(self) -> str:
        state = "not imported" if self._entry_point is not None else ("broken" if self._error else "loaded")
        return f"PluginRecord({self.name!r}, {self.target!r}, {self.distribution!r}, {state})"


def _verified_on(cls: type) -> str:
    """The class's ``verified_on`` line; a plugin's malformed one is shown as such, not fatal."""
    said = getattr(cls, "verified_on", "")
    return said if isinstance(said, str) else f"(malformed verified_on: {type(said).__name__}, not a string)"


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


def _check_probe(name: str, probe: Any) -> Optional[str]:
    """None when ``probe`` is a well-formed :class:`Probe`; else why not, in one line."""
    from musecore.devices import CATALOG

    where = f"backend {name!r}: probe() returned"
    if not isinstance(probe, Probe):
        return f"{where} a {type(probe).__name__}, not a musecore.backends.base.Probe; fix the plugin"
    if not isinstance(probe.available, bool):
        return f"{where} available={probe.available!r}; it must be True or False"
    score = probe.score
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score):
        return f"{where} score={score!r}; it must be a finite number (higher wins)"
    devices = probe.devices
    if not isinstance(devices, list) or not all(isinstance(d, str) and d for d in devices):
        return f"{where} devices={devices!r}; it must be a list of device names (musecore devices lists them)"
    if "auto" in devices:
        return f"{where} devices={devices!r}; 'auto' is what device='auto' resolves to, not a device"
    if probe.available and devices and devices[0] not in CATALOG:
        return (f"{where} devices={devices!r}; the first one (what device='auto' picks) must be a catalog "
                f"device: {sorted(CATALOG)}")
    if not isinstance(probe.reason, str):
        return f"{where} reason={probe.reason!r}; it must be a str"
    return None


def load_driver(name: str) -> type:
    """Import the plugin registered as ``name`` (and no other) with stevedore, raising its own error."""
    from stevedore import DriverManager

    def reraise(_manager: Any, _ep: Any, err: BaseException) -> None:
        raise err

    return DriverManager(GROUP, name, invoke_on_load=False, on_load_failure_callback=reraise).driver


def refresh_stevedore() -> None:
    """Have stevedore list the group afresh (plugins installed since the last call are seen) without
    importing any plugin, so that the timed imports (:func:`load_driver`) find its cache warm: a cold
    scan of every ``sys.path`` entry can take longer than a plugin is given."""
    from stevedore import NamedExtensionManager

    NamedExtensionManager.ENTRY_POINT_CACHE.pop(GROUP, None)
    NamedExtensionManager(GROUP, names=[], invoke_on_load=False)


def discover(probe: bool = True) -> dict[str, PluginRecord]:
    """Every plugin registered under ``musecore.backends``: a record per entry point (listed with
    ``importlib.metadata``, which imports nothing), importing nothing until a record is used (then that
    plugin alone is imported, through stevedore's ``DriverManager``, and probed when ``probe``).
    Plugins installed since the last call are seen."""
    from importlib.metadata import entry_points

    timeout_s()  # a bad $MUSECORE_PLUGIN_TIMEOUT is one error here, not one per probe thread later
    refresh_stevedore()
    records: dict[str, PluginRecord] = {}
    targets: dict[str, list[str]] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", "") or ""
        listed = f"{ep.value} ({dist or 'unknown distribution'})"
        if listed in targets.get(ep.name, []):
            continue  # one distribution seen twice on sys.path (an editable install and its folder)
        targets.setdefault(ep.name, []).append(listed)
        records[ep.name] = PluginRecord(ep.name, ep.value, dist, entry_point=ep, probe_on_load=probe)
    for name, listed in targets.items():
        if len(listed) > 1:
            records[name] = PluginRecord(name, records[name].target, records[name].distribution,
                                         error=(f"two plugins are registered as backend {name!r}: "
                                                f"{', '.join(listed)}; uninstall one of them"))
    return records


def resolve_all(records: dict[str, PluginRecord]) -> dict[str, PluginRecord]:
    """Import and probe every record at once, one thread each, so that hung plugins cost one timeout
    together rather than one each (``device="auto"`` and ``musecore doctor`` need them all)."""
    timeout_s()  # (checked in this thread: the probe threads would each die of it)
    pending = [r for r in records.values() if not r._probed or r._entry_point is not None]
    threads = [threading.Thread(target=r._run_probe, name=f"musecore-plugin: {r.name}", daemon=True) for r in pending]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # each record's import and probe carry their own timeout (call_isolated)
    return records


def install_hint(backend: str) -> str:
    """How to install a backend package: musecore's own are not published, so from a musecore checkout; another
    name is a third-party plugin (or a typo), installed from wherever its vendor ships it."""
    from musecore.devices import CATALOG

    ours = sorted({profile.backend for profile in CATALOG.values()} - {"reference"})
    if backend in ours:
        return (f"musecore-{backend} is not on PyPI: install it from a musecore checkout with "
                f"`pip install -e ./backends/{backend}`")
    return (f"musecore's own backends are {ours}; {backend!r} would be a third-party plugin: install the package "
            "that provides it (its 'musecore.backends' entry point), or check the name")


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
    resolve_all(records)
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
