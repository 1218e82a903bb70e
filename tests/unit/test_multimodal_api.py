"""Chat messages with media -> prompt ids + features -> the prefill (musecore.multimodal, generate, chat).

The plumbing tests use muse-tiny (a text checkpoint) with a fake media processor and counting fake
encoders attached to the model, so they check the message shapes, the placeholder expansion, the
cache and where the features go, independently of the towers' numerics.

The end-to-end tests (bottom) save a tiny random transformers ``MuseSparkForConditionalGeneration``
with both towers and a tokenizer holding the processor's tokens, load it with musecore in fp32, and
compare with transformers on the same messages: the prompt ids against ``MuseSparkProcessor``'s
``apply_chat_template`` (real tokenizer and ``MuseSparkFeatureExtractor``; its image processor needs
torchvision, which does not load here, so a stub image processor hands it musecore.media's pixels,
whose equality with transformers' formulas test_media_image.py checks), then the prefill logits
(tolerance: max |difference| <= 1e-4 x max |logit|, as test_transformers_oracle.py) and greedy tokens.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

import musecore
import musecore.multimodal as mmod
from musecore.multimodal import EncoderCache, parse_messages, prepare


# -- message shapes ------------------------------------------------------------------------------

def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_every_documented_part_shape_parses_in_order():
    pixels = torch.zeros(4, 4, 3, dtype=torch.uint8)
    msgs = user({"type": "image", "path": "a.png"},
                {"type": "text", "text": "and"},
                {"type": "image", "image": pixels},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": "file:///tmp/b.png"},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "audio", "audio": torch.zeros(100), "sampling_rate": 16000},
                {"type": "video", "url": "clip.mp4"},
                {"type": "image", "base64": "aGk="})
    rendered, parts = parse_messages(msgs)
    assert [p["type"] for p in rendered[0]["content"]] == ["image", "text", "image", "image", "image", "audio",
                                                           "audio", "video", "image"]
    assert rendered[0]["content"][1] == {"type": "text", "text": "and"}
    assert [p.kind for p in parts] == ["image", "image", "image", "image", "audio", "audio", "video", "image"]
    assert parts[0].source == "a.png" and parts[1].source is pixels
    assert parts[2].source.startswith("data:image/png") and str(parts[3].source) == "/tmp/b.png"
    assert parts[4].source == {"data": "UklGRg==", "format": "wav"} and parts[5].sampling_rate == 16000
    assert parts[7].source == b"hi"
    assert parts[5].where == "message 0, part 6"


@pytest.mark.parametrize("part, message", [
    ({"type": "picture", "path": "a.png"}, "message 0, part 0: unknown content part type 'picture'; use one of text"),
    ({"type": "image"}, 'message 0, part 0: an "image" part needs exactly one of \'image\', \'url\''),
    ({"type": "image", "path": "a", "url": "b"}, "(got 'url' and 'path')"),
    ({"type": "text"}, 'a "text" part needs a str "text"'),
    ("just a string", 'a content part must be a dict with a str "type"'),
    ({"type": "image_url", "image_url": {}}, 'an "image_url" part needs {"image_url": {"url"'),
    ({"type": "input_audio", "input_audio": "abc"}, 'an "input_audio" part needs {"input_audio": {"data": base64'),
    ({"type": "image", "base64": "not base64!"}, '"base64" is not valid base64 text'),
    ({"type": "image", "path": "a.png", "sampling_rate": 16000}, '"sampling_rate" is for audio arrays'),
])
def test_a_part_shape_it_does_not_know_is_one_clear_line(part, message):
    with pytest.raises(ValueError) as err:
        parse_messages(user(part))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_message_shape_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match='message 0 must be a dict with a str "role"'):
        parse_messages([{"content": "hi"}])
    with pytest.raises(ValueError, match='"content" must be a str or a list of parts'):
        parse_messages([{"role": "user", "content": 3}])


# -- placeholder expansion = transformers' ---------------------------------------------------------

def test_expansion_matches_transformers_get_text_with_replacements():
    from transformers.processing_utils import ProcessorMixin

    strings = {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}
    texts = ["<s>u<|image|>a<|audio|>b<|image|>", "x<|video|><|image|>y<|audio|>", "plain"]
    exp = {"image": ["[I0]", "[I1 <|image|>]", "[I2]"], "video": ["[V0]"], "audio": ["[A0]", "[A1]"]}
    fake = SimpleNamespace(all_special_multimodal_tokens=list(strings.values()), image_token="<|image|>",
                           video_token="<|video|>", audio_token="<|audio|>")
    want, _ = ProcessorMixin.get_text_with_replacements(fake, list(texts), exp["image"], exp["video"], exp["audio"])
    assert mmod._expand(list(texts), strings, exp) == want
    assert want[0] == "<s>u[I0]a[A0]b[I1 <|image|>]"  # an expansion is not scanned again


# -- plumbing on muse-tiny with fake towers --------------------------------------------------------

class FakeProcessor:
    """Images are uint8 tensors [h, w]: grid (1, h, w), one pixel row per patch, h*w/4 tokens.
    Audio is a 1-D tensor: padded to a multiple of 4 samples, ceil(n/4) tokens."""

    token_strings = {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}

    def images(self, images):
        grid = torch.tensor([[1, t.shape[0], t.shape[1]] for t in images])
        pixels = torch.cat([t.reshape(-1, 1).float().expand(-1, 8) for t in images])
        return SimpleNamespace(pixel_values=pixels, grid_thw=grid)

    videos = images

    def audio(self, waves):
        width = -(-max(len(w) for w in waves) // 4) * 4
        values, mask = torch.zeros(len(waves), width), torch.zeros(len(waves), width, dtype=torch.bool)
        for i, w in enumerate(waves):
            values[i, :len(w)], mask[i, :len(w)] = w, True
        return SimpleNamespace(input_values=values, mask=mask)

    def placeholder(self, kind, inputs, index):
        token = self.token_strings[kind]
        n = (-(-int(inputs.mask[index].sum()) // 4) if kind == "audio" else int(inputs.grid_thw[index].prod()) // 4)
        return f"<{kind}>" + token * n + f"</{kind}>"


class FakeTowers:
    """encode_images / encode_audio of a model: row r of an item is (item's mean value + r / 100) in every
    column, so the order of rows in a splice can be read back; counts calls and items."""

    def __init__(self, hidden: int) -> None:
        self.hidden, self.calls, self.items = hidden, [], 0

    def _rows(self, values: torch.Tensor, n: int) -> torch.Tensor:
        base = values.float().mean() + torch.arange(n, dtype=torch.float32)[:, None] / 100
        return (base + torch.zeros(n, self.hidden)).to(torch.bfloat16)

    def encode_images(self, pixels, grid):
        self.calls.append("image")
        self.items += len(grid)
        sizes = grid.prod(-1).tolist()
        return [self._rows(p, s // 4) for p, s in zip(pixels.split(sizes), sizes)]

    def encode_audio(self, values, mask):
        self.calls.append("audio")
        self.items += len(values)
        return [self._rows(v[m], -(-int(m.sum()) // 4)) for v, m in zip(values, mask)]


@pytest.fixture(scope="module")
def tiny():
    return musecore.load("muse-tiny", device="cpu")


@pytest.fixture
def model(tiny, monkeypatch):
    """muse-tiny with fake towers, processor and loader, and a forward that records its media."""
    towers = FakeTowers(tiny.config.hidden_size)
    monkeypatch.setattr(tiny, "vision", object(), raising=False)
    monkeypatch.setattr(tiny, "audio", object(), raising=False)
    monkeypatch.setattr(tiny, "media_processor", FakeProcessor(), raising=False)
    monkeypatch.setattr(tiny, "encode_images", towers.encode_images, raising=False)
    monkeypatch.setattr(tiny, "encode_videos", towers.encode_images, raising=False)
    monkeypatch.setattr(tiny, "encode_audio", towers.encode_audio, raising=False)
    monkeypatch.setattr(tiny, "encoder_cache", EncoderCache(1 << 24), raising=False)
    monkeypatch.setattr(mmod, "_load", lambda processor, part, number: part.source)
    forward, calls = tiny.forward, []
    takes_media = "media" in inspect.signature(forward).parameters

    def recording_forward(ids, positions=None, cache=None, observer=None, media=None, last_only=False):
        calls.append((ids.clone(), media))
        extra = {"media": media} if media and takes_media else {}  # the real splice too, once it exists
        return forward(ids, positions=positions, cache=cache, observer=observer, last_only=last_only, **extra)

    monkeypatch.setattr(tiny, "forward", recording_forward)
    tiny.towers, tiny.calls = towers, calls
    yield tiny
    del tiny.towers, tiny.calls


def image(value: int, h: int = 4, w: int = 4) -> torch.Tensor:
    return torch.full((h, w), value, dtype=torch.uint8)


def test_chat_with_an_image_gives_its_features_to_the_prefill_only(model):
    reply = model.chat(user({"type": "image", "image": image(7)}, {"type": "text", "text": "what?"}),
                       max_new_tokens=3)
    assert isinstance(reply, str)
    (prefill_ids, media), *decode = model.calls
    assert all(m is None for _, m in decode) and len(decode) >= 1
    assert set(media) == {4} and media[4].shape == (4, model.config.hidden_size)  # 16 patches / 4
    assert int((prefill_ids == 4).sum()) == 4
    assert torch.allclose(media[4][:, 0].float(), torch.tensor([7.0, 7.01, 7.02, 7.03]), atol=0.05)


def test_the_prompt_is_the_template_text_with_each_placeholder_expanded(model):
    prepared = prepare(model, [user({"type": "text", "text": "a"}, {"type": "image", "image": image(1, 4, 8)},
                                    {"type": "audio", "audio": torch.ones(10)})])
    text = model.tokenizer.chat_template.render(user({"type": "text", "text": "a"}, {"type": "image"},
                                                     {"type": "audio"}))
    want = text.replace("<|image|>", "<image>" + "<|image|>" * 8 + "</image>").replace(
        "<|audio|>", "<audio>" + "<|audio|>" * 3 + "</audio>")
    assert prepared.texts == [want]
    assert prepared.ids == [model.tokenizer.encode(want, add_special_tokens=False)]


def test_a_second_turn_with_the_same_image_runs_the_encoder_zero_times(model):
    first = user({"type": "image", "image": image(3)}, {"type": "text", "text": "shape?"})
    reply = model.chat(first, max_new_tokens=2)
    assert model.towers.calls == ["image"] and model.encoder_cache.misses == 1
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and colour?"}]
    model.chat(second, max_new_tokens=2)
    assert model.towers.calls == ["image"], "the encoder ran again for a cached image"
    assert model.encoder_cache.hits == 1 and model.encoder_cache.encoder_calls == 1


def test_a_batch_encodes_a_repeated_image_once_and_splices_row_major(model):
    convs = [user({"type": "image", "image": image(5)}, {"type": "text", "text": "one"}),
             user({"type": "image", "image": image(9)}, {"type": "image", "image": image(5)},
                  {"type": "text", "text": "two"})]
    out = model.generate(convs, max_new_tokens=2)
    assert isinstance(out, list) and len(out) == 2
    assert model.towers.calls == ["image"] and model.towers.items == 2  # 5 and 9 once each
    media = model.calls[0][1]
    assert [round(float(v), 1) for v in media[4][::4, 0]] == [5.0, 9.0, 5.0]  # conversation 0, then 1 in order


def test_audio_and_images_in_one_turn_go_to_their_own_placeholder_ids(model):
    model.generate(user({"type": "audio", "audio": torch.full((9,), 2.0)}, {"type": "image", "image": image(1)},
                        {"type": "text", "text": "?"}), max_new_tokens=1)
    media = model.calls[0][1]
    assert set(media) == {4, 6} and media[6].shape[0] == 3 and media[4].shape[0] == 4
    assert sorted(model.towers.calls) == ["audio", "image"]


def test_chat_stream_with_media_streams_the_same_reply(model):
    msgs = user({"type": "image", "image": image(2)}, {"type": "text", "text": "hi"})
    assert "".join(model.chat_stream(msgs, max_new_tokens=2)) == model.chat(msgs, max_new_tokens=2)
    assert model.towers.items == 1


def test_media_for_a_tower_the_checkpoint_lacks_names_the_part_and_the_tower(model, monkeypatch):
    monkeypatch.setattr(model, "audio", None)
    with pytest.raises(ValueError, match=r"message 0, part 1: .*audio.*use a checkpoint with a audio tower|"
                                         r"message 0, part 1: .*audio"):
        model.chat(user({"type": "text", "text": "x"}, {"type": "audio", "audio": torch.ones(4)}))
    assert model.towers.calls == []


def test_text_that_writes_a_placeholder_itself_is_refused(model):
    with pytest.raises(ValueError, match=r"wrote 2 image placeholders \(<\|image\|>\) for 1 image parts"):
        prepare(model, [user({"type": "image", "image": image(1)}, {"type": "text", "text": "<|image|>"})])


def test_media_keyword_with_messages_is_refused(model):
    with pytest.raises(ValueError, match="media= is for str and token-id prompts"):
        model.generate(user({"type": "text", "text": "x"}), media={4: torch.zeros(1, 8)})


def test_chat_prompt_points_to_prepare_for_media(model):
    from musecore.chat import chat_prompt
    with pytest.raises(ValueError, match=r"message 0, part 0 is image input.*multimodal.prepare"):
        chat_prompt(model, user({"type": "image", "image": image(1)}))


def test_text_only_messages_render_exactly_as_before(model):
    from musecore.chat import chat_prompt
    msgs = user({"type": "text", "text": "hello"})
    assert prepare(model, [msgs]).ids[0] == chat_prompt(model, msgs)
    assert prepare(model, [msgs]).features(model) is None


def test_generate_with_messages_returns_the_reply_text_and_stops_at_the_turn_end(model):
    msgs = [{"role": "user", "content": "hi"}]
    assert model.generate(msgs, max_new_tokens=3) == model.chat(msgs, max_new_tokens=3)


# -- end to end against transformers ---------------------------------------------------------------

TOKENS = ["<|image_start|>", "<|image_end|>", "<|soft_audio_start|>", "<|soft_audio_end|>", "<|vid_start|>",
          "<|vid_end|>", "<|vid_frame_separator|>"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(musecore model fp32, transformers model fp32, transformers MuseSparkProcessor) on one tiny checkpoint."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MuseSparkForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no muse_spark (needs 5.24)")
    import shutil
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer
    from transformers import (AutoTokenizer, MuseSparkConfig, MuseSparkFeatureExtractor,
                              MuseSparkForConditionalGeneration, MuseSparkProcessor)
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.image_processing_utils import ImageProcessingMixin
    from transformers.processing_utils import ProcessorMixin

    from .test_transformers_oracle import TOWERS, perturb, text_config

    folder = tmp_path_factory.mktemp("mm-tiny")
    tiny = Path(musecore.__file__).parent / "data" / "muse-tiny"
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    shutil.copy(tiny / "tokenizer_config.json", folder / "tokenizer_config.json")
    ids = dict(image_token_id=4, video_token_id=5, audio_token_id=6)  # muse-tiny's <|image|>, <|video|>, <|audio|>
    text = text_config(vocab_size=tokenizer.get_vocab_size() + 1, bos_token_id=0, eos_token_id=3, pad_token_id=7,
                       **ids)
    config = MuseSparkConfig(text_config=text, out_hidden_size=4 * TOWERS["vision_config"]["hidden_size"],
                             projector_hidden_size=64, vision_config=TOWERS["vision_config"],
                             audio_config={**TOWERS["audio_config"], "out_hidden_size": text["hidden_size"]}, **ids)
    torch.manual_seed(0)
    hf = MuseSparkForConditionalGeneration(config).eval()
    perturb(hf)
    hf.save_pretrained(folder)
    model = musecore.load(folder, device="cpu", dtype=torch.float32)
    ours = mmod.media_processor(model)

    class StubImageProcessor(ImageProcessingMixin):
        """transformers' image processor needs torchvision: this one returns musecore.media's pixels."""
        merge_size = 2

        def fetch_images(self, images):
            return images

        def __call__(self, images, **kwargs):
            flat = [im for row in images for im in (row if isinstance(row, list) else [row])]
            out = ours.images(flat)
            return BatchFeature({"pixel_values": out.pixel_values, "image_grid_thw": out.grid_thw})

    with pytest.MonkeyPatch.context() as patch:  # its class check looks up torchvision's video processors
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        processor = MuseSparkProcessor(image_processor=StubImageProcessor(), tokenizer=AutoTokenizer.from_pretrained(
            folder), feature_extractor=MuseSparkFeatureExtractor(), chat_template=model.tokenizer.chat_template.source)
    return model, hf, processor


def media_inputs(seed: int = 0, size=(60, 90), samples: int = 5000):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    wave = (0.1 * rng.standard_normal(samples)).astype(np.float32)
    return picture, wave


def hf_inputs(processor, conversations):
    """transformers' processor on the same conversations (audio as numpy arrays, as it takes them)."""
    return processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt", padding=True)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_prompt_ids_equal_transformers_processor(pair):
    model, _, processor = pair
    picture, wave = media_inputs()
    other, long_wave = media_inputs(1, (30, 44), 9000)
    conversation = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "audio", "audio": wave}, {"type": "text", "text": "and"},
                                                 {"type": "image", "image": picture},
                                                 {"type": "image", "image": other},
                                                 {"type": "audio", "audio": long_wave}]}]
    prepared = prepare(model, [conversation])
    theirs = hf_inputs(processor, conversation)["input_ids"][0].tolist()
    assert prepared.ids[0] == theirs
    assert prepared.ids[0].count(4) == 6 + 2 and prepared.ids[0].count(6) == 3 + 5


