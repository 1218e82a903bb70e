"""Errors a user can act on leave the CLI as one line and exit status 2, never a traceback."""

import pytest

from musecore.cli import main


def test_a_plan_with_gaps_is_reported_without_a_traceback(capsys):
    assert main(["generate", "--prompt", "x", "--device", "mi355x", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("musecore generate: error: cannot run 'muse-tiny' on device 'mi355x'"), err
    assert "Traceback" not in err and "emulate=True" in err, err


def test_a_missing_backend_is_reported_without_a_traceback(capsys):
    assert main(["bench", "--backend", "nosuchbackend"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "Traceback" not in err, err
    assert "'nosuchbackend' would be a third-party plugin" in err and "./backends/nosuchbackend" not in err, err


def test_a_missing_first_party_backend_names_its_folder_in_the_checkout():
    from musecore.backends.registry import BackendError, get_backend_class

    with pytest.raises(BackendError, match=r"musecore-rocm is not on PyPI: .*`pip install -e \./backends/rocm`"):
        get_backend_class("rocm", records={})


def test_a_shared_cache_directory_is_reported_without_a_traceback(tmp_path, monkeypatch, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MUSECORE_CACHE", str(shared))
    from musecore import cli
    from musecore.compile_cache import directory

    def run(_args):
        directory("x")

    monkeypatch.setattr(cli, "COMMANDS", ("devices",))
    import musecore.commands.devices as devices
    monkeypatch.setattr(devices, "run", run)
    assert main(["devices"]) == 2
    err = capsys.readouterr().err
    assert "writable by other users" in err and "Traceback" not in err, err


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(monkeypatch, capsys):
    import socket

    import musecore

    monkeypatch.setattr(musecore, "load", lambda *a, **k: pytest.fail("loaded a model before checking the address"))
    assert main(["serve", "--port", "99999"]) == 2
    assert "--port must be in 0..65535; got 99999" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err

    def unresolved(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    assert main(["serve", "--host", "nowhere.invalid"]) == 2
    assert "--host 'nowhere.invalid' does not resolve (Name or service not known)" in capsys.readouterr().err


def test_under_torchrun_each_ranks_error_is_one_whole_line_naming_the_rank(monkeypatch, capfd):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["generate", "--prompt", "x", "--device", "nope"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("[rank 1] musecore generate: error: unknown device 'nope'") and err.count("\n") == 1, err


def test_a_full_disk_is_one_line_and_other_os_errors_stay_loud(monkeypatch, capsys):
    import errno

    from musecore.commands import devices

    def full(_args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out.json")

    monkeypatch.setattr(devices, "run", full)
    assert main(["devices"]) == 2
    err = capsys.readouterr().err
    assert err == ("musecore devices: error: cannot write /data/out.json: No space left on device; free space or "
                   "write somewhere else\n"), err

    def bug(_args):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(devices, "run", bug)
    with pytest.raises(OSError, match="Bad file descriptor"):  # not the user's to fix: the traceback stays
        main(["devices"])
