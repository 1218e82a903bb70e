"""The graph's own invariants (decode against forward, the MoE order, fused projections) and loader errors;
the comparison with transformers is tests/unit/test_transformers_oracle.py."""

import pytest
import torch

import musecore
from musecore.backends.reference import ReferenceBackend
from musecore.config import MuseConfig
from musecore.loader import CheckpointMismatch
from tests.conftest import nmse
from tests.helpers import random_tensors, small_config, write_checkpoint


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    config = small_config()
    tensors = random_tensors(config)
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", config, tensors)
    return folder, config, tensors


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
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    bad = dict(tensors)
    del bad[name]
    with pytest.raises(CheckpointMismatch, match="missing 1 tensor.*layers.1.mlp.experts.gate_up_proj"):
        musecore.load(write_checkpoint(tmp_path / "missing", config, bad), device="cpu")
    bad = dict(tensors)
    name = "model.language_model.layers.1.mlp.pre_expert_proj.weight"
    bad[name] = bad[name][:, :-1].contiguous()
    with pytest.raises(CheckpointMismatch, match=r"pre_expert_proj.weight.*shape \[32, 63\].*\[32, 64\]"):
        musecore.load(write_checkpoint(tmp_path / "shape", config, bad), device="cpu")
    bad = dict(tensors)
    bad["model.language_model.layers.9.extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointMismatch, match="unexpected tensor"):
        musecore.load(write_checkpoint(tmp_path / "extra", config, bad), device="cpu")


def per_expert(tensors: dict, config) -> dict:
    """``tensors`` with every fused expert tensor written per expert, as some producers export them."""
    out = {}
    inter = config.moe_intermediate_size
    for name, t in tensors.items():
        prefix, _, proj = name.rpartition(".")
        if proj == "gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif proj == "down_proj" and prefix.endswith(".experts"):
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def test_per_expert_keys_load_like_the_fused_tensors(tmp_path):
    config = small_config()
    tensors = random_tensors(config, seed=5)
    fused = musecore.load(write_checkpoint(tmp_path / "fused", config, tensors), device="cpu", dtype=torch.float32)
    split = per_expert(tensors, config)
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in split
    apart = musecore.load(write_checkpoint(tmp_path / "apart", config, split), device="cpu", dtype=torch.float32)
    ids = torch.tensor([[3, 17, 42, 8, 8, 91, 0, 5]])
    assert torch.equal(fused.forward(ids), apart.forward(ids))
    del split["model.language_model.layers.2.mlp.experts.5.down_proj.weight"]
    with pytest.raises(CheckpointMismatch, match="missing 2 tensor.*layers.2.mlp.experts.down_proj"):
        musecore.load(write_checkpoint(tmp_path / "short", config, split), device="cpu")


def test_shared_post_expert_norm_is_applied_to_each_expert_scale_first_before_its_routing_weight(small_checkpoint):
    """One post-expert norm weight for all experts, scaling before normalising, on each expert's own
    output, then the routing weight: norming the weighted sum, or scaling after, are other models."""
    folder, config, tensors = small_checkpoint
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    mlp, p = model.layers[1].mlp, "model.language_model.layers.1.mlp."
    m = torch.randn(5, config.hidden_size)
    weights, ids = model.ops.router_topk(m, mlp.router, mlp.correction_bias, config.num_experts_per_tok,
                                         config.output_multiplier, config.routed_scaling_factor)
    z = model.ops.rms_norm(m @ tensors[p + "pre_expert_proj.weight"].T, mlp.pre_expert_norm, config.rms_norm_eps)
    got = model.ops.moe(z, weights, ids, mlp.experts, mlp.post_expert_norm, config.post_norm_eps)
    scale = 1 + tensors[p + "experts.post_expert_norm.weight"]  # stored centred at 0
    gate_up, down = tensors[p + "experts.gate_up_proj"], tensors[p + "experts.down_proj"]
    inter = config.moe_intermediate_size
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean() + config.post_norm_eps)  # noqa: E731
    want, norm_of_sum, scale_after = (torch.zeros_like(got) for _ in range(3))
    for t in range(5):
        raw = torch.zeros(config.moe_hidden_size)
        for w, e in zip(weights[t], ids[t].tolist()):
            out = (torch.nn.functional.silu(z[t] @ gate_up[e, :inter].T) * (z[t] @ gate_up[e, inter:].T)) @ down[e].T
            want[t] += w * rms(out * scale)
            scale_after[t] += w * rms(out) * scale
            raw += w * out
        norm_of_sum[t] = rms(raw * scale)
    assert nmse(want, got) < 1e-10, f"moe vs the shared scale-first post-expert norm: NMSE {nmse(want, got):.3e}"
    assert nmse(norm_of_sum, got) > 1e-3, "a norm of the weighted sum must give a different result"
    assert nmse(scale_after, got) > 1e-4, "scaling after the norm must give a different result"


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
    """q/k/v/gate (and a dense layer's gate/up) are stacked into one linear when they stay unquantized;
    the logits match loading them one by one (fp32: only the GEMM's summation order may differ)."""
    folder, config, _ = small_checkpoint
    fused = musecore.load(folder, device="cpu", dtype=torch.float32, progress=False)
    attn = fused.layers[0].self_attn
    assert attn.in_proj is not None and attn.q_proj is None and attn.o_proj is not None
    assert attn.in_proj.widths == (config.num_attention_heads * config.head_dim,
                                   config.num_key_value_heads * config.head_dim,
                                   config.num_key_value_heads * config.head_dim,
                                   config.num_attention_heads * config.head_dim)
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
    logits as the projections one by one; the router stays fp32 beside the INT4 pooler."""
    fused = musecore.load("muse-tiny", device="xeon", emulate=True, progress=False,
                          quantize_dense=("attention", "pooler/unpooler"))
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.in_proj is not None and attn.in_proj.weight.format == "int4" and attn.q_proj is None
    assert mlp.pre_expert_proj.format == "int4" and mlp.router.dtype == torch.float32
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


class _Deferring:
    """A stand-in for a backend's fused block (``Backend.fuse_block``): ``sublayer`` runs the block through the ops,
    resolving a ``DeferredNorm`` residual itself where it ``takes_deferred`` (or declining it: ``accept`` False, the
    model must resolve it), and with ``defer`` hands its own norm on unrun; counts what it took and handed on."""

    def __init__(self, block, takes=True, accept=True):
        self.block, self.takes_deferred, self.accept = block, takes, accept
        self.took = self.declined = self.handed = 0

    def __call__(self, *args):
        return None

    def sublayer(self, residual, norm, x, *args, defer=False):
        from musecore.model import DeferredNorm

        if isinstance(residual, DeferredNorm):
            assert self.takes_deferred, "handed a DeferredNorm without takes_deferred"
            if not self.accept:
                self.declined += 1
                return None
            self.took += 1
            residual, x = residual.resolve(self.block.ops)
        saved, self.block.fused = self.block.fused, None
        try:
            out = self.block(x, *args)
        finally:
            self.block.fused = saved
        if defer:
            self.handed += 1
            return DeferredNorm(residual, out, norm)
        return self.block.ops.residual_norm(residual, out, *norm)


@pytest.mark.parametrize("takes,accept", [(True, True), (True, False), (False, True)],
                         ids=["taken", "declined", "not-offered"])
def test_residual_norms_handed_on_deferred_give_the_same_logits(small_checkpoint, takes, accept):
    """``MuseModel.forward`` hands each residual norm from a fused block to the fused block after it
    (``DeferredNorm``) only where that block ``takes_deferred``, never past the last layer; the logits are the ops'
    bit for bit whether the next block runs it, declines it (the model resolves it) or is never offered it;
    calibration's observer turns deferral off."""
    from musecore.model import MoE

    folder, config, _ = small_checkpoint
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (1, 6))
    want = model.forward(ids)
    stand_ins = []
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            if hasattr(block, "fused"):
                block.fused = _Deferring(block, takes, accept)
                stand_ins.append(block.fused)
    assert any(isinstance(layer.mlp, MoE) for layer in model.layers), "the small config has no MoE layer to test"
    got = model.forward(ids)
    assert torch.equal(got, want), f"logits differ by {(got - want).abs().max().item():.3g}"
    handed = sum(s.handed for s in stand_ins)
    # every fused block hands its norm to the next fused block, but the last block's goes to the final norm
    chain = sum(1 for a, b in zip(stand_ins, stand_ins[1:]) if a.block.layer + 1 >= b.block.layer)
    took, declined = sum(s.took for s in stand_ins), sum(s.declined for s in stand_ins)
    if not takes:
        assert handed == took == declined == 0, f"{handed} norms handed on to blocks that do not take them"
    elif accept:  # each block hands its norm on and the next takes it
        assert handed == took == chain and declined == 0, f"{handed} handed on, {took} taken, {chain} neighbours"
    else:  # a declining block runs the ops and its own norm with them: every other neighbour pair hands one on
        assert 0 < handed == declined and took == 0, f"{handed} handed on, {declined} declined"
    before = handed
    seen = []
    model.forward(ids, observer=lambda *routing: seen.append(routing[0]))
    assert seen and sum(s.handed for s in stand_ins) == before, "an observed forward deferred a norm"
