"""A model the plan says will not fit is refused before a weight is read, with the sizes and what to do; never an
out-of-memory part way through the load."""

import pytest

import musecore
from musecore import api
from musecore.planning import FitError


def test_the_plan_says_why_a_model_does_not_fit_and_what_to_do():
    plan = musecore.plan("muse-spark-open-816b-a42b", "h200", emulate=True, checkpoint_format="nvfp4")
    problem = plan.fit_problem()
    assert not plan.fits and problem is not None, problem
    assert "it needs" in problem and f"{plan.devices_needed} or more h200 devices with torchrun" in problem, problem
    assert musecore.plan("muse-tiny", "h200", emulate=True).fit_problem() is None


def test_a_mesh_whose_rank_does_not_fit_names_the_rank():
    plan = musecore.plan("muse-spark-open-816b-a42b", "h200", emulate=True, checkpoint_format="bf16", tp=2, ep=2)
    assert not plan.fits
    assert "a rank of TP2/EP2 needs" in plan.fit_problem() and "launch more ranks" in plan.fit_problem()


def test_a_load_that_cannot_fit_this_host_is_refused_before_any_weight_is_made(monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was made before the fit was checked")

    monkeypatch.setattr(api, "quantize", no_weights, raising=False)
    monkeypatch.setattr("torch.randn", no_weights)
    with pytest.raises(FitError, match=r"cannot load 'muse-spark-open-816b-a42b' on 'cpu': it needs .* GiB"):
        api.load_random("muse-spark-open-816b-a42b", device="cpu")
    monkeypatch.setattr(api, "host_memory_bytes", lambda: 2**20)  # a 1 MiB host: even muse-tiny's target bytes exceed
    with pytest.raises(FitError, match=r"cannot emulate 'muse-tiny' on 'h200' on this host: it needs more than"):
        api.load_random("muse-tiny", device="h200", emulate=True)