def test_prefill_logits_with_an_image_and_audio_equal_transformers(pair):
    model, hf, processor = pair
    picture, wave = media_inputs()
    conversation = user({"type": "image", "image": picture}, {"type": "text", "text": "what?"},
                        {"type": "audio", "audio": wave})
    prepared = prepare(model, [conversation])
    ours = model.forward(torch.tensor(prepared.ids), media=prepared.features(model))
    with torch.no_grad():
        theirs = hf(**hf_inputs(processor, conversation)).logits
    err = relative_error(ours, theirs)
    assert err <= 1e-4, f"prefill logits differ from transformers by {err:.2e} of max |logit| (tolerance 1e-4)"


def test_greedy_generate_with_media_equals_transformers_and_chat_says_the_same(pair):
    model, hf, processor = pair
    picture, wave = media_inputs(2)
    conversation = user({"type": "audio", "audio": wave}, {"type": "image", "image": picture},
                        {"type": "text", "text": "hi"})
    inputs = hf_inputs(processor, conversation)
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=7)[0, length:].tolist()
    prepared = prepare(model, [conversation])
    ours = model.generate(prepared.ids[0], media=prepared.features(model), max_new_tokens=8, stop=[])
    assert ours == theirs[:len(ours)] and (len(ours) == 8 or theirs[len(ours)] in (1, 2, 3)), (ours, theirs)
    reply = model.chat(conversation, max_new_tokens=8)
    end = next((i for i, t in enumerate(theirs) if t in (1, 2, 3)), len(theirs))  # <|message|>/<|eom|>/<|eot|>
    assert reply == model.tokenizer.decode(theirs[:end])


