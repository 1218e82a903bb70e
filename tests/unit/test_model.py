"""The graph against an independent implementation of MODEL.md, decode against forward, errors."""

import pytest
import torch

import musecore
from musecore.backends.reference import ReferenceBackend
from musecore.config import MuseConfig
from musecore.loader import CheckpointMismatch
from tests.conftest import nmse
from tests.helpers import random_tensors, small_config, write_checkpoint
from tests.independent_muse import muse_logits


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    config = small_config()
    tensors = random_tensors(config)
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", config, tensors)
    return folder, config, tensors


def test_forward_matches_independent_implementation_of_model_md(small_checkpoint):
    folder, config, tensors = small_checkpoint
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    ids = [3, 17, 42, 8, 8, 91, 0, 5, 66, 23, 11, 4]  # longer than the sliding window (5)
    got = model.forward(torch.tensor([ids]))[0].double()
    want = muse_logits(tensors, config.to_dict(), ids)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-4, f"relative error vs the independent MODEL.md implementation: {rel:.3e} (tolerance 1e-4)"


@pytest.mark.parametrize("static", [False, True], ids=["trimmed", "static"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_incremental_decode_equals_whole_sequence_beyond_the_window(small_checkpoint, kv_format, static):
    folder, config, _ = small_checkpoint
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 14))  # 14 > window 5: the ring buffer wraps
    cache = model.new_cache(batch=2, max_length=32, kv_format=kv_format)
    whole = model.forward(ids, cache=cache)
    cache = model.new_cache(batch=2, max_length=32, kv_format=kv_format, static=static)
    steps = [model.forward(ids[:, :4], cache=cache)]  # prefill 4, then one token at a time
    steps += [model.forward(ids[:, t:t + 1], cache=cache) for t in range(4, 14)]
    incremental = torch.cat(steps, dim=1)
    err = nmse(whole, incremental)
    assert err < 1e-10, f"NMSE between incremental decode and one pass: {err:.3e} (tolerance 1e-10)"
    if kv_format == "bf16":
        no_cache = model.forward(ids)
        err = nmse(no_cache, whole)
        assert err < 1e-10, f"NMSE with and without a KV cache: {err:.3e}"


def test_round_trip_config_checkpoint_load_sharded(tmp_path):
    config = small_config()
    tensors = random_tensors(config, seed=3)
    one = musecore.load(write_checkpoint(tmp_path / "one", config, tensors), device="cpu", dtype=torch.float32)
    three = musecore.load(write_checkpoint(tmp_path / "three", config, tensors, shards=3), device="cpu", dtype=torch.float32)
    assert MuseConfig.from_pretrained(tmp_path / "three").to_dict() == config.to_dict()
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(one.forward(ids), three.forward(ids))


