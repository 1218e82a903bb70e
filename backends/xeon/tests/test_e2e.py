"""The whole muse-tiny graph on the xeon backend against the same device emulated by the reference.

``musecore.load(..., device="xeon", emulate=True)`` applies the same conversions (experts to INT4 g128 at load) and
runs reference kernels, so only kernel arithmetic differs. The logits themselves cannot be compared tightly: the graph
on random weights is chaotic (one bf16 ulp of noise on every linear output of the emulated model alone moves its logits
by NMSE ~0.4; every weightless norm re-amplifies a difference, the sharp q-scaled attention and the sigmoid router's
near-ties do the rest). So the test replays the graph: every op call of the emulated forward, on that call's own
inputs, through the xeon op with the xeon-prepared weights of the same call, within the op's tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import musecore
from musecore.config import MuseConfig
from musecore.model import init_weights
from musecore.ops import TEXT_OPS, tolerance
from musecore.testing import assert_nmse
from safetensors.torch import save_file

WEIGHT_ARGUMENT = {"linear": 1, "moe": 3, "embedding": 1}  # the prepared weight of each call, per backend


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = MuseConfig.from_name("muse-tiny")
    folder = tmp_path_factory.mktemp("xeon-e2e")
    config.save_pretrained(folder)
    save_file(init_weights(config, seed=0, std=0.15, dtype=torch.bfloat16), str(folder / "model.safetensors"))
    return folder


def recorded_calls(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, tuple, dict, Any]], dict]:
    """The model's logits, every op call of its forward (op, args, kwargs, output), and its unwrapped op table."""
    calls, table = [], {op: getattr(model.ops, op) for op in TEXT_OPS}  # a text forward binds the text ops only
    for op, fn in table.items():
        def wrapped(*args, _op=op, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            calls.append((_op, args, kwargs, out))
            return out
        setattr(model.ops, op, wrapped)
    try:
        logits = model.forward(ids)
    finally:
        for op, fn in table.items():
            setattr(model.ops, op, fn)
    return logits, calls, table


@pytest.mark.parametrize("quantize_dense", [None, True], ids=["default-plan", "all-dense-int4"])
def test_every_op_of_a_muse_tiny_forward_matches_the_emulated_device_on_its_inputs(xeon, tiny_checkpoint: Path,
                                                                                   quantize_dense) -> None:
    native = musecore.load(str(tiny_checkpoint), device="xeon", progress=False, quantize_dense=quantize_dense)
    emulated = musecore.load(str(tiny_checkpoint), device="xeon", emulate=True, progress=False,
                             quantize_dense=quantize_dense)
    assert native.plan.backend == "xeon"
    ids = torch.randint(0, native.config.vocab_size, (2, 12))
    logits, native_calls, xeon_ops = recorded_calls(native, ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    _, calls, _ = recorded_calls(emulated, ids)
    assert [c[0] for c in calls] == [c[0] for c in native_calls], "the two plans ran different graphs"
    for i, ((op, args, kwargs, want), native_call) in enumerate(zip(calls, native_calls)):
        args = list(args)
        if op in WEIGHT_ARGUMENT:  # the xeon-prepared weight of the same call
            args[WEIGHT_ARGUMENT[op]] = native_call[1][WEIGHT_ARGUMENT[op]]
        got = xeon_ops[op](*args, **kwargs)
        if op == "router_topk":
            assert torch.equal(got[1], want[1]), f"call {i}: router ids differ on the same input"
        for j, (a, b) in enumerate(zip(*(o if isinstance(o, tuple) else (o,) for o in (want, got)))):
            assert a.dtype == b.dtype and a.shape == b.shape, f"call {i} {op}[{j}]: {b.dtype} {b.shape} != {a.dtype} {a.shape}"
            if a.is_floating_point():
                assert_nmse(a, b, tolerance(op), f"call {i} {op}[{j}]")
            else:
                assert torch.equal(a, b), f"call {i} {op}[{j}]"