def test_a_batch_with_media_gives_each_row_what_it_gives_alone(pair):
    model, _, _ = pair
    picture, wave = media_inputs(3)
    other, _ = media_inputs(4, (28, 56))
    convs = [user({"type": "image", "image": picture}, {"type": "text", "text": "one"}),
             user({"type": "text", "text": "two"}),
             user({"type": "audio", "audio": wave}, {"type": "image", "image": other},
                  {"type": "image", "image": picture}, {"type": "text", "text": "three"})]
    batch = model.generate(convs, max_new_tokens=6)
    alone = [model.generate(c, max_new_tokens=6) for c in convs]
    assert batch == alone


def test_features_do_not_depend_on_what_else_is_in_the_batch(pair):
    """Why one cache entry per item is right: a clip's (or image's) features are the same encoded
    alone or padded/packed with others (fp32; tolerance 1e-5 of max |feature|)."""
    model, _, _ = pair
    picture, short = media_inputs(5, (28, 42), 2500)
    other, long = media_inputs(6, (56, 70), 11000)
    proc = mmod.media_processor(model)
    both = proc.audio([torch.from_numpy(short), torch.from_numpy(long)])
    alone = proc.audio([torch.from_numpy(short)])
    batched = model.encode_audio(both.input_values, both.mask)[0]
    single = model.encode_audio(alone.input_values, alone.mask)[0]
    err = relative_error(batched, single)
    assert batched.shape == single.shape and err <= 1e-5, f"audio features differ by {err:.2e} when batched"
    images = proc.images([picture, other])
    one = proc.images([picture])
    err = relative_error(model.encode_images(images.pixel_values, images.grid_thw)[0],
                         model.encode_images(one.pixel_values, one.grid_thw)[0])
    assert err <= 1e-5, f"image features differ by {err:.2e} when packed with another image"


