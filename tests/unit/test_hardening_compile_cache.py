"""The compile cache hands back only what this user wrote (issue 29, item 8): a pre-planted object
with the predictable name, a changed one, a link, another user's file or a file others can write is
refused with a one-line CacheError naming it; what store()/install() wrote comes back."""

import os

import pytest

from musecore import compile_cache
from musecore.compile_cache import CacheError

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="ownership and mode bits are POSIX")
ELF = b"\x7fELF" + bytes(60)  # the bytes do not matter: nothing here is ever loaded


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cache"))
    return compile_cache.directory("xeon")


def entry(cache):
    return cache / f"kernels-{compile_cache.key('source', 'cc', '-O3')}.so"


def refused(path, match):
    with pytest.raises(CacheError, match=match) as e:
        compile_cache.lookup(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value), str(e.value)


@posix_only
def test_what_store_and_install_wrote_comes_back_and_a_missing_entry_is_none(cache, tmp_path):
    target = entry(cache)
    assert compile_cache.lookup(target) is None
    compile_cache.store(target, ELF)
    assert compile_cache.lookup(target) == target
    built = cache / ".build" / "out.so"
    built.parent.mkdir(mode=0o700)
    built.write_bytes(ELF + b"2")
    other = cache / "binding-x.so"
    compile_cache.install(built, other)
    assert compile_cache.lookup(other) == other and other.read_bytes() == ELF + b"2"


@posix_only
def test_a_pre_planted_object_with_the_predictable_name_is_refused(cache):
    target = entry(cache)
    target.write_bytes(ELF)  # planted: nobody recorded its hash
    target.chmod(0o700)
    refused(target, "no recorded sha256")


@posix_only
def test_an_object_changed_after_it_was_written_is_refused(cache):
    target = entry(cache)
    compile_cache.store(target, ELF)
    target.write_bytes(ELF[:-1] + b"\x01")
    refused(target, "has sha256 .* not the .* recorded when it was written")


@posix_only
def test_a_planted_object_with_a_forged_hash_record_of_another_user_is_refused(cache):
    if os.getuid() != 0:
        pytest.skip("needs root to give a file to another uid")
    target = entry(cache)
    compile_cache.store(target, ELF)
    os.chown(target, 12345, 12345)
    refused(target, "belongs to uid 12345")
    os.chown(target, 0, 0)
    record = target.with_name(target.name + compile_cache.HASH_SUFFIX)
    os.chown(record, 12345, 12345)
    refused(target, "cache hash record .* belongs to uid 12345")


@posix_only
def test_a_link_or_an_object_others_can_write_is_refused(cache, tmp_path):
    target = entry(cache)
    compile_cache.store(target, ELF)
    target.chmod(0o666)
    refused(target, "writable by other users")
    target.unlink()
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(ELF)
    target.symlink_to(elsewhere)
    refused(target, "not a regular file")


@posix_only
def test_a_world_writable_cache_directory_is_refused_before_any_lookup(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = shared / "kernels-0123.so"
    planted.write_bytes(ELF)
    shared.chmod(0o777)
    with pytest.raises(CacheError, match="writable by other users"):
        compile_cache.lookup(planted)
