"""The native kernels are compiled into the per-user cache (musecore.compile_cache): a private 0700 directory, one
entry per sources + compiler + flags, renamed into place when complete; a directory other users can write to is
refused with an error naming it (a planted shared object would be loaded into this process)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import torch

from musecore import compile_cache
from musecore_xeon.kernels import binding, compile as xcompile, native

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler (cc/gcc) on this host")


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(compile_cache.ENV, str(root))
    return root


def test_a_cache_directory_writable_by_others_is_refused_naming_it(tmp_path, monkeypatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(compile_cache.ENV, str(shared))
    with pytest.raises(compile_cache.CacheError, match=f"{shared}.*writable by other users"):
        native.build(native.compile_flags())
    with pytest.raises(compile_cache.CacheError, match=str(shared)):
        native.load.__wrapped__()  # not turned into the slower fallback: the user must fix the directory
    with pytest.raises(compile_cache.CacheError, match=str(shared)):
        binding.build()
    assert list(shared.iterdir()) == [], "nothing may be written into a refused directory"


def test_a_group_writable_subdirectory_is_refused_too(fresh_cache) -> None:
    (fresh_cache / "xeon").mkdir(parents=True)
    (fresh_cache / "xeon").chmod(0o770)
    with pytest.raises(compile_cache.CacheError, match=str(fresh_cache / "xeon")):
        native.build(native.compile_flags())


@needs_cc
def test_a_fresh_cache_gets_a_private_directory_and_a_working_kernel(fresh_cache) -> None:
    path = native.build(native.compile_flags())
    assert path is not None and path.parent == fresh_cache / "xeon"
    assert stat.S_IMODE((fresh_cache / "xeon").stat().st_mode) == 0o700
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"], \
        "a finished build leaves only its object and the object's recorded hash"
    lib = native.declare_signatures(__import__("ctypes").CDLL(str(path)))
    w, x = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.bfloat16)
    y = native.bf16_gemv_with(lib, w, x, threads=1)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)
    assert native.build(native.compile_flags()) == path  # the second call finds the entry


@needs_cc
def test_two_flag_sets_give_two_cache_entries(fresh_cache) -> None:
    best, portable = native.build(native.compile_flags()), native.build(native.compile_flags("portable"))
    assert native.compile_flags() != native.compile_flags("portable")
    assert best != portable and best.exists() and portable.exists()
    assert best.parent == portable.parent == fresh_cache / "xeon"


def test_the_key_covers_sources_compiler_and_flags(fresh_cache, monkeypatch) -> None:
    key = lambda flags, compiler="cc": xcompile.cached_object_path("kernels", native.SOURCES, compiler, flags)  # noqa: E731
    assert key(["-O3"]) == key(["-O3"]) != key(["-O2"])
    monkeypatch.setattr(xcompile, "compiler_identity", lambda c: f"{c} version 99")
    assert key(["-O3"], "cc") != key(["-O3"], "gcc")
    before_edit = key(["-O3"])
    monkeypatch.setattr(xcompile, "read_source", lambda name: f"/* edited {name} */")
    assert key(["-O3"]) != before_edit


def test_the_sources_are_files_of_the_package() -> None:
    for name in (*native.SOURCES, binding.SOURCE):
        text = xcompile.read_source(name)
        assert text.strip(), name
    assert '#include "int4.c"' in xcompile.read_source("kernels.c")
    assert "PyInit_musecore_xeon_binding" in xcompile.read_source(binding.SOURCE)


def test_a_failed_build_leaves_no_entry(fresh_cache, tmp_path, monkeypatch) -> None:
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(subprocess.CalledProcessError):
        native.build(["-O3"])
    assert list((fresh_cache / "xeon").iterdir()) == []


def test_the_cli_reports_a_shared_cache_directory_in_one_line(tmp_path) -> None:
    import os
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {**os.environ, compile_cache.ENV: str(shared)}
    done = subprocess.run([sys.executable, "-m", "musecore.cli", "generate", "--device", "xeon", "--prompt", "x",
                           "--max-new-tokens", "1"], capture_output=True, text=True, env=env, timeout=600)
    err = done.stderr.strip()
    assert done.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith("musecore generate: error: cache directory") and str(shared) in err, err
