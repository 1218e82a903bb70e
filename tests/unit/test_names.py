"""The Muse tensor-name rules (musecore.names): one table of real checkpoint names and what they are."""

import pytest

from musecore.config import MuseConfig
from musecore.names import (ATTENTION, DENSE_MLP, EMBEDDING, EXPERTS_BF16, EXPERTS_QUANTIZED, LM_HEAD, NORMS, POOLER,
                            ROUTER, TOWERS, expert_key, expert_patterns, expert_weight, fused_expert_name,
                            is_fp32_tensor, layer_of, op_of_weight, quantized_expert_layers, quantized_expert_patterns,
                            weight_group)

CONFIG = MuseConfig.from_name("muse-spark-open-816b-a42b")  # 62 layers, all sparse: 0 and 61 keep BF16 experts
L = "model.language_model.layers."

# (name, group, quantizable, op, fp32)
TABLE = [
    ("model.language_model.embed_tokens.weight", EMBEDDING, False, "embedding", False),
    ("model.language_model.norm.weight", NORMS, False, None, False),
    ("lm_head.weight", LM_HEAD, False, "linear", False),
    (L + "3.self_attn.q_proj.weight", ATTENTION, False, "linear", False),
    (L + "3.self_attn.gate_proj.weight", ATTENTION, False, "linear", False),
    (L + "3.self_attn.o_proj.weight", ATTENTION, False, "linear", False),
    (L + "3.input_layernorm.weight", NORMS, False, None, False),
    (L + "3.post_attention_residual_gate.gate", NORMS, False, None, True),
    (L + "3.post_feedforward_residual_gate.gate", NORMS, False, None, True),
    (L + "3.mlp.gate.weight", ROUTER, False, None, True),
    (L + "3.mlp.gate.e_score_correction_bias", ROUTER, False, None, True),
    (L + "3.mlp.pre_expert_proj.weight", POOLER, False, "linear", False),
    (L + "3.mlp.post_expert_proj.weight", POOLER, False, "linear", False),
    (L + "3.mlp.pre_expert_norm.weight", NORMS, False, None, False),
    (L + "3.mlp.experts.post_expert_norm.weight", NORMS, False, None, False),
    (L + "3.mlp.experts.gate_up_proj", EXPERTS_QUANTIZED, True, "moe", False),
    (L + "3.mlp.experts.down_proj", EXPERTS_QUANTIZED, True, "moe", False),
    (L + "3.mlp.experts.17.up_proj.weight", EXPERTS_QUANTIZED, True, "moe", False),
    (L + "0.mlp.experts.gate_up_proj", EXPERTS_BF16, False, "moe", False),
    (L + "61.mlp.experts.5.down_proj.weight", EXPERTS_BF16, False, "moe", False),
    (L + "2.mlp.gate_proj.weight", DENSE_MLP, False, "linear", False),  # a dense-MLP layer's
    (L + "2.mlp.down_proj.weight", DENSE_MLP, False, "linear", False),
    ("model.vision_tower.blocks.0.attn.q_proj.weight", TOWERS, False, None, False),  # not run
    ("model.audio_tower.stages.0.norm.weight", TOWERS, False, None, False),
]


@pytest.mark.parametrize("name, group, quantizable, op, fp32", TABLE, ids=[row[0] for row in TABLE])
def test_each_real_tensor_name_belongs_to_its_group(name, group, quantizable, op, fp32):
    assert weight_group(name, CONFIG) == (group, quantizable)
    assert op_of_weight(name) == op
    assert is_fp32_tensor(name) == fp32


def test_expert_names_parse_fused_and_per_expert_alike():
    fused = expert_weight(L + "7.mlp.experts.gate_up_proj")
    assert (fused.layer, fused.expert, fused.proj, fused.fused) == (7, None, "gate_up_proj", True)
    one = expert_weight(L + "7.mlp.experts.12.down_proj.weight")
    assert (one.layer, one.expert, one.proj, one.fused) == (7, 12, "down_proj", False)
    assert expert_weight(L + "7.mlp.experts.post_expert_norm.weight") is None
    assert expert_key(L + "7.mlp.experts.12.up_proj.weight") == (L + "7.mlp.experts", 12, "up")
    assert fused_expert_name(L + "7.mlp.experts", "up") == L + "7.mlp.experts.gate_up_proj"
    assert layer_of(L + "40.self_attn.k_proj.weight") == 40 and layer_of("lm_head.weight") is None


def test_quantized_expert_layers_and_patterns_agree_with_musecore_quants_rule():
    import re
    assert quantized_expert_layers(CONFIG) == list(range(1, 61))
    rule = [re.compile(p) for p in quantized_expert_patterns(CONFIG)]
    mine = [re.compile(p) for p in expert_patterns(quantized_expert_layers(CONFIG))]
    for name, group, *_ in TABLE:
        assert any(r.search(name) for r in rule) == (group == EXPERTS_QUANTIZED), name
        assert any(r.search(name) for r in mine) == (group == EXPERTS_QUANTIZED), name