def test_loader_rejects_missing_and_misshapen_tensors(tmp_path):
    config = small_config()
    tensors = random_tensors(config)
    name = "model.language_model.layers.1.mlp.experts.2.up_proj.weight"
    bad = dict(tensors)
    del bad[name]
    with pytest.raises(CheckpointMismatch, match="missing 1 tensor.*experts.2.up_proj"):
        musecore.load(write_checkpoint(tmp_path / "missing", config, bad), device="cpu")
    bad = dict(tensors)
    bad[name] = bad[name][:, :-1].contiguous()
    with pytest.raises(CheckpointMismatch, match=r"experts.2.up_proj.weight.*shape \[48, 31\].*\[48, 32\]"):
        musecore.load(write_checkpoint(tmp_path / "shape", config, bad), device="cpu")
    bad = dict(tensors)
    bad["model.language_model.layers.9.extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointMismatch, match="unexpected tensor"):
        musecore.load(write_checkpoint(tmp_path / "extra", config, bad), device="cpu")


def test_model_uses_per_expert_norm_before_routing_weight(small_checkpoint):
    """Normalising each expert's output before weighting is a different model from a norm of the sum."""
    folder, config, tensors = small_checkpoint
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    mlp = model.layers[1].mlp
    m = torch.randn(5, config.hidden_size)
    weights, ids, z = mlp.route(m)
    got = model.ops.moe(z, weights, ids, mlp.experts, mlp.output_norm, config.rms_norm_eps)
    p = "model.language_model.layers.1.mlp.experts."
    per_expert, sum_then_norm = torch.zeros_like(got), torch.zeros_like(got)
    for t in range(5):
        raw = torch.zeros(config.moe_latent_size)
        for w, e in zip(weights[t], ids[t].tolist()):
            h = torch.nn.functional.silu(z[t] @ tensors[f"{p}{e}.gate_proj.weight"].T) * (z[t] @ tensors[f"{p}{e}.up_proj.weight"].T)
            out = h @ tensors[f"{p}{e}.down_proj.weight"].T
            normed = out * torch.rsqrt(out.pow(2).mean() + config.rms_norm_eps) * tensors[f"{p}{e}.output_norm.weight"]
            per_expert[t] += w * normed
            raw += w * out
        sum_then_norm[t] = raw * torch.rsqrt(raw.pow(2).mean() + config.rms_norm_eps) * tensors[f"{p}{ids[t, 0]}.output_norm.weight"]
    assert nmse(per_expert, got) < 1e-10, f"moe vs per-expert-norm formula: NMSE {nmse(per_expert, got):.3e}"
    assert nmse(sum_then_norm, got) > 1e-3, "a norm of the weighted sum must give a different result"


def test_gqa_maps_query_head_to_kv_head_by_integer_division():
    B, T, nq, nkv, d = 1, 3, 4, 2, 8
    q = torch.randn(B, T, nq, d)
    k = torch.zeros(B, T, nkv, d)
    v = torch.zeros(B, T, nkv, d)
    v[:, :, 0], v[:, :, 1] = 1.0, 2.0  # kv head 0 carries 1s, kv head 1 carries 2s
    pos = torch.arange(T)[None]
    out = ReferenceBackend().attention(q, k, v, pos, pos, None, d ** -0.5)
    assert torch.allclose(out[:, :, :2], torch.ones(1)) and torch.allclose(out[:, :, 2:], torch.full((1,), 2.0))


def test_sliding_window_query_sees_exactly_w_keys_including_itself():
    W, T = 4, 10
    q = torch.zeros(1, T, 1, T)  # zero scores: uniform weight over the visible keys
    k = torch.zeros(1, T, 1, T)
    v = torch.eye(T)[None, :, None, :]  # value j is the one-hot e_j
    pos = torch.arange(T)[None]
    out = ReferenceBackend().attention(q, k, v, pos, pos, W, 1.0)[0, :, 0]  # [T, T]
    for i in range(T):
        seen = (out[i] > 0).nonzero().flatten().tolist()
        assert seen == list(range(max(0, i - W + 1), i + 1)), f"query {i} sees keys {seen}"


def test_input_projections_are_fused_and_give_the_same_logits(small_checkpoint, monkeypatch):
    """q/k/v/gate and router/pooler are stacked into one linear each when they stay unquantized; the
    logits match loading them one by one (fp32: only the GEMM's summation order may differ)."""
    folder, config, _ = small_checkpoint
    fused = musecore.load(folder, device="cpu", dtype=torch.float32, progress=False)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.in_proj is not None and attn.q_proj is None and attn.o_proj is not None
    assert attn.in_proj.widths == (config.num_attention_heads * config.head_dim,
                                   config.num_key_value_heads * config.head_dim,
                                   config.num_key_value_heads * config.head_dim, config.num_attention_heads)
    assert mlp.in_proj is not None and mlp.in_proj.widths == (config.num_experts, config.moe_latent_size)
    monkeypatch.setattr(musecore.loader.Placer, "fuse_projections", False)
    apart = musecore.load(folder, device="cpu", dtype=torch.float32, progress=False)
    assert apart.layers[0].self_attn.in_proj is None and apart.layers[0].self_attn.q_proj is not None
    ids = torch.tensor([[3, 17, 42, 8, 8, 91, 0, 5, 66, 23, 11, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    got, want = fused.forward(ids), apart.forward(ids)
    err = (got - want).abs().max().item()
    print(f"fused vs separate projections: max |logit difference| {err:.2e} (bound 1e-4)")
    assert err <= 1e-4


def test_nvfp4_input_projections_stay_separate():
    """NVFP4 members keep their own per-tensor global scales: ``fuse_group`` prepares them one by one
    (no device's plan makes NVFP4 dense projections from a BF16 checkpoint, so a stub placer stands in)."""
    from musecore_quant import quantize

    from musecore.loader import Placer, fuse_group
    from musecore.model import Attention

    class StubPlacer:
        fuse_projections = Placer.fuse_projections
        route = staticmethod(lambda op, name: ("reference", "nvfp4", None))
        prepare = staticmethod(lambda name, role, value: value)

    attn = Attention(small_config(), 0, ops=None)
    members = [(n, quantize(torch.randn(32, 64) * s, "nvfp4")) for n, s in zip(attn.INPUT_PROJECTIONS, (1, 5, 0.1, 2))]
    fuse_group(attn, members, StubPlacer())
    assert attn.in_proj is None and [attn.q_proj, attn.k_proj, attn.v_proj, attn.gate_proj] == [v for _, v in members]


def test_int4_input_projections_are_fused_without_changing_a_code(monkeypatch):
    """INT4 (every scale per row block) is joined row-wise with codes and scales untouched: the same
    logits as the projections one by one; the pooler alone is INT4, so router + pooler stay apart."""
    fused = musecore.load("muse-tiny", device="xeon", emulate=True, progress=False,
                          quantize_dense=("attention", "pooler/unpooler"))
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.in_proj is not None and attn.in_proj.weight.format == "int4" and attn.q_proj is None
    assert mlp.in_proj is None and mlp.fc1_latent_proj.format == "int4" and mlp.router.format == "bf16"
    monkeypatch.setattr(musecore.loader.Placer, "fuse_projections", False)
    apart = musecore.load("muse-tiny", device="xeon", emulate=True, progress=False,
                          quantize_dense=("attention", "pooler/unpooler"))
    ids = torch.tensor([[3, 17, 42, 8, 99, 5]])
    got, want = fused.forward(ids), apart.forward(ids)
    err = nmse(want, got)
    print(f"INT4 fused vs separate q/k/v/gate: logits NMSE {err:.2e} (bound 1e-6)")
    assert err <= 1e-6


@pytest.mark.parametrize("ring", [False, True])
def test_cpu_decode_update_of_one_row_and_the_views_it_returns(ring) -> None:
    """Batch 1 (its position read by int()): the state of the indexed write, a padding step skipped, the capacity
    checked before anything is written; the view a decode step reads: every slot of a ring layer, as one view made
    once that sees every later write, and the filled slots of a full layer."""
    from musecore.kv_cache import LayerCache

    def cache() -> LayerCache:
        return LayerCache(1, 4, 2, 8, ring=ring, kv_format="bf16", dtype=torch.bfloat16, device=torch.device("cpu"))
    one, indexed = cache(), cache()
    views = []
    for step, p in enumerate([0, 1, -1, 2, 3, 4, 5] if ring else [0, 1, -1, 2, 3]):
        pos = torch.tensor([[p]])
        k, v = torch.randn(1, 1, 2, 8).to(torch.bfloat16), torch.randn(1, 1, 2, 8).to(torch.bfloat16)
        views.append(one.update(k, v, pos))
        indexed.write(torch.cat([k, k], 1), torch.cat([v, v], 1), torch.cat([torch.full_like(pos, -1), pos], 1))
        assert torch.equal(one.k, indexed.k) and torch.equal(one.positions, indexed.positions), f"step {step}"
        assert one.used == indexed.used, f"step {step}"
        seen = views[-1]
        slots = seen.k.shape[1]
        assert slots == (4 if ring else one.used) and torch.equal(seen.positions, one.positions[:, :slots])
    if ring:
        assert all(view is views[0] for view in views)
    else:
        before = one.k.clone()
        with pytest.raises(ValueError, match="exceeds the KV cache capacity 4"):
            one.write(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), torch.tensor([[4]]))
        assert torch.equal(one.k, before)


@pytest.mark.parametrize("ring", [False, True])
def test_cpu_decode_write_matches_the_indexed_write_and_skips_padding(ring) -> None:
    """One entry per row (decode) is written by narrowing on the CPU (all rows at one position: one copy for the
    batch; else row by row); the state must equal the indexed write's (which
    every other write takes), padding rows (-1) untouched, and a position past a full layer's capacity rejected
    before anything is written."""
    from musecore.kv_cache import LayerCache

    def cache() -> LayerCache:
        return LayerCache(3, 4, 2, 8, ring=ring, kv_format="bf16", dtype=torch.bfloat16, device=torch.device("cpu"))
    one, indexed = cache(), cache()
    positions = [[0, 1, 2, 3, 4, 5, 6], [0, 1, -1, 2, 3, -1, 6], [-1, -1, -1, -1, -1, -1, 6]]  # last: all rows alike
    for step in range(4 if not ring else 7):
        pos = torch.tensor([[row[step]] for row in positions])
        k, v = torch.randn(3, 1, 2, 8).to(torch.bfloat16), torch.randn(3, 1, 2, 8).to(torch.bfloat16)
        one.write(k, v, pos)
        indexed.write(torch.cat([k, k], 1), torch.cat([v, v], 1), torch.cat([torch.full_like(pos, -1), pos], 1))
        assert torch.equal(one.k, indexed.k) and torch.equal(one.v, indexed.v), f"step {step}"
        assert torch.equal(one.positions, indexed.positions) and one.used == indexed.used, f"step {step}"
    if not ring:
        before = one.k.clone()
        with pytest.raises(ValueError, match="exceeds the KV cache capacity 4"):
            one.write(torch.ones(3, 1, 2, 8), torch.ones(3, 1, 2, 8), torch.tensor([[1], [4], [-1]]))
        assert torch.equal(one.k, before)