def test_a_second_turn_with_the_same_image_runs_no_tower_on_the_real_model(pair, monkeypatch):
    model, _, _ = pair
    picture, wave = media_inputs(7)
    monkeypatch.setattr(model, "encoder_cache", EncoderCache(1 << 20), raising=False)  # set on first use otherwise
    first = user({"type": "image", "image": picture}, {"type": "audio", "audio": wave}, {"type": "text", "text": "?"})
    reply = model.chat(first, max_new_tokens=2)
    assert model.encoder_cache.encoder_calls == 2  # the vision tower once, the audio tower once
    model.chat(first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}],
               max_new_tokens=2)
    assert model.encoder_cache.encoder_calls == 2 and model.encoder_cache.hits == 2


def test_the_server_takes_openai_image_url_and_input_audio_parts_inline(pair):
    """/v1/chat/completions with a data: URL image and base64 wav audio answers what model.chat answers;
    a file path is refused (the server reads media only from the request)."""
    import base64
    import io

    import soundfile
    openai = pytest.importorskip("openai", reason="the serve tests use the official openai client")
    from musecore.serve.app import make_app

    from .test_serve import TIMEOUT, Server

    model, _, _ = pair
    picture, wave = media_inputs(8)
    png, wav = io.BytesIO(), io.BytesIO()
    picture.save(png, format="PNG")
    soundfile.write(wav, wave, 24000, format="WAV", subtype="FLOAT")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(png.getvalue()).decode()}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                       "format": "wav"}},
               {"type": "text", "text": "what?"}]
    messages = [{"role": "user", "content": content}]
    expected = model.chat(messages, max_new_tokens=6)
    with Server(make_app(model, "mm-tiny", max_batch=2, max_waiting=2)) as server, openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0) as client:
        reply = client.chat.completions.create(model="mm-tiny", messages=messages, max_tokens=6, temperature=0)
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == len(prepare(model, [messages]).ids[0])
        with pytest.raises(openai.BadRequestError, match="inline only"):
            client.chat.completions.create(model="mm-tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}])


def test_a_video_prompt_equals_transformers_on_the_same_frames(pair, tmp_path):
    """A video part: frames sampled and patched by musecore.media (test_media_video.py checks those against
    transformers), timestamps in the prompt, features at the video placeholders; logits within 1e-4."""
    from .test_media_video import write_video

    model, hf, _ = pair
    path = tmp_path / "clip.mp4"
    write_video(path, frames=6, fps=4, height=56, width=84, codec="mpeg4")
    conversation = user({"type": "video", "path": str(path)}, {"type": "text", "text": "what moves?"})
    prepared = prepare(model, [conversation])
    assert "Time: 0.0s" in prepared.texts[0] and prepared.ids[0].count(5) > 0
    processor = mmod.media_processor(model)
    video = processor.videos([processor.load_video(str(path))])
    ours = model.forward(torch.tensor(prepared.ids), media=prepared.features(model))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(prepared.ids), pixel_values_videos=video.pixel_values,
                    video_grid_thw=video.grid_thw).logits
    err = relative_error(ours, theirs)
    assert err <= 1e-4, f"video prompt logits differ from transformers by {err:.2e} of max |logit| (tolerance 1e-4)"


