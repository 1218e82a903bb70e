"""The CPU thread count: the cores free now (usable cores minus their share of the 1-minute load
average), overridden by MUSECORE_NUM_THREADS (a number or 'all'); a bad value is a one-line error."""

import pytest
import torch

from musecore import threads
from musecore.cli import main


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores,cpus,load,expected", [
    (2, 2, 0.1, 2), (2, 2, 1.2, 1), (2, 2, 5.5, 1), (16, 128, 60.0, 9), (8, 8, 0.0, 8), (8, 8, 3.4, 5)])
def test_free_cores_subtract_the_share_of_the_load_on_the_usable_cores(monkeypatch, cores, cpus, load, expected):
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpus)
    got = threads.free_cores(load)
    assert got == expected, f"{cores} usable of {cpus} CPUs at load {load}: {got} threads, expected {expected}"


def test_environment_overrides_and_rejects_a_bad_value(monkeypatch, capsys):
    monkeypatch.setenv(threads.NUM_THREADS_ENV, "1")
    assert threads.configure_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv(threads.NUM_THREADS_ENV, "all")
    assert threads.thread_count() == (threads.usable_cores(), "MUSECORE_NUM_THREADS=all")
    monkeypatch.setenv(threads.NUM_THREADS_ENV, "0")
    with pytest.raises(ValueError, match="MUSECORE_NUM_THREADS='0' is not a thread count"):
        threads.configure_threads()
    assert main(["bench", "--backend", "xeon", "--case", "nosuchcase"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MUSECORE_NUM_THREADS='0'" in err, err


def test_unset_means_the_free_cores(monkeypatch):
    monkeypatch.delenv(threads.NUM_THREADS_ENV, raising=False)
    count, why = threads.thread_count()
    assert 1 <= count <= threads.usable_cores() and "free cores" in why, (count, why)
