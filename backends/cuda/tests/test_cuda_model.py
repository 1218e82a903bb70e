"""The model graph on this backend's ops: every op call of a forward, on that call's own inputs, through the
CUDA op against the reference op (the reference forward's calls, recorded). Logits of two whole forwards
cannot be compared tightly on random weights: the graph is chaotic (every weightless norm re-amplifies a
difference; ``backends/xeon/tests/test_e2e.py`` measured one bf16 ulp on the linears moving the logits by
NMSE ~0.4). This checks that each call the graph makes (fused-projection slices, RoPE and NoPE layers, dense
and MoE MLPs, the softcap) reaches a kernel with the contract's arguments and meaning.

On a CPU machine the kernels run in Triton's interpreter (fp16, one call of each kind); on a GPU every call
runs natively (bf16), and the decode step replayed from a CUDA graph is checked against a plain forward."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import musecore
from musecore.backends.reference import ReferenceBackend
from musecore.config import PRESETS, MuseConfig
from musecore.model import init_weights
from musecore.ops import OPS, tolerance

from musecore_cuda import CudaBackend
from musecore_cuda.graphs import make_graphed_decode_step, make_graphed_greedy_step
from musecore_triton.testing import DEVICE, HAS_GPU, assert_nmse

# muse-tiny cut to two layers: a sliding RoPE layer with a dense MLP, then a full NoPE layer with the MoE.
TWO_LAYERS = dict(PRESETS["muse-tiny"], num_hidden_layers=2, mlp_layer_types=["dense", "sparse"])
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16  # the interpreter has no bf16


@pytest.fixture(scope="module")
def two_layer_model():
    config = MuseConfig(**TWO_LAYERS)
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.layer_rope_theta[1] == 0
    return config


def save_random(config: MuseConfig, folder: Path) -> Path:
    config.save_pretrained(folder)
    save_file(init_weights(config, seed=0, std=0.15, dtype=DTYPE), str(folder / "model.safetensors"))
    return folder


def recorded_calls(model: Any, ids: torch.Tensor) -> list[tuple[str, tuple, dict, Any]]:
    """Every op call of ``model.forward(ids)`` through the reference ops: (op, args, kwargs, output)."""
    calls, reference = [], ReferenceBackend()
    for op in OPS:
        def wrapped(*args, _op=op, _fn=getattr(reference, op), **kwargs):
            out = _fn(*args, **kwargs)
            calls.append((_op, args, kwargs, out))
            return out
        setattr(model.ops, op, wrapped)  # the layers share the model's one Ops table
    model.forward(ids)
    return calls


def kind(op: str, args: tuple) -> tuple:
    """What makes two calls different for a kernel: the op, each argument's shape and dtype (or value)."""
    return (op,) + tuple((tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else
                         type(a).__name__ if not isinstance(a, (int, float, bool, type(None))) else a for a in args)


@pytest.mark.parametrize("where", [
    pytest.param("interpreter", marks=pytest.mark.skipif(HAS_GPU, reason="on a GPU machine the kernels run natively")),
    pytest.param("gpu", marks=pytest.mark.gpu)])
def test_every_op_call_of_a_forward_matches_the_reference_on_its_inputs(two_layer_model, tmp_path, where):
    folder = save_random(two_layer_model, tmp_path)
    model = musecore.load(str(folder), device="h200" if HAS_GPU else "cpu", dtype=DTYPE, progress=False)
    ids = torch.randint(0, two_layer_model.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    calls = recorded_calls(model, ids)
    ops = {c[0] for c in calls}
    assert ops >= {"rms_norm", "residual_norm", "qk_norm_rope", "attention", "head_norm_gate", "linear",
                   "router_topk", "moe", "silu_mul", "logit_softcap"}, sorted(ops)
    assert any(c[0] == "qk_norm_rope" and c[1][2] is None for c in calls), "no NoPE layer was run"
    if not HAS_GPU:  # the interpreter is slow: one call of each kind
        calls = list({kind(op, args): (op, args, kw, out) for op, args, kw, out in calls}.values())
    be = CudaBackend(DEVICE)
    for i, (op, args, kwargs, want) in enumerate(calls):
        got = getattr(be, op)(*args, **kwargs)
        if op == "router_topk":
            assert torch.equal(got[1], want[1]), f"call {i}: router ids differ on the same input"
        for j, (a, b) in enumerate(zip(*(o if isinstance(o, tuple) else (o,) for o in (want, got)))):
            assert a.dtype == b.dtype and a.shape == b.shape, \
                f"call {i} {op}[{j}]: {b.dtype} {list(b.shape)} != {a.dtype} {list(a.shape)}"
            if a.is_floating_point():
                assert_nmse(a, b, tolerance(op), f"call {i} {op}[{j}]")
            else:
                assert torch.equal(a, b), f"call {i} {op}[{j}]"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])  # batch 1 is captured with PDL (kernels/pdl.py), 3 without
