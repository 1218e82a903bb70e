"""MediaProcessor: settings and token strings from checkpoint files, placeholders as transformers writes them.

References: transformers' ``MuseSparkProcessor.replace_image_token`` / ``replace_audio_token`` and
``ProcessorMixin.get_text_with_replacements`` run on a stub object (the real processor cannot be
built without torchvision), its token defaults read from ``MuseSparkProcessor.__init__``'s source,
the muse-tiny tokenizer loaded with ``AutoTokenizer``, and the real ``MuseSparkFeatureExtractor``.
"""

import ast
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="the media extra (pillow) is not installed")

from musecore.media import TOKEN_DEFAULTS, MediaError, MediaProcessor  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "musecore" / "data" / "muse-tiny"
SPARK = Path(importlib.util.find_spec("transformers").submodule_search_locations[0]) / "models" / "muse_spark"


def transformers_token_defaults() -> dict:
    """The ``getattr(tokenizer, name, default)`` defaults in MuseSparkProcessor.__init__."""
    tree = ast.parse((SPARK / "processing_muse_spark.py").read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3 \
                and getattr(node.args[0], "id", None) == "tokenizer":
            out[node.args[1].value] = node.args[2].value
    return out


def stub(processor: MediaProcessor, **extra) -> SimpleNamespace:
    return SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), **processor.tokens, **extra)


def test_token_defaults_are_transformers_defaults():
    assert TOKEN_DEFAULTS == transformers_token_defaults()
    assert MediaProcessor().token_strings == {"image": "<|patch|>", "video": "<|video|>", "audio": "<|audio|>"}


def test_token_strings_come_from_the_checkpoint_tokenizer_config():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    processor = MediaProcessor.from_pretrained(TINY)
    defaults = transformers_token_defaults()
    assert processor.tokens == {key: getattr(tokenizer, key, default) for key, default in defaults.items()}
    assert processor.token_strings == {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}


@pytest.mark.parametrize("grid", [[1, 2, 6], [1, 24, 36], [1, 2, 2], [1, 66, 2]])
def test_image_placeholder_equals_transformers_replace_image_token(grid):
    from transformers.models.muse_spark.processing_muse_spark import MuseSparkProcessor
    processor = MediaProcessor.from_pretrained(TINY)
    inputs = SimpleNamespace(grid_thw=torch.tensor([grid]))
    want = MuseSparkProcessor.replace_image_token(stub(processor), {"image_grid_thw": torch.tensor([grid])}, 0)
    assert processor.placeholder("image", inputs, 0) == want
    assert want == "<|image_start|>" + "<|image|>" * (grid[1] * grid[2] // 4) + "<|image_end|>"


def test_audio_placeholder_equals_transformers_replace_audio_token():
    from transformers.models.muse_spark.feature_extraction_muse_spark import MuseSparkFeatureExtractor
    from transformers.models.muse_spark.processing_muse_spark import MuseSparkProcessor
    extractor = MuseSparkFeatureExtractor()
    clips = [torch.randn(n) for n in (5000, 100, 1920, 1921, 24000)]
    theirs = extractor([c.numpy() for c in clips], sampling_rate=24000, return_tensors="pt")
    processor = MediaProcessor.from_pretrained(TINY)
    ours = processor.audio(clips)
    for i in range(len(clips)):
        want = MuseSparkProcessor.replace_audio_token(stub(processor, feature_extractor=extractor), theirs, i)
        assert processor.placeholder("audio", ours, i) == want
    assert processor.placeholder("audio", ours, 1) == "<|soft_audio_start|><|audio|><|soft_audio_end|>"


def test_expand_replaces_placeholders_in_order_like_transformers():
    from transformers.processing_utils import ProcessorMixin
    processor = MediaProcessor.from_pretrained(TINY)
    images = processor.images([np.zeros((37, 91, 3), np.uint8), np.zeros((60, 60, 3), np.uint8)])
    audio = processor.audio([torch.zeros(5000)])
    text = "<|start|>user<|message|>a <|image|> b <|audio|> c <|image|><|eot|>"
    want, _ = ProcessorMixin.get_text_with_replacements(
        SimpleNamespace(all_special_multimodal_tokens=["<|image|>", "<|audio|>"], **processor.tokens), [text],
        [processor.placeholder("image", images, i) for i in range(2)], [], [processor.placeholder("audio", audio, 0)])
    assert processor.expand(text, images=images, audio=audio) == want[0]
    with pytest.raises(MediaError, match=r"the prompt has 2 image placeholders \(<\|image\|>\) but 1 image inputs"):
        processor.expand(text, images=processor.images([np.zeros((28, 28, 3), np.uint8)]), audio=audio)


def test_settings_come_from_processor_files(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "MuseGlimmerImageProcessor", "max_image_tokens": 6, "image_mean": [0.4, 0.5, 0.6]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"fps": 1.0, "frame_timestamp_format": "<{timestamp:.2f}>"}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": {"padding_value": 0.5}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"image_token": {"content": "<|img|>", "special": True}, "extra_special_tokens": {"audio_token": "<|aud|>"}}))
    processor = MediaProcessor.from_pretrained(tmp_path)
    assert processor.image_settings.max_image_tokens == 6 and processor.image_settings.image_mean == (0.4, 0.5, 0.6)
    assert processor.video_settings.fps == 1.0 and processor.audio_settings.padding_value == 0.5
    assert processor.token_strings == {"image": "<|img|>", "video": "<|video|>", "audio": "<|aud|>"}
    assert processor.images([np.zeros((300, 300, 3), np.uint8)]).grid_thw.tolist() == [[1, 4, 4]]
    assert processor.audio([torch.zeros(10)]).input_values[0, 10:].eq(0.5).all()


def test_the_model_config_fills_and_checks_patch_sizes(tmp_path):
    config = {"vision_config": {"patch_size": 14, "merge_size": 2, "patch_temporal": 2},
              "audio_config": {"patch_sizes": [16, 6, 5, 4]}}
    assert MediaProcessor.from_pretrained(tmp_path, config).audio_settings.samples_per_token == 1920
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(MediaError, match="image processor's patch_size=16 differs from the vision tower's 14"):
        MediaProcessor.from_pretrained(tmp_path, config)
    from musecore.config import MuseConfig
    assert MediaProcessor.from_pretrained(TINY, MuseConfig.from_pretrained(TINY)).image_settings.patch_size == 14


def test_broken_processor_files_name_the_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(MediaError, match="preprocessor_config.json is not valid JSON"):
        MediaProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"resample": 5}))
    with pytest.raises(MediaError, match="resample=5 is not supported"):
        MediaProcessor.from_pretrained(tmp_path)


def test_the_processor_loads_sources_itself(tmp_path):
    from PIL import Image
    Image.fromarray(np.full((40, 50, 3), 200, np.uint8)).save(tmp_path / "a.png")
    processor = MediaProcessor()
    assert processor.images([tmp_path / "a.png"]).grid_thw.tolist() == [[1, 2, 2]]
    assert processor.audio([np.zeros(16000, np.float32)]).mask.sum().item() == 16000
    with pytest.raises(MediaError, match="unknown media kind 'gif'"):
        processor.placeholder("gif", None, 0)