def test_nan_features_are_named_when_debugging(model, monkeypatch):
    from musecore.generate import NonFiniteLogitsError
    monkeypatch.setenv("MUSECORE_DEBUG", "1")
    monkeypatch.setattr(model, "encode_images", lambda pixels, grid: [torch.full((4, model.config.hidden_size),
                                                                               float("nan"))])
    with pytest.raises(NonFiniteLogitsError, match="the embedding or the media features spliced into it"):
        model.chat(user({"type": "image", "image": image(1)}, {"type": "text", "text": "?"}), max_new_tokens=1)


def test_the_server_engine_splices_each_joining_requests_media_in_row_order(model):
    """Two media requests that join in one prefill: their features go into that forward, request by
    request (row order), one tower call per kind for all of them; a text-only request between them adds none."""
    import threading

    from musecore.chat import end_ids
    from musecore.serve.engine import Engine, Request, Sampling

    convs = [user({"type": "image", "image": image(11)}, {"type": "text", "text": "a"}),
             user({"type": "text", "text": "b"}),
             user({"type": "audio", "audio": torch.full((6,), 3.0)}, {"type": "image", "image": image(22)},
                  {"type": "text", "text": "c"})]
    prepared = [prepare(model, [c]) for c in convs]
    done = threading.Semaphore(0)
    engine = Engine(model, max_batch=3, max_waiting=3)
    for p in prepared:  # all queued before the scheduler starts: they join in one prefill
        sampling = Sampling(max_tokens=2, stop_ids=set(end_ids(model)))
        engine.submit(Request(p.ids[0], sampling, lambda e: e["type"] == "done" and done.release(), model.tokenizer,
                              media=p if p.has_media else None))
    engine.start()
    try:
        assert all(done.acquire(timeout=60) for _ in convs), "the engine did not finish"
    finally:
        engine.stop()
    ids, media = model.calls[0]
    assert ids.shape[0] == 3 and set(media) == {4, 6}
    assert [round(float(v)) for v in media[4][::4, 0]] == [11, 22] and media[6].shape[0] == 2
    assert sorted(model.towers.calls) == ["audio", "image"] and model.towers.items == 3  # one call per kind


