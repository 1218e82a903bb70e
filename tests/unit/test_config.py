import json

import pytest

from musecore.config import FULL, SLIDING, MuseConfig
from tests.helpers import SMALL


def test_816b_preset_counts_820_0b_parameters_and_46_1b_active():
    """transformers' defaults: 816.7B in the decoder layers plus 3.3B of embedding and lm_head; 42.8B
    of the layers are active per token (8 of 256 experts), 46.1B with embedding and lm_head."""
    config = MuseConfig.from_name("muse-spark-open-816b-a42b")
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert round(config.num_parameters() / 1e9, 1) == 820.0, config.num_parameters()
    assert round((config.num_parameters() - embeddings) / 1e9, 1) == 816.7
    assert round(config.num_active_parameters() / 1e9, 1) == 46.1, config.num_active_parameters()
    assert round((config.num_active_parameters() - embeddings) / 1e9, 1) == 42.8


def test_816b_preset_has_46_sliding_and_16_full_nope_layers_with_bf16_experts_at_the_ends():
    config = MuseConfig.from_name("muse-spark-open-816b-a42b")
    assert config.layer_types.count(SLIDING) == 46 and config.layer_types.count(FULL) == 16
    assert config.layer_types[-1] == FULL and config.bf16_expert_layers == [0, 61]
    assert [config.uses_rope(i) for i in range(62)] == [t == SLIDING for t in config.layer_types]  # NoPE = full
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (128, 16, 64)
    assert (config.moe_hidden_size, config.moe_intermediate_size, config.num_local_experts) == (4096, 4096, 256)


@pytest.mark.parametrize("name", ["muse-tiny", "muse-small"])
def test_presets_quantizable_dims_are_multiples_of_128(name):
    c = MuseConfig.from_name(name)
    for dim in (c.hidden_size, c.moe_hidden_size, c.moe_intermediate_size, c.num_attention_heads * c.head_dim):
        assert dim % 128 == 0, (name, dim)


def test_layer_types_full_on_every_fourth_layer_counted_back_from_the_last():
    c = MuseConfig(**{**SMALL, "num_hidden_layers": 6})
    assert c.layer_types == [SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL]
    assert c.layer_rope_theta == [500000.0, 0, 500000.0, 500000.0, 500000.0, 0]
    assert c.mlp_layer_types == ["sparse"] * 6


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="muse-tiny"):
        MuseConfig.from_name("muse-huge")


def test_a_config_that_is_not_muse_spark_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: model_type is 'llama', not 'muse_spark'"):
        MuseConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    with pytest.raises(ValueError, match="needs a text_config"):
        MuseConfig.from_pretrained(tmp_path)


def test_heads_not_dividing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        MuseConfig(**{**SMALL, "num_key_value_heads": 3})


def test_inconsistent_layer_lists_topk_and_absurd_values_are_errors():
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        MuseConfig(**{**SMALL, "layer_types": [SLIDING, FULL]})
    with pytest.raises(ValueError, match="unknown mlp_layer_types"):
        MuseConfig(**{**SMALL, "mlp_layer_types": ["sparse", "moe", "sparse", "sparse"]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MuseConfig(**{**SMALL, "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        MuseConfig(**{**SMALL, "hidden_size": -64})
    with pytest.raises(ValueError, match="post_norm_eps must be a positive finite number"):
        MuseConfig(**{**SMALL, "post_norm_eps": float("nan")})
    with pytest.raises(ValueError, match="rope_type 'llama3' is not supported"):
        MuseConfig(**{**SMALL, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}})


def test_nested_layout_and_unknown_keys_survive_a_round_trip(tmp_path):
    c = MuseConfig(**SMALL)
    data = c.to_dict()
    assert data["model_type"] == "muse_spark" and data["text_config"]["model_type"] == "muse_spark_text"
    assert data["text_config"]["num_local_experts"] == 6 and data["audio_config"]["out_hidden_size"] == 64
    data["architectures"] = ["MuseSparkForConditionalGeneration"]
    data["text_config"]["a_future_field"] = 3
    again = MuseConfig.from_dict(data)
    assert again.extra == {"architectures": ["MuseSparkForConditionalGeneration"]}
    assert again.text_extra == {"a_future_field": 3}
    again.save_pretrained(tmp_path)
    assert MuseConfig.from_pretrained(tmp_path).to_dict() == again.to_dict() == data
