"""Calibration capture (what the router sends each expert) and AutoRound INT4 per expert.

The capture tests run without auto-round; the tuning tests skip, with the reason, when it is not
installed (``pip install -e '.[autoround]'``). Tuning uses few iterations on a small random model:
the properties checked (valid canonical INT4, the error bound, no worse than RTN on the routed
tokens) hold for any number of iterations.
"""

import json

import pytest
import torch
import torch.nn.functional as F

import musecore
from tests.conftest import nmse
from musecore.autoround import PROJECTIONS, AutoRoundOptions, ExpertBlock, canonical_int4_from_autoround
from musecore.calibrate import LayerwiseRun, calibration_windows, capture_routed_inputs
from musecore.model import PREFIX
from musecore.ops import ExpertWeights
from musecore.ops import reference as ref
from musecore_quant import QTensor, dequantize, quantize
from musecore_quant.formats.int4 import int4_dequantize
from tests.helpers import random_tensors, small_config, write_checkpoint

# auto-round leaves INT Linears whose dims are not multiples of 32 unquantized: hidden 32, intermediate 64.
# Layer 0 is a dense-MLP layer (no experts), layer 3 keeps BF16 experts: layers 1 and 2 are calibrated.
CONFIG = dict(moe_hidden_size=32, moe_intermediate_size=64, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
GROUP = 32
ITERS = 12


def needs_auto_round():
    return pytest.importorskip("auto_round", reason="auto-round is not installed (pip install -e '.[autoround]')")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    config = small_config(**CONFIG)
    tensors = random_tensors(config, seed=14, dtype=torch.bfloat16)  # its router reaches every expert of layers 1, 2
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", config, tensors)
    model = musecore.load(folder, device="cpu", dtype=torch.float32, progress=False)
    ids = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(7))
    return folder, config, tensors, model, ids


def router_choices(model, ids, layer):
    """The router's top-k and the pooled latents at ``layer``, from the model's own ops on the MoE input
    (``MoE.__call__``'s first two lines)."""
    run = LayerwiseRun(model, ids)
    for i in range(layer):
        run.feedforward(i, run.attention(i))
    m = torch.cat([m for _, m in run.attention(layer)]).reshape(-1, model.config.hidden_size)
    mlp, ops = model.layers[layer].mlp, model.ops
    weights, chosen = ops.router_topk(m, mlp.router, mlp.correction_bias, mlp.top_k, mlp.multiplier, mlp.scaling)
    z = ops.rms_norm(ops.linear(m, mlp.pre_expert_proj), mlp.pre_expert_norm, mlp.eps)
    return weights, chosen, z.float()