def test_a_request_whose_media_fails_ends_with_its_error_and_the_others_run(model, monkeypatch):
    import threading

    from musecore.serve.engine import Engine, Request, Sampling

    encode = model.encode_images

    def wrong_for_99(pixels, grid):  # an image of 99s gets one feature row too few
        return [o[:-1] if round(float(o[0, 0])) == 99 else o for o in encode(pixels, grid)]

    monkeypatch.setattr(model, "encode_images", wrong_for_99)
    events, done = {}, threading.Semaphore(0)

    def sink(i):
        return lambda e: e["type"] == "done" and (events.__setitem__(i, e), done.release())

    engine = Engine(model, max_batch=2, max_waiting=2)
    for i, value in enumerate((99, 7)):
        p = prepare(model, [user({"type": "image", "image": image(value)}, {"type": "text", "text": "?"})])
        engine.submit(Request(p.ids[0], Sampling(max_tokens=1), sink(i), model.tokenizer, media=p))
    engine.start()
    try:
        assert all(done.acquire(timeout=60) for _ in range(2)), "the engine did not finish"
    finally:
        engine.stop()
    assert events[0]["finish_reason"] == "error"
    assert "gave 3 feature rows but its placeholder has 4" in events[0]["error"]
    assert events[1]["finish_reason"] == "length"
    assert round(float(model.calls[0][1][4][0, 0])) == 7 and model.calls[0][0].shape[0] == 1
