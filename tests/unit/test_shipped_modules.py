"""What a user installs contains only code some path selects.

Every module of the installed musecore packages must be reachable by imports (top-level or lazy,
inside functions) from a root a user can reach: a package's ``__init__``, an entry point
(``musecore.backends``, ``musecore.benchmarks``, console scripts) or a ``musecore`` subcommand.
A module nothing reaches is lab material and belongs in ``backends/<name>/lab/``.
"""

import ast
import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

import pytest

# Modules users import by name, as the README documents them (besides the packages themselves).
PUBLIC = ("musecore.api", "musecore.calibrate", "musecore.quantize", "musecore.testing", "musecore_triton.testing",
          "musecore.schemas", "musecore_quant.schemas")  # imported by users, not by a command

PACKAGES = ("musecore", "musecore_quant", "musecore_triton", "musecore_cuda", "musecore_xeon", "musecore_rocm",
            "musecore_tpu")


def installed() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            found[pkg] = Path(list(spec.submodule_search_locations)[0])
    return found


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for pkg, root in packages.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if "tests" in parts:
                continue
            name = ".".join((pkg,) + (parts[:-1] if parts[-1] == "__init__" else parts))
            out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:i])
                if prefix in known:
                    found.add(prefix)
    return found


def roots(packages: dict[str, Path], known: dict[str, Path]) -> set[str]:
    from musecore.cli import COMMANDS

    out = set(packages) | set(PUBLIC) | {f"musecore.commands.{c}" for c in COMMANDS} | {"musecore.cli"}
    out.add("musecore.__main__")  # python -m musecore
    for group in ("musecore.backends", "musecore.benchmarks", "console_scripts"):
        for ep in entry_points(group=group):
            module = ep.value.split(":")[0].strip()
            if module.split(".")[0] in packages:
                out.add(module)
    return {r for r in out if r in known}


def test_every_shipped_module_is_selected_by_some_path():
    packages = installed()
    known = modules(packages)
    seen, todo = set(), list(roots(packages, known))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += imports(name, known[name], known) - seen
    unreachable = sorted(set(known) - seen)
    assert not unreachable, (f"{len(unreachable)} shipped module(s) no entry point, package or command imports; "
                             f"move them to a lab area or delete them: {unreachable}")


def test_the_walk_sees_lazy_imports():
    """The check must follow imports made inside functions (plugins load kernels lazily)."""
    packages = installed()
    known = modules(packages)
    found = imports("musecore.cli", known["musecore.cli"], known)
    assert "musecore.planning" in found, sorted(found)
