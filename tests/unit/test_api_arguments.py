"""musecore.load / musecore.plan refuse arguments of the wrong type or value with one line naming the argument,
and a mesh option that cannot apply (sp without tp) is refused rather than ignored."""

from __future__ import annotations

import pytest

import musecore
from musecore.distributed import MeshError


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_plan_refuses_an_unknown_checkpoint_format_listing_the_valid_ones():
    with pytest.raises(ValueError) as error:
        musecore.plan("muse-small", "h200", checkpoint_format="bogus")
    message = one_line(error)
    assert "checkpoint_format" in message and "'bogus'" in message and "'nvfp4'" in message and "'bf16'" in message


@pytest.mark.parametrize("entry", [musecore.load, musecore.plan])
def test_sequence_parallel_without_tensor_parallel_is_refused_not_ignored(entry):
    with pytest.raises(MeshError) as error:
        entry("muse-tiny", device="cpu", sp=True)
    assert "sp=True needs tp > 1" in one_line(error)


@pytest.mark.parametrize("argument, value, named", [
    ({"device": None}, None, "device must be a str"),
    ({"quantize_dense": 5}, 5, "quantize_dense must be"),
    ({"towers": 5}, 5, "towers must be"),
    ({"emulate": "no"}, "no", "emulate must be True or False"),
    ({"allow_reference": 1}, 1, "allow_reference must be True or False"),
    ({"sp": "yes"}, "yes", "sp must be True or False"),
    ({"kv_format": 8}, 8, "kv_format must be a str"),
])
@pytest.mark.parametrize("entry", [musecore.load, musecore.plan])
def test_an_argument_of_the_wrong_type_is_one_line_naming_it(entry, argument, value, named):
    with pytest.raises(ValueError) as error:
        entry("muse-tiny", **{"device": "cpu", **argument})
    message = one_line(error)
    assert named in message and repr(value) in message, message


def test_load_names_the_model_argument_when_it_is_not_a_path_or_name():
    with pytest.raises(ValueError) as error:
        musecore.load(123, device="cpu")
    assert one_line(error).startswith("model must be"), str(error.value)


def test_load_refuses_a_progress_that_is_not_a_bool_or_none():
    with pytest.raises(ValueError) as error:
        musecore.load("muse-tiny", device="cpu", progress="on")
    assert "progress must be True, False or None" in one_line(error)
