"""The vendor hooks of the portable kernels: portable defaults, and one owner at a time."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from musecore_triton import hooks


@pytest.fixture
def fresh_hooks(monkeypatch):
    """The hooks as a process without a GPU backend sees them (restored after the test)."""
    for name in ("_launch_options", "_early_trigger", "_launch_features", "_num_sms", "_l2_warm"):
        monkeypatch.setattr(hooks, name, getattr(hooks, "_default" + name))
    monkeypatch.setattr(hooks, "_owner", None)
    monkeypatch.setattr(hooks, "pdl_wait", hooks._no_pdl_wait)
    monkeypatch.setattr(hooks, "pdl_launch_dependents", hooks._no_pdl_launch_dependents)
    monkeypatch.setattr(hooks, "fp4x2_bf16_scaled", hooks._fp4x2_bf16_scaled_portable)
    monkeypatch.setattr(hooks, "prefetch_l2", hooks._no_prefetch_l2)
    return hooks


def test_defaults_launch_without_any_vendor_feature(fresh_hooks):
    cpu = torch.device("cpu")
    assert hooks.owner() is None
    assert hooks.launch_options(cpu, "rms_norm") == {"PDL": False}
    assert hooks.early_trigger(cpu, "dense_gemv") is False
    assert hooks.launch_features(cpu) == {"HW_FP8": False, "PACKED_UPCAST": False}
    assert hooks.num_sms(cpu) == 4
    assert hooks.l2_warm(cpu) is False and hooks.prefetch_l2 is hooks._no_prefetch_l2


def test_install_replaces_what_it_names_and_keeps_the_rest(fresh_hooks):
    @triton.jit
    def wait(PDL: tl.constexpr):
        pass

    hooks.install("vendor-a", launch_options=lambda device, kernel: {"PDL": True}, pdl_wait=wait)
    assert hooks.owner() == "vendor-a"
    assert hooks.launch_options(torch.device("cpu"), "x") == {"PDL": True}
    assert hooks.pdl_wait is wait
    assert hooks.pdl_launch_dependents is hooks._no_pdl_launch_dependents  # not named: the default stays
    assert hooks.num_sms(torch.device("cpu")) == 4
    assert hooks.l2_warm(torch.device("cpu")) is False and hooks.prefetch_l2 is hooks._no_prefetch_l2


def test_l2_warm_installs_with_its_prefetch(fresh_hooks):
    @triton.jit
    def prefetch(ptrs, mask):
        pass

    hooks.install("vendor-a", l2_warm=lambda device: True, prefetch_l2=prefetch)
    assert hooks.l2_warm(torch.device("cpu")) is True and hooks.prefetch_l2 is prefetch
    with pytest.raises(TypeError, match="prefetch_l2 must be a @triton.jit function"):
        hooks.install("vendor-a", prefetch_l2=lambda ptrs, mask: None)


def test_a_second_backend_cannot_replace_the_hooks(fresh_hooks):
    hooks.install("vendor-a")
    hooks.install("vendor-a")  # the same backend again: fine
    with pytest.raises(RuntimeError, match="already installed by backend 'vendor-a'"):
        hooks.install("vendor-b")


def test_jit_hooks_must_be_triton_functions(fresh_hooks):
    with pytest.raises(TypeError, match="pdl_wait must be a @triton.jit function"):
        hooks.install("vendor-a", pdl_wait=lambda PDL: None)