def expert_weights(tensors, config, layer, e):
    """Expert ``e`` of ``layer`` from transformers' fused tensors: {projection: fp32 [out, in]}."""
    prefix, inter = f"{PREFIX}layers.{layer}.mlp.experts.", config.moe_intermediate_size
    gate_up = tensors[prefix + "gate_up_proj"][e].float()
    down = tensors[prefix + "down_proj"][e].float()
    return {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": down}


def post_expert_norm(tensors, layer):
    """The layer's shared post-expert norm as the model applies it: ``1 + w`` (stored centred)."""
    return 1.0 + tensors[f"{PREFIX}layers.{layer}.mlp.experts.post_expert_norm.weight"].float()


def routed_output(z, w, gate, up, down, post_norm, post_eps):
    """``w * InputScaledRMSNorm(expert(z), post_norm)`` with the reference ops: what the expert adds to
    the MoE sum (the shared post-expert norm, scale first, then the routing weight)."""
    out = (F.silu(z @ gate.T) * (z @ up.T)) @ down.T
    return w[:, None] * ref.rms_norm(out, post_norm, post_eps, scale_first=True)


# ---------------------------------------------------------------------------------------- capture


def test_layerwise_run_gives_model_forward_logits(small):
    _, config, _, model, ids = small
    whole = model.forward(ids)
    for batch_size in (len(ids), 2):
        run = LayerwiseRun(model, ids, batch_size=batch_size)
        for i in range(config.num_hidden_layers):
            run.feedforward(i, run.attention(i))
        got = run.logits().view(whole.shape)
        if batch_size == len(ids):  # the same matmuls as forward: bit for bit
            assert torch.equal(got, whole)
        else:                       # other batch shapes may block the matmuls differently
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


def test_capture_sends_each_expert_exactly_the_tokens_the_router_picked(small):
    _, config, _, model, ids = small
    captured = capture_routed_inputs(model, ids, max_tokens=10_000)
    assert sorted(captured) == config.sparse_layers == [1, 2, 3]
    for layer in config.sparse_layers:
        weights, chosen, z = router_choices(model, ids, layer)
        for e, got in enumerate(captured[layer]):
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            assert torch.equal(got.tokens, tokens), f"layer {layer} expert {e}: tokens differ from router_topk's"
            assert got.routed == len(tokens)
            assert torch.equal(got.weights, weights[tokens, slot])
            assert torch.equal(got.z, z[tokens])
        assert sum(r.routed for r in captured[layer]) == ids.numel() * config.num_experts_per_tok


def test_capture_keeps_at_most_max_tokens_of_what_the_router_picked(small):
    _, config, _, model, ids = small
    full = capture_routed_inputs(model, ids, max_tokens=10_000, layers=[1])[1]
    capped = capture_routed_inputs(model, ids, max_tokens=5, layers=[1])[1]
    for e, (a, b) in enumerate(zip(full, capped)):
        assert b.routed == a.routed and len(b.tokens) == min(5, a.routed)
        keep = torch.isin(a.tokens, b.tokens)
        assert torch.equal(a.tokens[keep], b.tokens), f"expert {e}: capped tokens are not a subset in order"
        assert torch.equal(a.weights[keep], b.weights) and torch.equal(a.z[keep], b.z)
        if a.routed > 5:  # the rest: other routed rows, kept for measuring off the tuning set
            rest_z, rest_w = b.rest
            assert len(rest_z) == min(5, a.routed - 5)
            match = (rest_z[:, None, :] == a.z[~keep][None]).all(-1)          # [rest, not kept]
            assert bool(match.any(1).all()), f"expert {e}: a left-out row is not a routed, unkept row"
            assert torch.equal(rest_w, a.weights[~keep][match.float().argmax(1)])
        else:
            assert b.rest is None


def test_calibration_windows_cut_a_stream_into_sequences():
    ids = calibration_windows(list(range(100)), tokens=90, seq_len=20)
    assert ids.shape == (4, 20) and ids[1, 0].item() == 20
    with pytest.raises(ValueError, match="at least seq_len"):
        calibration_windows([1, 2, 3], tokens=10, seq_len=8)


def test_dense_mlp_layers_are_refused_for_expert_calibration(small):
    from musecore.calibrate import AutoRoundQuantizer
    _, config, _, model, ids = small
    assert not config.is_sparse(0)
    with pytest.raises(ValueError, match=r"layers \[0\] are dense-MLP layers.*sparse layers \[1, 2, 3\]"):
        capture_routed_inputs(model, ids, layers=[0, 1])
    with pytest.raises(ValueError, match=r"layers \[0\] are dense-MLP layers"):
        AutoRoundQuantizer(model, ids, layers=[0])   # refused before auto-round is needed
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        capture_routed_inputs(model, ids, layers=[4])


# ---------------------------------------------------------------------- mapping to canonical INT4


def test_autoround_grid_maps_onto_canonical_int4_with_negative_scales():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (16, 64), generator=gen).float()
    scale = (torch.randn(16, 2, generator=gen) * 0.01).to(torch.float16)       # signed, as auto-round leaves it
    qdq = q * scale.float().repeat_interleave(32, dim=-1)
    qt = canonical_int4_from_autoround(qdq, scale, 8, group_size=32, sym=True)
    assert qt.zero is None and qt.scale.dtype == torch.float16 and bool((qt.scale < 0).any())
    assert torch.equal(int4_dequantize(qt), qdq)
    with pytest.raises(RuntimeError, match="does not reproduce"):
        canonical_int4_from_autoround(qdq + 1e-4, scale, 8, group_size=32, sym=True)


# ----------------------------------------------------------------------------- AutoRound tuning


@pytest.fixture(scope="module")
def tuned(small):
    needs_auto_round()
    from musecore.calibrate import autoround_quantizer
    _, _, _, model, ids = small
    # nsamples * tokens_per_sample covers every routed token, so each expert is tuned on exactly
    # the tokens the error is measured on below (full batch).
    return autoround_quantizer(model, ids, layers=[1], iters=ITERS, group_size=GROUP, nsamples=16,
                               tokens_per_sample=8)


