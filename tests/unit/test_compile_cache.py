"""The per-user compile cache (musecore.compile_cache): private directories, refused when shared."""

import os
import re
import stat

import pytest

from musecore import compile_cache
from musecore.compile_cache import CacheError

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="ownership and mode bits are POSIX")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@posix_only
def test_directories_are_created_private_under_musecore_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MUSECORE_CACHE", str(tmp_path / "cache"))
    made = compile_cache.directory("xeon", "abc")
    assert made == tmp_path / "cache" / "xeon" / "abc"
    for level in (tmp_path / "cache", tmp_path / "cache" / "xeon", made):
        assert mode(level) == 0o700, f"{level}: mode {mode(level):o}, want 700"


@posix_only
def test_xdg_cache_home_is_the_default_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MUSECORE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.root() == tmp_path / "musecore"


@posix_only
def test_a_missing_cache_home_is_made_with_its_parents(tmp_path, monkeypatch):
    """A fresh machine may have no ~/.cache at all (this CI host had none): the root's parents are made, not an
    error."""
    monkeypatch.delenv("MUSECORE_CACHE", raising=False)
    home = tmp_path / "home" / ".cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    made = compile_cache.directory("xeon")
    assert made == home / "musecore" / "xeon" and made.is_dir()
    assert mode(home) == mode(home / "musecore") == mode(made) == 0o700


@posix_only
def test_a_cache_home_that_cannot_be_made_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("MUSECORE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    unmakeable = re.escape(str(tmp_path / "file" / "cache"))
    with pytest.raises(CacheError, match=f"cannot create {unmakeable} .*set MUSECORE_CACHE"):
        compile_cache.directory("xeon")


@posix_only
@pytest.mark.parametrize("bad_mode", [0o777, 0o775, 0o722])
def test_a_directory_others_can_write_is_refused_naming_it(tmp_path, monkeypatch, bad_mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(bad_mode)
    monkeypatch.setenv("MUSECORE_CACHE", str(shared))
    with pytest.raises(CacheError, match=f"{shared}.*writable by other users.*chmod 700"):
        compile_cache.directory("cuda")
    assert not (shared / "cuda").exists(), "nothing may be created inside a refused directory"


@posix_only
def test_a_group_writable_level_below_the_root_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MUSECORE_CACHE", str(tmp_path / "c"))
    compile_cache.directory("xeon")
    (tmp_path / "c" / "xeon").chmod(0o770)
    with pytest.raises(CacheError, match="xeon"):
        compile_cache.directory("xeon", "k")


def test_a_file_where_the_cache_should_be_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MUSECORE_CACHE", str(tmp_path / "file"))
    with pytest.raises(CacheError, match="not a directory"):
        compile_cache.directory()


def test_keys_depend_on_every_item_and_on_their_boundaries():
    k = compile_cache.key("source", "gcc 13", "-O3")
    assert k == compile_cache.key("source", "gcc 13", "-O3")
    assert k != compile_cache.key("source", "gcc 13", "-O2")
    assert k != compile_cache.key("source", "gcc 14", "-O3")
    assert compile_cache.key("ab", "c") != compile_cache.key("a", "bc")


@posix_only
def test_write_atomic_leaves_only_the_complete_file(tmp_path):
    target = compile_cache.write_atomic(tmp_path / "k.so", b"\x7fELF" + bytes(100))
    assert target.read_bytes()[:4] == b"\x7fELF" and mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["k.so"], "no temporary file may be left behind"
