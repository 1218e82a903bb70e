"""The vision and audio towers compute what transformers 5.24's ``muse_spark`` computes.

A random tiny ``MuseSparkForConditionalGeneration`` (towers included, every norm, bias and the
position table perturbed away from their 0/1 initialisation) is saved by transformers and loaded
by ``musecore.load``. Compared: the vision tower (several images of odd grids and a video packed
in one call), ``get_image_features``, the audio features (clips of odd length batched with a mask),
streaming audio, and the whole model's logits with an image and an audio clip in the prompt.

Tolerances. fp32 against fp32: both compute the same math in fp32 and differ in summation order
only, so max |difference| <= 1e-4 x max |value|. bf16: both round to bf16 at different points
(transformers after every module, musecore after every op), so each is compared with the fp32
truth and musecore's error must be at most 2x transformers' own (plus 1e-5 NMSE for the encoders;
for the logits the median over positions of the RMS over the vocabulary, and the direct difference
at most 2.5x: two independent roundings of one computation); the measured errors are printed on failure.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers 5.24 is the test oracle (pip install -e '.[test]')")
if not hasattr(transformers, "MuseSparkForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} has no muse_spark (needs 5.24)", allow_module_level=True)

import musecore  # noqa: E402
from tests.helpers import small_config  # noqa: E402

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, pos_emb_height=4,
              pos_emb_width=4)  # windows of 4x4 patches, so small images already have several
AUDIO = dict(hidden_sizes=[16, 16, 24, 32], depths=[1, 2, 1, 1])
# (t, h, w) patch grids: odd sizes (not multiples of the window), one taller than the table, a video
GRIDS = [(1, 6, 10), (1, 2, 2), (2, 8, 6), (1, 4, 14)]
STEP = 1920  # samples per audio token


def nmse(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).pow(2).mean() / theirs.float().pow(2).mean()).item()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def hf_config():
    from transformers import MuseSparkConfig
    text = {k: v for k, v in small_config().text_dict().items() if k != "model_type"}
    cfg = small_config()
    return MuseSparkConfig(text_config=text, vision_config=VISION, audio_config={**AUDIO, "out_hidden_size": 64},
                           out_hidden_size=4 * VISION["hidden_size"], projector_hidden_size=48,
                           image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                           audio_token_id=cfg.audio_token_id)


def perturb(model) -> None:
    """Values away from transformers' initialisation: every 1-D tensor (norm weights, biases, gates), the
    position table at unit scale (so its resampling matters), the text model's centred norms."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("position_embedding_table.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            elif tensor.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") and "language_model" not in name or "ln_" in name \
                    or "norm1.weight" in name or "norm2.weight" in name else 0.0
                tensor.copy_(base + 0.3 * torch.randn(tensor.shape, generator=gen))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, fp32 transformers model) for one tiny config with both towers."""
    from transformers import MuseSparkForConditionalGeneration
    torch.manual_seed(0)
    model = MuseSparkForConditionalGeneration(hf_config()).eval()
    perturb(model)
    folder = tmp_path_factory.mktemp("towers")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def muse(saved):
    return musecore.load(saved[0], device="cpu", dtype=torch.float32)


def pixels(grids, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)
    count = int(grid.prod(-1).sum())
    return torch.randn(count, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed)), grid


def clips(lengths, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded clips to a multiple of 1920 samples and their mask (as the feature extractor pads)."""
    width = -(-max(lengths) // STEP) * STEP
    gen = torch.Generator().manual_seed(seed)
    values, mask = torch.zeros(len(lengths), width), torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        values[i, :n], mask[i, :n] = 0.3 * torch.randn(n, generator=gen), True
    return values, mask


def test_the_towers_load_from_a_transformers_checkpoint(muse, saved):
    assert muse.vision is not None and muse.audio is not None
    assert muse.plan.towers == ("vision", "audio") and not muse.plan.towers_skipped
    groups = {g.group: g for g in muse.plan.groups}
    tower_params = lambda prefix: sum(p.numel() for n, p in saved[1].named_parameters() if n.startswith(prefix))  # noqa: E731
    assert groups["vision tower"].parameters == tower_params(("model.vision_tower.", "model.vision_adapter.",
                                                              "model.vision_projection."))
    assert groups["audio tower"].parameters == tower_params("model.audio_tower.")


def test_vision_tower_on_packed_images_and_a_video_equals_transformers(muse, saved):
    values, grid = pixels(GRIDS)
    with torch.no_grad():
        theirs = saved[1].model.vision_tower(pixel_values=values, grid_thw=grid).last_hidden_state
    ours = muse.vision(values, grid)
    assert ours.shape == theirs.shape == (values.shape[0] // 4, 4 * VISION["hidden_size"])
    err = relative_error(ours, theirs)
    assert err <= 1e-4, f"vision tower differs by {err:.2e} of max |value| (tolerance 1e-4; NMSE {nmse(ours, theirs):.2e})"


def test_image_features_equal_get_image_features(muse, saved):
    values, grid = pixels(GRIDS, seed=2)
    with torch.no_grad():
        theirs = saved[1].model.get_image_features(values, grid).pooler_output
    ours = muse.encode_images(values, grid)
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err = relative_error(a, b)
        assert err <= 1e-4, f"image {i} grid {GRIDS[i]}: features differ by {err:.2e} (tolerance 1e-4)"
    assert all(torch.equal(a, b) for a, b in zip(muse.encode_videos(values, grid), ours))  # video = the image path


def test_packed_images_give_each_image_its_own_features(muse):
    values, grid = pixels(GRIDS, seed=3)
    packed = muse.encode_images(values, grid)
    start = 0
    for i, g in enumerate(GRIDS):
        n = g[0] * g[1] * g[2]
        alone = muse.encode_images(values[start:start + n], grid[i:i + 1])[0]
        err = relative_error(packed[i], alone)
        assert err <= 1e-5, f"image {i} packed vs alone: {err:.2e} (tolerance 1e-5)"
        start += n


def test_audio_features_of_odd_clips_batched_with_a_mask_equal_transformers(muse, saved):
    lengths = [5 * STEP + 77, 2 * STEP - 5, 3 * STEP]
    values, mask = clips(lengths)
    with torch.no_grad():
        theirs = saved[1].model.get_audio_features(values, mask).pooler_output
    ours = muse.encode_audio(values, mask)
    assert [o.shape[0] for o in ours] == [-(-n // STEP) for n in lengths]
    ours = torch.cat(ours)
    assert ours.shape == theirs.shape
    err = relative_error(ours, theirs)
    assert err <= 1e-4, f"audio features differ by {err:.2e} (tolerance 1e-4; NMSE {nmse(ours, theirs):.2e})"


def test_audio_without_a_mask_and_of_unpadded_length(muse, saved):
    values, _ = clips([3 * STEP + 100])
    with torch.no_grad():
        theirs = saved[1].model.get_audio_features(values).pooler_output
    ours = muse.encode_audio(values[:, :3 * STEP + 100])  # padded to 4 x 1920 inside, as the extractor pads
    assert relative_error(ours[0], theirs) <= 1e-4


def test_audio_streamed_in_chunks_equals_one_pass_and_transformers_streaming(muse, saved):
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkAudioConv1dPaddingCache
    values, _ = clips([9 * STEP, 9 * STEP], seed=4)
    whole, _ = muse.audio(values)
    pieces, theirs, state, cache, start = [], [], None, MuseSparkAudioConv1dPaddingCache(), 0
    for n in (2, 1, 4, 2):  # tokens per chunk
        chunk = values[:, start:start + n * STEP]
        out, state = muse.audio(chunk, state)
        pieces.append(out)
        with torch.no_grad():
            theirs.append(saved[1].model.audio_tower(input_values=chunk, padding_cache=cache).last_hidden_state)
        start += n * STEP
    err = relative_error(torch.cat(pieces, 1), whole)
    assert err <= 1e-6, f"streamed audio differs from one pass by {err:.2e} (tolerance 1e-6)"
    err = relative_error(torch.cat(pieces, 1), torch.cat(theirs, 1))
    assert err <= 1e-4, f"streamed audio differs from transformers' padding-cache streaming by {err:.2e} (tolerance 1e-4)"
    with pytest.raises(ValueError, match="multiple of 1920"):
        muse.audio(values[:, :1000])


def prompt_with_media(muse, grid: tuple[int, int, int], audio_tokens: int) -> torch.Tensor:
    cfg = muse.config
    image = [cfg.image_token_id] * (grid[0] * grid[1] * grid[2] // 4)
    audio = [cfg.audio_token_id] * audio_tokens
    row = [5, 9, 11] + image + [12, 13] + audio + [20, 21, 22]
    return torch.tensor([row])


def test_logits_with_an_image_and_an_audio_clip_equal_transformers(muse, saved):
    values, grid = pixels([(1, 6, 4)], seed=5)
    audio, mask = clips([3 * STEP - 50], seed=6)
    ids = prompt_with_media(muse, (1, 6, 4), 3)
    with torch.no_grad():
        theirs = saved[1](input_ids=ids, pixel_values=values, image_grid_thw=grid, input_values=audio,
                          input_values_mask=mask).logits
    media = {muse.config.image_token_id: torch.cat(muse.encode_images(values, grid)),
             muse.config.audio_token_id: torch.cat(muse.encode_audio(audio, mask))}
    ours = muse.forward(ids, media=media)
    err = relative_error(ours, theirs)
    assert err <= 1e-4, f"logits with media differ by {err:.2e} of max |logit| (tolerance 1e-4)"
    without = muse.forward(ids)  # placeholders embedded as token 0: the media must change the logits
    assert relative_error(without, theirs) > 1e-3


def test_bf16_towers_are_as_close_to_fp32_as_transformers_own_bf16(saved):
    from transformers import MuseSparkForConditionalGeneration
    folder, model = saved
    values, grid = pixels(GRIDS, seed=7)
    audio, mask = clips([4 * STEP + 3, 2 * STEP], seed=8)
    bf16 = MuseSparkForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = musecore.load(folder, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        truth = (torch.cat(model.model.get_image_features(values, grid).pooler_output),
                 model.model.get_audio_features(audio, mask).pooler_output)
        theirs = (torch.cat(bf16.model.get_image_features(values.bfloat16(), grid).pooler_output),
                  bf16.model.get_audio_features(audio.bfloat16(), mask).pooler_output)
    mine = (torch.cat(ours.encode_images(values, grid)), torch.cat(ours.encode_audio(audio, mask)))
    for what, t, h, m in zip(("image", "audio"), truth, theirs, mine):
        assert m.dtype == torch.bfloat16
        their_err, our_err = nmse(h, t), nmse(m, t)
        assert our_err <= 2 * their_err + 1e-5, (f"{what}: musecore bf16 NMSE {our_err:.2e} vs transformers' bf16 "
                                                  f"{their_err:.2e} (tolerance 2x + 1e-5)")
    # the whole model with an image and a clip in the prompt: median over positions of the RMS over the
    # vocabulary (as test_transformers_oracle: a routing flip at one position must not decide the test)
    values, grid = pixels([(1, 6, 4)], seed=5)
    audio, mask = clips([3 * STEP - 50], seed=6)
    ids = prompt_with_media(ours, (1, 6, 4), 3)
    with torch.no_grad():
        truth = model(input_ids=ids, pixel_values=values, image_grid_thw=grid, input_values=audio,
                      input_values_mask=mask).logits
        theirs = bf16(input_ids=ids, pixel_values=values.bfloat16(), image_grid_thw=grid,
                      input_values=audio.bfloat16(), input_values_mask=mask).logits.float()
    media = {ours.config.image_token_id: torch.cat(ours.encode_images(values, grid)),
             ours.config.audio_token_id: torch.cat(ours.encode_audio(audio, mask))}
    mine = ours.forward(ids, media=media)
    error = lambda a, b: (a - b).pow(2).mean(-1).sqrt().median().item()  # noqa: E731
    their_err, our_err, direct = error(theirs, truth), error(mine, truth), error(mine, theirs)
    assert our_err <= 2 * their_err, f"logits with media: musecore bf16 {our_err:.3e} vs transformers' {their_err:.3e}"
    assert direct <= 2.5 * their_err, f"musecore vs transformers bf16 logits: {direct:.3e} (theirs {their_err:.3e})"