def test_autoround_quantizer_returns_canonical_int4_within_its_error_bound(small, tuned):
    _, config, tensors, _, _ = small
    # sign-SGD with lr 1/iters decaying linearly to 0 moves a parameter by at most (iters+1)/(2 iters):
    # the rounding offset v stays within that, and min/max tuning shrinks a group's range by at most it.
    drift = (ITERS + 1) / (2 * ITERS)
    for e in range(config.num_local_experts):
        weights = expert_weights(tensors, config, 1, e)
        for p in PROJECTIONS:
            name = f"{PREFIX}layers.1.mlp.experts.{e}.{p}.weight"
            w = weights[p]
            qt = tuned(name, w)
            out_f, in_f = w.shape
            assert isinstance(qt, QTensor) and qt.format == "int4" and qt.layout == "canonical"
            assert qt.shape == (out_f, in_f) and qt.group_size == GROUP and qt.zero is None
            assert qt.data.dtype == torch.uint8 and qt.data.shape == (out_f, in_f // 2)
            assert qt.scale.dtype == torch.float16 and qt.scale.shape == (out_f, in_f // GROUP)
            w_hat = dequantize(qt, torch.float32)
            step = qt.scale.float().abs().repeat_interleave(GROUP, dim=-1)
            ends = torch.stack([-8 * qt.scale.float(), 7 * qt.scale.float()]).repeat_interleave(GROUP, dim=-1)
            beyond = (ends.amin(0) - w).clamp(min=0) + (w - ends.amax(0)).clamp(min=0)
            excess = (w - w_hat).abs() - ((0.5 + drift) * step + beyond) * (1 + 1e-5)
            assert excess.max().item() <= 1e-7, f"{name}: error exceeds the bound by {excess.max().item():.3g}"
            rtn = quantize(w, "int4", group_size=GROUP, sym=True).scale.float().abs()
            ratio = qt.scale.float().abs() / rtn
            assert ratio.max().item() <= 1 + 1e-3 and ratio.min().item() >= 1 - drift - 1e-3, \
                f"{name}: scale / RTN scale in [{ratio.min().item():.3f}, {ratio.max().item():.3f}]"


def test_fused_expert_names_get_every_experts_tuned_int4_stacked_without_requantizing(small, tuned):
    """transformers' fused ``gate_up_proj [E, 2I, h]`` / ``down_proj [E, h, I]``: the per-expert results,
    gate rows then up rows, codes and scales unchanged."""
    _, config, tensors, _, _ = small
    prefix, E = f"{PREFIX}layers.1.mlp.experts.", config.num_local_experts
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        w = tensors[prefix + fused].float()
        qt = tuned(prefix + fused, w)
        assert isinstance(qt, QTensor) and qt.format == "int4" and qt.shape == tuple(w.shape)
        assert qt.group_size == GROUP and qt.zero is None and qt.scale.shape == (*w.shape[:2], w.shape[2] // GROUP)
        for e in range(E):
            weights = expert_weights(tensors, config, 1, e)
            each = [tuned(f"{prefix}{e}.{p}.weight", weights[p]) for p in parts]
            assert torch.equal(qt.data[e], torch.cat([q.data for q in each])), f"{fused}[{e}]: codes differ"
            assert torch.equal(qt.scale[e], torch.cat([q.scale for q in each])), f"{fused}[{e}]: scales differ"


def test_autoround_error_on_each_experts_routed_tokens_is_at_most_rtns(small, tuned):
    _, config, tensors, model, ids = small
    post_eps, norm = config.post_norm_eps, post_expert_norm(tensors, 1)
    routed = capture_routed_inputs(model, ids, max_tokens=10_000, layers=[1])[1]
    lines = []
    for e in range(config.num_local_experts):
        prefix = f"{PREFIX}layers.1.mlp.experts.{e}."
        w = expert_weights(tensors, config, 1, e)
        z, rw = routed[e].z, routed[e].weights
        assert len(z) <= 16 * 8, "the test needs every routed token inside the tuning set"
        target = routed_output(z, rw, w["gate_proj"], w["up_proj"], w["down_proj"], norm, post_eps)

        def mse(weights):
            return F.mse_loss(routed_output(z, rw, *(weights[p] for p in PROJECTIONS), norm, post_eps), target).item()

        rtn = mse({p: int4_dequantize(quantize(w[p], "int4", group_size=GROUP, sym=True)) for p in PROJECTIONS})
        ar = mse({p: dequantize(tuned(prefix + p + ".weight", w[p])) for p in PROJECTIONS})
        lines.append(f"expert {e}: {len(z):3d} tokens  RTN {rtn:.4e}  AutoRound {ar:.4e}")
        assert ar <= rtn * (1 + 1e-5), "\n".join(lines)
    print("\nrouted-output MSE, layer 1 (random model):\n" + "\n".join(lines))
    report = tuned.report.summary()
    assert report["autoround"] == config.num_local_experts and report["experts_worse_than_rtn"] == 0


def test_the_quantizer_refuses_weights_it_did_not_tune(small, tuned):
    _, config, tensors, _, _ = small
    for other_layer in (f"{PREFIX}layers.2.mlp.experts.0.up_proj.weight", f"{PREFIX}layers.2.mlp.experts.down_proj"):
        w = expert_weights(tensors, config, 2, 0)["up_proj"] if other_layer.endswith(".weight") else \
            tensors[other_layer].float()
        with pytest.raises(ValueError, match="layer 2 was not calibrated"):
            tuned(other_layer, w)
    for not_expert in (f"{PREFIX}layers.1.mlp.gate.weight", f"{PREFIX}layers.1.mlp.pre_expert_proj.weight"):
        with pytest.raises(ValueError, match="not a routed expert projection"):
            tuned(not_expert, tensors[not_expert].float())
    name = f"{PREFIX}layers.1.mlp.experts.0.up_proj.weight"
    with pytest.raises(ValueError, match="differs from the weight that was calibrated"):
        tuned(name, expert_weights(tensors, config, 1, 0)["up_proj"] * 1.01)
    fused = f"{PREFIX}layers.1.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match="differs from the weight that was calibrated"):
        tuned(fused, tensors[fused].float().flip(1))  # up rows before gate rows
    with pytest.raises(ValueError, match=r"differs from the weight that was calibrated \(shape"):
        tuned(fused, tensors[fused].float()[:, :config.moe_intermediate_size])


def test_experts_without_calibration_tokens_fall_back_to_rtn_and_are_counted(tmp_path):
    needs_auto_round()
    from musecore.calibrate import autoround_quantizer
    config = small_config(num_experts_per_tok=1, **CONFIG)
    tensors = random_tensors(config, seed=2, dtype=torch.bfloat16)
    model = musecore.load(write_checkpoint(tmp_path / "k1", config, tensors), device="cpu", dtype=torch.float32,
                          progress=False)
    ids = torch.tensor([[5, 9, 5]])                                   # 3 tokens, one expert each: most get none
    reached = {e for e, r in enumerate(capture_routed_inputs(model, ids, layers=[1])[1]) if r.routed}
    q = autoround_quantizer(model, ids, layers=[1], iters=2, group_size=GROUP, tokens_per_sample=4)
    fallback = {e for _, e in q.report.rtn_fallback}
    assert fallback == set(range(config.num_local_experts)) - reached
    assert len(fallback) >= config.num_local_experts - 3
    assert q.report.summary()["rtn_fallback"] == len(fallback)
    for e in fallback:
        w = expert_weights(tensors, config, 1, e)["down_proj"]
        rtn = quantize(w, "int4", group_size=GROUP, sym=True)
        assert torch.equal(dequantize(q(f"{PREFIX}layers.1.mlp.experts.{e}.down_proj.weight", w)), dequantize(rtn))


def unfused(tensors):
    """The same weights with every fused expert tensor split into a producer's per-expert keys."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def test_calibrate_command_writes_a_checkpoint_that_loads_with_the_tuned_weights(small, tmp_path, capsys):
    needs_auto_round()
    from musecore.calibrate import REPORT_FILE, autoround_quantizer, main, quantized_experts
    from musecore_quant.convert import convert
    folder, config, tensors, model, ids = small
    ids.flatten().to(torch.int16).numpy().tofile(tmp_path / "calib.i16")
    argv = [str(folder), str(tmp_path / "int4"), "--calibration", str(tmp_path / "calib.i16"), "--tokens",
            str(ids.numel()), "--seq-len", "40", "--layers", "2", "--iters", "4", "--group-size", str(GROUP),
            "--nsamples", "4", "--tokens-per-sample", "8", "--json"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "int4" / REPORT_FILE).read_text())
    assert printed == saved and saved["layers"] == [2] and saved["summary"]["experts"] == config.num_local_experts
    import jsonschema
    from musecore.schemas import load_schema
    jsonschema.validate(printed, load_schema("calibrate"))  # the published schema of --json
    conversion = json.loads((tmp_path / "int4" / "conversion_report.json").read_text())
    assert conversion["method"] == "autoround"
    # the source holds transformers' fused experts: one gate_up_proj and one down_proj per layer
    assert conversion["summary"]["actions"] == {"copy": len(tensors) - 2, "quantize": 2}
    assert any(r["method"] == "autoround" for r in saved["experts"])
    for r in saved["experts"]:  # tokens beyond the cap (32) measure the error off the tuning set
        # an expert the router sent nothing falls back to RTN (its own test below); every other is tuned
        assert r["method"] == ("autoround" if r["routed_tokens"] else "rtn"), r
        assert r["tuned_tokens"] == min(r["routed_tokens"], 32)
        assert r["heldout_tokens"] == min(r["routed_tokens"] - r["tuned_tokens"], r["tuned_tokens"])
        assert (r["heldout_loss_rtn"] is None) == (r["heldout_tokens"] == 0)
    again = autoround_quantizer(model, calibration_windows(ids.flatten(), ids.numel(), 40), layers=[2], iters=4,
                                group_size=GROUP, nsamples=4, tokens_per_sample=8)    # seeded: the same result
    # a producer's per-expert source converts through the same quantizer (per-expert names)
    per_expert_src = write_checkpoint(tmp_path / "per-expert", config, unfused(tensors))
    convert(per_expert_src, tmp_path / "int4-per-expert", to="int4", method="autoround",
            include=again.include_patterns(), quantize_options={"group_size": GROUP, "sym": True}, progress=False,
            calibrated_quantizer=again)
    for dst in ("int4", "int4-per-expert"):
        loaded = musecore.load(tmp_path / dst, device="cpu", dtype=torch.float32, progress=False)
        for e in range(config.num_local_experts):
            weights = expert_weights(tensors, config, 2, e)
            for p, stacked in zip(PROJECTIONS, ("gate", "up", "down")):
                name = f"{PREFIX}layers.2.mlp.experts.{e}.{p}.weight"
                want = dequantize(again(name, weights[p]))
                assert torch.equal(getattr(loaded.layers[2].mlp.experts, stacked)[e], want), f"{dst}: {name}"
        untouched = loaded.layers[1].mlp.experts.up[0]
        assert torch.equal(untouched, expert_weights(tensors, config, 1, 0)["up_proj"]), dst
        # the loaded model computes what calibration propagated: the BF16 model with layer 2's tuned experts
        run = LayerwiseRun(model, ids[:1, :12])
        for i in range(config.num_hidden_layers):
            hm = run.attention(i)
            run.feedforward(i, hm, experts=quantized_experts(model.layers[i].mlp.experts, again.results[i])
                            if i == 2 else None)
        assert torch.equal(loaded.forward(ids[:1, :12]).flatten(), run.logits().flatten()), dst


def test_expert_block_is_the_experts_routed_contribution_to_the_moe_sum(small):
    _, config, tensors, model, _ = small
    e, post_eps = 3, config.post_norm_eps
    w = expert_weights(tensors, config, 1, e)
    norm = post_expert_norm(tensors, 1)
    block = ExpertBlock(config.moe_hidden_size, config.moe_intermediate_size, post_eps)
    block.load(w["gate_proj"], w["up_proj"], w["down_proj"], norm)
    z, rw = torch.randn(9, config.moe_hidden_size), torch.rand(9)
    torch.testing.assert_close(block(z, rw), routed_output(z, rw, *w.values(), norm, post_eps), rtol=1e-6, atol=1e-7)
    assert torch.equal(model.layers[1].mlp.post_expert_norm, norm), "the model holds the shared norm as 1 + w"


def test_expert_blocks_with_the_shared_post_norm_sum_to_the_moe_op(small):
    """Each expert's block, summed over the experts the router picked, is the reference ``moe`` op: one
    post-expert norm for all experts, applied scale first to each expert's output, before its routing weight."""
    _, config, tensors, model, _ = small
    mlp, post_eps = model.layers[1].mlp, config.post_norm_eps
    E, k = config.num_local_experts, config.num_experts_per_tok
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(11, config.moe_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(len(z))])            # [N, k]
    weights = torch.rand(len(z), k, generator=gen)
    want = ref.moe(z, weights, ids, mlp.experts, mlp.post_expert_norm, post_eps)                 # [N, h] fp32
    block = ExpertBlock(config.moe_hidden_size, config.moe_intermediate_size, post_eps)
    got = torch.zeros_like(want)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        block.load(mlp.experts.gate[e], mlp.experts.up[e], mlp.experts.down[e], mlp.post_expert_norm)
        got.index_add_(0, tok, block(z[tok], weights[tok, slot]).detach())
    err = (got - want).abs().max().item()
    assert err <= 1e-6 * want.abs().max().item(), f"blocks vs reference moe: max |diff| {err:.3g}"
    # an expert's own norm after its output (the old per-expert norm) is a different computation
    plain = ExpertWeights(mlp.experts.gate, mlp.experts.up, mlp.experts.down, "fp32", E)
    unnormed = ref.moe(z, weights, ids, plain, torch.ones(config.moe_hidden_size), post_eps)
    assert (unnormed * mlp.post_expert_norm - want).abs().max().item() > 100 * err + 1e-4


def test_options_reject_nonsense():
    with pytest.raises(ValueError, match="iters"):
        AutoRoundOptions(iters=0)
    assert AutoRoundOptions(nsamples=4, tokens_per_sample=8).max_tokens == 32


def test_musecore_quant_convert_method_autoround_runs_through_musecores_calibrator(small, tmp_path, monkeypatch):
    """`musecore-quant convert --method autoround` finds musecore's calibrator by entry point."""
    needs_auto_round()
    import functools

    import musecore.calibrate as calibrate
    from musecore_quant.cli import main as quant_main
    folder, config, tensors, model, ids = small
    ids.flatten().to(torch.int16).numpy().tofile(tmp_path / "calib.i16")
    small_options = dict(tokens=ids.numel(), seq_len=40, layers=[2], iters=2, group_size=GROUP, nsamples=4,
                         tokens_per_sample=8)  # the CLI's defaults are sized for real models: keep the test fast
    monkeypatch.setattr(calibrate, "convert_autoround", functools.partial(calibrate.convert_autoround, **small_options))
    dst = tmp_path / "int4-cli"
    code = quant_main(["convert", str(folder), str(dst), "--to", "int4", "--method", "autoround",
                       "--calibration", str(tmp_path / "calib.i16"), "--no-progress"])
    assert code == 0
    report = json.loads((dst / "conversion_report.json").read_text())
    assert report["method"] == "autoround" and report["summary"]["actions"]["quantize"] == 2  # fused gate_up, down
    assert (dst / calibrate.REPORT_FILE).is_file()



def test_musecore_quant_autoround_without_calibration_is_a_one_line_error(small, tmp_path, capsys):
    from musecore_quant.cli import main as quant_main
    folder = small[0]
    code = quant_main(["convert", str(folder), str(tmp_path / "x"), "--to", "int4", "--method", "autoround"])
    assert code == 2 and "--calibration" in capsys.readouterr().err


def test_autoround_int4_checkpoint_generates_natively_on_the_xeon_backend(tmp_path):
    """The AutoRound INT4 checkpoint (group 128, every quantized layer) runs through the xeon kernels."""
    needs_auto_round()
    from musecore.backends.registry import discover
    from musecore.calibrate import convert_autoround
    xeon = discover().get("xeon")
    if xeon is None or not (xeon.loaded and xeon.probe.available and "xeon" in xeon.probe.devices):
        pytest.skip(f"xeon backend not usable here: {xeon.error or xeon.probe.reason if xeon else 'not installed'}")
    config = small_config(hidden_size=128, head_dim=32, moe_hidden_size=128, moe_intermediate_size=128)
    src = write_checkpoint(tmp_path / "bf16", config, random_tensors(config, seed=3, dtype=torch.bfloat16))
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    convert_autoround(src, tmp_path / "int4", ids.flatten(), tokens=ids.numel(), seq_len=40, iters=2,
                      nsamples=4, tokens_per_sample=8, progress=False)
    native = musecore.load(tmp_path / "int4", device="xeon", progress=False)
    assert native.backend.name == "xeon" and native.layers[1].mlp.experts.format == "int4"
    # the tuned INT4 experts are used as they are; only the BF16 dense projections are quantized (xeon's default)
    assert not any(".mlp.experts." in r.name for r in native.conversion_report), "no expert should be requantized"
    assert {r.source for r in native.conversion_report} == {"bf16"} and native.lm_head.format == "int4"
    assert len(native.generate(ids[0, :12].tolist(), max_new_tokens=4)) == 4
    # the checkpoint's own tuned experts, natively and emulated, op by op on the same inputs: a random model's
    # logits swing on a last-bit difference (a routing choice flips: NMSE 1e-4 to 5e-2 between runs), so the
    # comparison is made where the kernels act, each within its op tolerance (musecore.ops.TOLERANCE_NMSE)
    from musecore.ops import tolerance
    native = musecore.load(tmp_path / "int4", device="xeon", progress=False, quantize_dense=False)
    emulated = musecore.load(tmp_path / "int4", device="xeon", emulate=True, progress=False, quantize_dense=False)
    gen = torch.Generator().manual_seed(2)
    for i in config.sparse_layers:
        mine, theirs = native.layers[i].mlp, emulated.layers[i].mlp
        z = torch.randn(7, config.moe_hidden_size, generator=gen).to(torch.bfloat16)
        m = torch.randn(7, config.hidden_size, generator=gen)
        w, e = emulated.ops.router_topk(m, theirs.router, theirs.correction_bias, config.num_experts_per_tok,
                                        config.output_multiplier, config.routed_scaling_factor)
        got = native.ops.moe(z, w, e, mine.experts, mine.post_expert_norm, config.post_norm_eps)
        want = emulated.ops.moe(z, w, e, theirs.experts, theirs.post_expert_norm, config.post_norm_eps)
        err = nmse(want, got)
        assert err < tolerance("moe"), f"layer {i} {mine.experts.format} moe: xeon vs emulated NMSE {err:.3e}"


# ---------------------------------------------------------------------------------------------------------------
# Dense groups (attention, pooler/unpooler, lm_head): inputs captured from the model, each Linear tuned alone


@pytest.fixture
def one_thread():
    """auto-round's many tiny ops run fastest on one thread; on a shared box two spin (measured 16x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_captured_lm_head_inputs_reproduce_the_models_logits(small, one_thread):
    from musecore.calibrate import capture_linear_inputs
    _, config, tensors, model, ids = small
    captured = capture_linear_inputs(model, ids, ["lm_head.weight"], max_rows=10_000)["lm_head.weight"]
    logits = model.forward(ids).float().reshape(-1, config.vocab_size)
    again = ref.logit_softcap(captured @ tensors["lm_head.weight"].float().T, config.output_multiplier,
                              config.final_logit_softcapping)
    err = nmse(again, logits)
    assert captured.shape == (ids.numel(), config.hidden_size) and err < 1e-10, f"NMSE {err:.3e}"
    assert model.ops is not None and type(model.ops).__name__ != "LinearInputRecorder", "the op set is restored"


def test_dense_autoround_tunes_every_linear_of_the_groups_no_worse_than_rtn_on_its_rows(small, tmp_path, one_thread):
    needs_auto_round()
    from musecore.calibrate import DenseAutoRoundQuantizer
    folder, config, tensors, model, ids = small
    pooler = f"{PREFIX}layers.1.mlp.pre_expert_proj.weight"
    dense = DenseAutoRoundQuantizer(model, folder, ids, ("pooler/unpooler", "lm_head"), names=[pooler, "lm_head.weight"],
                                    options=AutoRoundOptions(iters=ITERS, nsamples=8, tokens_per_sample=8, group_size=GROUP))
    methods = {r.name: r.method for r in dense.reports}
    # the small model's vocabulary (97) is no multiple of 32: auto-round would leave lm_head in 16 bits
    assert methods == {pooler: "autoround", "lm_head.weight": "rtn"}, methods
    assert dense.report()["rtn_fallback"] == ["lm_head.weight"]
    for r in dense.reports:  # iteration 0 is RTN and auto-round keeps the best iteration on its rows
        if r.method == "autoround":
            assert r.loss_autoround <= r.loss_rtn * (1 + 1e-6), (r.name, r.loss_rtn, r.loss_autoround)
    qt = dense("lm_head.weight", tensors["lm_head.weight"].float())
    err = (dequantize(qt) - tensors["lm_head.weight"].float()).abs() / qt.scale.float().abs().repeat_interleave(GROUP, -1)
    assert qt.format == "int4" and float(err.max()) <= 1.0 + 1e-6, f"max error {float(err.max()):.3f} steps"
    with pytest.raises(ValueError, match="was not tuned"):
        dense("model.language_model.layers.1.self_attn.q_proj.weight", torch.zeros(1))
