import json

import pytest

from musecore.config import FULL, SLIDING, MuseConfig
from tests.helpers import SMALL


def test_816b_preset_has_815_9b_parameters_and_42_0b_active():
    config = MuseConfig.from_name("muse-spark-open-816b-a42b")
    assert round(config.num_parameters() / 1e9, 1) == 815.9, config.num_parameters()
    assert round(config.num_active_parameters() / 1e9, 1) == 42.0, config.num_active_parameters()


def test_816b_preset_has_46_sliding_and_16_global_layers_with_bf16_experts_at_the_ends():
    config = MuseConfig.from_name("muse-spark-open-816b-a42b")
    assert config.layer_types.count(SLIDING) == 46 and config.layer_types.count(FULL) == 16
    assert config.layer_types[-1] == FULL and config.bf16_expert_layers == [0, 61]


@pytest.mark.parametrize("name", ["muse-tiny", "muse-small"])
def test_presets_quantizable_dims_are_multiples_of_128(name):
    c = MuseConfig.from_name(name)
    for dim in (c.hidden_size, c.moe_latent_size, c.moe_intermediate_size, c.num_attention_heads * c.head_dim):
        assert dim % 128 == 0, (name, dim)


def test_small_preset_counts_match_model_md():
    c = MuseConfig.from_name("muse-small")
    assert 1.5e9 < c.num_parameters() < 1.7e9 and 0.45e9 < c.num_active_parameters() < 0.55e9


def test_layer_types_derived_from_period_with_last_layer_global():
    c = MuseConfig(**{**SMALL, "num_hidden_layers": 5, "global_layer_period": 2})
    assert c.layer_types == [SLIDING, FULL, SLIDING, FULL, FULL]


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="muse-tiny"):
        MuseConfig.from_name("muse-huge")


def test_missing_keys_named_in_error(tmp_path):
    data = dict(SMALL)
    del data["num_experts"], data["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config.json is missing required keys \['head_dim', 'num_experts'\]"):
        MuseConfig.from_pretrained(tmp_path)


def test_heads_not_dividing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        MuseConfig(**{**SMALL, "num_key_value_heads": 3})


def test_inconsistent_layer_types_and_topk_are_errors():
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        MuseConfig(**{**SMALL, "layer_types": [SLIDING, FULL]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MuseConfig(**{**SMALL, "num_experts_per_tok": 7})


def test_unknown_keys_are_kept_through_a_round_trip(tmp_path):
    c = MuseConfig.from_dict({**SMALL, "vision_config": {"patch_size": 14}, "image_token_id": 5})
    c.save_pretrained(tmp_path)
    again = MuseConfig.from_pretrained(tmp_path)
    assert again.extra == {"vision_config": {"patch_size": 14}, "image_token_id": 5}
    assert again.to_dict() == c.to_dict()
