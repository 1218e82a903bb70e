"""musecore computes what transformers 5.24's ``muse_spark`` computes (the model's reference).

Random tiny ``MuseSparkForConditionalGeneration`` models are built and saved by transformers (its
``save_pretrained`` is the ground truth of the checkpoint layout) and loaded by musecore; logits
are compared whole-sequence and through the KV cache past the sliding window, and greedy
generation token for token. The reverse direction: a checkpoint musecore writes loads in
transformers with no missing or unexpected keys and the same logits.

Tolerances. fp32: max |difference| <= 1e-4 x max |logit| (both sides compute in fp32; what differs
is summation order). bf16: both implementations round to bf16 at different points (transformers
rounds after every module, the musecore reference after every op; MODEL.md allows an fp32 expert
sum), so the two bf16 results are compared through the fp32 truth, per position (the RMS over the
vocabulary) and then the median over 4 x 24 positions: a max or a mean over a tiny random model is
dominated by the few positions where one implementation's rounding flips a routing choice (which
side flips is chance: the mean-RMS ratio measured 0.8-2.4x over configs and seeds). musecore's
median bf16 error against transformers' fp32 logits must be at most 1.5x transformers' own, and
their direct median difference at most 2x it (two independent errors of equal size differ by ~1.4x).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers 5.24 is the test oracle (pip install -e '.[test]')")
if not hasattr(transformers, "MuseSparkForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} has no muse_spark (needs 5.24)", allow_module_level=True)

import musecore  # noqa: E402
from musecore.config import MuseConfig  # noqa: E402
from tests.helpers import random_tensors, small_config, write_checkpoint  # noqa: E402

TOWERS = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
              audio_config=dict(hidden_sizes=[16, 16, 16, 16], depths=[1, 1, 1, 1]))

# Tiny configs that between them cover GQA ratios 1/2/4, sliding and full (NoPE) layers, dense and
# sparse MLP layers, top-1 and top-3 routing with a routed scaling factor, and the multipliers.
CONFIGS = {
    "gqa2-sparse": dict(num_attention_heads=4, num_key_value_heads=2, qk_scale_factor=5.4730064863875),
    "gqa4-dense-layers": dict(num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                              mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"]),
    "mha-top3-scaled": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts_per_tok=3,
                            routed_scaling_factor=2.5, qk_scale_factor=3.0, output_multiplier=0.3,
                            final_logit_softcapping=5.0),
}


def hf_config(text: dict):
    from transformers import MuseSparkConfig
    return MuseSparkConfig(text_config=text, out_hidden_size=64, projector_hidden_size=64,
                           vision_config=TOWERS["vision_config"],
                           audio_config={**TOWERS["audio_config"], "out_hidden_size": text["hidden_size"]},
                           image_token_id=text["vocab_size"] - 3, video_token_id=text["vocab_size"] - 2,
                           audio_token_id=text["vocab_size"] - 1)


def text_config(**overrides) -> dict:
    """The text config of :func:`tests.helpers.small_config` with ``overrides``, as transformers takes it."""
    config = small_config(**overrides)
    return {k: v for k, v in config.text_dict().items() if k != "model_type"}


def perturb(model) -> None:
    """Non-trivial values where transformers initialises zeros/ones: centred norms, gates, the bias."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "residual_gate.gate")) and "language_model" in name:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """(folder, fp32 transformers model, its text config) for one tiny config, saved in fp32."""
    from transformers import MuseSparkForConditionalGeneration
    text = text_config(**CONFIGS[request.param])
    torch.manual_seed(0)
    model = MuseSparkForConditionalGeneration(hf_config(text)).eval()
    perturb(model)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model, text


def tokens(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab - 3, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_fp32_logits_equal_transformers_on_its_own_checkpoint(saved):
    folder, model, text = saved
    ids = tokens(text["vocab_size"], 2, 12)
    ids[0, 3] = text["vocab_size"] - 3  # an image placeholder without features embeds as token 0 in both
    ours = musecore.load(folder, device="cpu", dtype=torch.float32).forward(ids)
    err = relative_error(ours, hf_logits(model, ids))
    assert err <= 1e-4, f"fp32 logits differ from transformers by {err:.2e} of max |logit| (tolerance 1e-4)"


def test_kv_cache_decode_past_the_sliding_window_equals_transformers(saved):
    folder, model, text = saved
    length = 3 * text["sliding_window"] + 4
    ids = tokens(text["vocab_size"], 2, length, seed=1)
    muse = musecore.load(folder, device="cpu", dtype=torch.float32)
    cache = muse.new_cache(batch=2, max_length=length)
    steps = [muse.forward(ids[:, :7], cache=cache)] + [muse.forward(ids[:, t:t + 1], cache=cache)
                                                        for t in range(7, length)]
    err = relative_error(torch.cat(steps, 1), hf_logits(model, ids))
    assert err <= 1e-4, f"cached decode differs from transformers' whole-sequence logits by {err:.2e} (tolerance 1e-4)"


def test_greedy_generate_equals_transformers_token_for_token(saved):
    folder, model, text = saved
    prompt = tokens(text["vocab_size"], 1, 5, seed=2)
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=3 * text["sliding_window"], do_sample=False,
                                eos_token_id=None, pad_token_id=text["pad_token_id"])[0, 5:].tolist()
    muse = musecore.load(folder, device="cpu", dtype=torch.float32)
    ours = muse.generate(prompt[0].tolist(), max_new_tokens=len(theirs), stop=[])
    assert ours == theirs


def test_bf16_logits_are_as_close_to_fp32_as_transformers_own_bf16(saved, tmp_path):
    from transformers import MuseSparkForConditionalGeneration
    folder, model, text = saved
    ids = tokens(text["vocab_size"], 4, 24, seed=3)
    truth = hf_logits(model, ids)
    bf16_model = MuseSparkForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    theirs = hf_logits(bf16_model, ids)
    ours = musecore.load(folder, device="cpu", dtype=torch.bfloat16).forward(ids)
    error = lambda a, b: (a - b).pow(2).mean(-1).sqrt().median().item()  # noqa: E731  (RMS per position)
    their_err, our_err, direct = error(theirs, truth), error(ours, truth), error(ours, theirs)
    assert our_err <= 1.5 * their_err, f"musecore bf16 median error {our_err:.3e} vs transformers' {their_err:.3e}"
    assert direct <= 2.0 * their_err, f"musecore vs transformers bf16: median {direct:.3e} (their error {their_err:.3e})"


def test_config_round_trips_through_transformers(saved, tmp_path):
    from transformers import MuseSparkConfig
    folder, _model, _text = saved
    ours = MuseConfig.from_pretrained(folder)
    ours.save_pretrained(tmp_path)
    again = MuseSparkConfig.from_pretrained(tmp_path)
    assert again.to_dict()["text_config"] == MuseSparkConfig.from_pretrained(folder).to_dict()["text_config"]
    assert MuseConfig.from_pretrained(tmp_path).to_dict() == ours.to_dict()


def test_parameter_counts_equal_a_count_over_the_transformers_model(saved):
    folder, model, _text = saved
    config = MuseConfig.from_pretrained(folder)
    text_params = sum(p.numel() for name, p in model.named_parameters()
                      if name.startswith(("model.language_model.", "lm_head.")))
    assert config.num_parameters() == text_params
    experts = [m for m in model.modules() if type(m).__name__ == "MuseSparkExperts"]
    inactive = sum((config.num_local_experts - config.num_experts_per_tok) * e.gate_up_proj[0].numel()
                   + (config.num_local_experts - config.num_experts_per_tok) * e.down_proj[0].numel() for e in experts)
    assert config.num_active_parameters() == text_params - inactive


def test_a_checkpoint_musecore_writes_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration
    config = small_config(num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"], out_hidden_size=64,
                          projector_hidden_size=64, **TOWERS)
    tensors = random_tensors(config, seed=4)
    with torch.no_grad():  # the towers' tensors come from transformers (musecore does not run them yet)
        towers = MuseSparkForConditionalGeneration(MuseSparkConfig.from_dict(config.to_dict())).state_dict()
    tensors.update({k: v for k, v in towers.items() if k.startswith(("model.vision", "model.audio"))})
    write_checkpoint(tmp_path, config, tensors)
    model, info = MuseSparkForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ids = tokens(config.vocab_size, 2, 10, seed=5)
    err = relative_error(musecore.load(tmp_path, device="cpu", dtype=torch.float32).forward(ids),
                         hf_logits(model.eval(), ids))
    assert err <= 1e-4, f"logits differ by {err:.2e} of max |logit| (tolerance 1e-4)"


def test_nvfp4_checkpoint_matches_its_dequantized_twin(saved, tmp_path):
    """The checkpoint converted to NVFP4 by musecore-quant (ModelOpt's layout: the routed experts of the
    inner layers, per expert) loads and gives the logits of the same model with those experts
    dequantised to fp32: the NVFP4 path computes on exactly the stored values."""
    from musecore.quantize import convert_muse_checkpoint
    from musecore_quant import QTensor, dequantize
    from musecore_quant.checkpoint import open_checkpoint
    folder, _model, _text = saved
    config = MuseConfig.from_pretrained(folder)
    nvfp4 = tmp_path / "nvfp4"
    convert_muse_checkpoint(folder, nvfp4, to="nvfp4", progress=False)
    twin = {}
    with open_checkpoint(nvfp4) as reader:
        for _, weights in reader.iter_shards():
            twin.update({n: dequantize(v, torch.float32) if isinstance(v, QTensor) else v for n, v in weights.items()})
    quantized = [n for n in twin if ".experts." in n and n.endswith("_proj.weight")]
    assert quantized, "the conversion must quantize the inner layers' experts"
    write_checkpoint(tmp_path / "twin", config, twin)
    ids = tokens(config.vocab_size, 2, 10, seed=6)
    ours = musecore.load(nvfp4, device="cpu", dtype=torch.float32).forward(ids)
    expected = musecore.load(tmp_path / "twin", device="cpu", dtype=torch.float32).forward(ids)
    err = relative_error(ours, expected)
    assert err <= 1e-5, f"NVFP4 checkpoint vs its dequantised twin: {err:.2e} of max |logit| (tolerance 1e-5)"