def test_graphed_decode_step_gives_the_logits_of_a_plain_forward(two_layer_model, tmp_path, batch):
    model = musecore.load(str(save_random(two_layer_model, tmp_path)), device="h200", progress=False)
    assert model.backend.name == "cuda"
    prompt = torch.randint(0, model.config.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(batch))
    graphed_cache, plain_cache = (model.new_cache(batch, 128, static=True) for _ in range(2))
    for cache in (graphed_cache, plain_cache):
        model.forward(prompt, cache=cache)
    step = make_graphed_decode_step(model, graphed_cache)
    ids = prompt[:, -1:].cuda()
    for i in range(4):
        positions = torch.full((batch, 1), 12 + i, dtype=torch.long, device="cuda")
        graphed = step(ids, positions).clone()
        plain = model.forward(ids, positions=positions, cache=plain_cache)
        assert_nmse(plain, graphed, 1e-6, f"decode step {i}, batch {batch}")
        ids = plain[:, -1].argmax(-1, keepdim=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])  # batch 1 is captured with PDL, 3 without (and its row 1 ended)
def test_greedy_graph_step_updates_positions_and_takes_the_argmax_of_a_plain_step(two_layer_model, tmp_path, batch):
    model = musecore.load(str(save_random(two_layer_model, tmp_path)), device="h200", progress=False)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(batch))
    greedy_cache, plain_cache = (model.new_cache(batch, 128, static=True) for _ in range(2))
    for cache in (greedy_cache, plain_cache):
        model.forward(prompt, cache=cache)
    step = make_graphed_greedy_step(model, greedy_cache)
    ids = prompt[:, -1].cuda()
    next_position = torch.full((batch,), 12, dtype=torch.long, device="cuda")
    live = torch.arange(batch, device="cuda") != 1  # row 1 (at batch 3) ended: it runs at position -1
    step.start(ids, next_position, live)
    for i in range(4):
        positions = torch.where(live, next_position, -1)[:, None]
        plain = model.forward(ids[:, None], positions=positions, cache=plain_cache)
        got = step().clone()
        assert_nmse(plain, step.logits, 1e-6, f"greedy step {i}, batch {batch}")
        assert torch.equal(got, step.logits[:, -1].float().argmax(-1)), f"step {i}: tokens are not the argmax"
        next_position += live.long()
        ids = got
    assert torch.equal(step.next_position, next_position), (step.next_position, next_position)


@pytest.mark.gpu
def test_a_captured_step_holds_the_cache_it_writes(two_layer_model, tmp_path):
    """A captured step reads and writes the cache it was captured on by address, so it holds that cache: a caller
    that keeps only the step must not replay into freed memory that later tensors took (session 80: the lab's A/B
    helper dropped its cache, and its replayed logits were garbage)."""
    model = musecore.load(str(save_random(two_layer_model, tmp_path)), device="h200", progress=False)
    prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    cache, plain_cache = (model.new_cache(1, 128, static=True) for _ in range(2))
    for c in (cache, plain_cache):
        model.forward(prompt, cache=c)
    step, greedy = make_graphed_decode_step(model, cache), make_graphed_greedy_step(model, cache)
    held = weakref.ref(cache)
    del cache
    gc.collect()
    assert held() is not None, "the captured steps let their cache go"
    taken = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]  # what would reuse freed blocks
    ids, positions = prompt[:, -1:].cuda(), torch.tensor([[12]], device="cuda")
    graphed = step(ids, positions).clone()
    assert_nmse(model.forward(ids, positions=positions, cache=plain_cache), graphed, 1e-6, "the held cache's step")
    assert greedy.cache is held() and all(t.eq(7).all() for t in taken)
