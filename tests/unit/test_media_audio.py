"""Audio through musecore.media: decoding, the 24 kHz resampler, and padding as transformers pads.

References:
- transformers' ``MuseSparkFeatureExtractor`` (imported and run) for padding and the mask;
- ``torchaudio.functional.resample``'s algorithm (Hann-windowed sinc, conv1d polyphase), written out
  below as a formula because torchaudio does not load here; tolerance 1e-6 absolute;
- physics: a sine keeps its frequency and amplitude; scipy's ``resample_poly`` (a different,
  Kaiser-windowed filter) agrees in the passband within 2e-3.
"""

import base64
import math

import numpy as np
import pytest
import torch

sf = pytest.importorskip("soundfile", reason="the media extra (soundfile) is not installed")

from musecore.media import load_audio, process_audio, resample  # noqa: E402


def torchaudio_resample(wave: torch.Tensor, orig: int, new: int, width_zeros: int = 6, rolloff: float = 0.99):
    """torchaudio.functional.resample (sinc_interp_hann) as written in torchaudio: one kernel per output phase."""
    gcd = math.gcd(orig, new)
    orig, new = orig // gcd, new // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(width_zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-width_zeros, width_zeros)
    window = torch.cos(t * math.pi / width_zeros / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t) * window * (base / orig)
    padded = torch.nn.functional.pad(wave.double()[None, None], (width, width + orig))
    out = torch.nn.functional.conv1d(padded, kernels, stride=orig).transpose(1, 2).reshape(-1)
    return out[:math.ceil(new * wave.numel() / orig)].float()


@pytest.mark.parametrize("orig,length", [(16000, 12345), (44100, 44101), (48000, 999), (22050, 3001), (8000, 7),
                                         (32000, 1)])
def test_resampler_equals_the_torchaudio_filter(orig, length):
    wave = torch.randn(length, generator=torch.Generator().manual_seed(length))
    got = resample(wave, orig, 24000)
    want = torchaudio_resample(wave, orig, 24000)
    assert got.shape == want.shape == (math.ceil(length * 24000 / orig),)
    err = (got - want).abs().max().item()
    assert err <= 1e-6, f"max |musecore - torchaudio formula| = {err}"


@pytest.mark.parametrize("orig,new", [(16000, 24000), (44100, 24000), (22050, 24000), (24000, 16000)])
def test_the_one_convolution_and_per_sample_forms_agree(orig, new):
    """Common rates run as one strided conv1d; rates with a huge reduced ratio (44101 -> 24000) gather taps per
    output sample with the same weight table. Both forms, forced here, agree to float64 rounding (1e-12)."""
    from musecore.media import audio
    g = math.gcd(orig, new)
    wave = torch.randn(5003, dtype=torch.float64, generator=torch.Generator().manual_seed(orig))
    weights, first, width = audio._phase_table(orig // g, new // g, 6, 0.99)
    length = math.ceil(wave.numel() * new / orig)
    dense = audio._apply_dense(wave, weights, first, width, orig // g, new // g, length)
    gathered = audio._apply_gather(wave, weights, first, width, orig // g, new // g, length)
    err = (dense - gathered).abs().max().item()
    assert dense.shape == gathered.shape == (length,) and err <= 1e-12, f"max difference {err}"


@pytest.mark.parametrize("orig", [16000, 44100, 48000, 44101])
def test_a_sine_keeps_its_frequency_and_amplitude(orig):
    seconds, freq = 1.0, 441.0
    t = torch.arange(int(orig * seconds), dtype=torch.float64) / orig
    out = resample(torch.sin(2 * math.pi * freq * t), orig, 24000).double()
    spectrum = torch.fft.rfft(out * torch.hann_window(out.numel(), periodic=False, dtype=torch.float64)).abs()
    peak_hz = spectrum.argmax().item() * 24000 / out.numel()
    assert abs(peak_hz - freq) <= 1.0, f"peak at {peak_hz} Hz, expected {freq}"
    ideal = torch.sin(2 * math.pi * freq * torch.arange(out.numel(), dtype=torch.float64) / 24000)
    interior = slice(500, out.numel() - 500)  # the edges see zero padding
    err = (out[interior] - ideal[interior]).abs().max().item()
    assert err <= 1e-3, f"max error against the ideal 24 kHz sine = {err}"


def test_resampler_agrees_with_scipy_resample_poly_in_the_passband():
    signal = pytest.importorskip("scipy.signal", reason="scipy is not installed")
    rng = np.random.default_rng(3)
    t = np.arange(44100) / 44100
    wave = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in (220.0, 1000.0, 3000.0, 7000.0)) / 4
    ours = resample(torch.from_numpy(wave), 44100, 24000).numpy()
    theirs = signal.resample_poly(wave, 80, 147)
    interior = slice(500, len(theirs) - 500)
    err = np.abs(ours[interior] - theirs[interior]).max()
    assert err <= 2e-3, f"max |musecore - scipy.resample_poly| = {err}"


def test_resampling_to_the_same_rate_is_the_identity():
    wave = torch.randn(1001)
    assert torch.equal(resample(wave, 24000, 24000), wave)


@pytest.mark.parametrize("lengths", [[5000], [5000, 100, 1920, 3841], [1], [1920, 1921]])
def test_padding_and_mask_equal_transformers_feature_extractor(lengths):
    from transformers.models.muse_spark.feature_extraction_muse_spark import MuseSparkFeatureExtractor
    clips = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in lengths]
    want = MuseSparkFeatureExtractor()([c.numpy() for c in clips], sampling_rate=24000, return_tensors="pt")
    got = process_audio(clips)
    assert got.input_values.dtype == torch.float32 and got.mask.dtype == torch.bool
    assert torch.equal(got.input_values, want["input_values"])
    assert torch.equal(got.mask, want["input_values_mask"].bool())
    assert got.input_values.shape[1] % 1920 == 0
    assert [got.num_tokens(i) for i in range(len(lengths))] == [math.ceil(n / 1920) for n in lengths]


def write_wav(path, wave: np.ndarray, rate: int, subtype: str = "PCM_16"):
    sf.write(str(path), wave, rate, subtype=subtype)
    data, _ = sf.read(str(path), dtype="float32", always_2d=True)
    return data  # what the file holds, [samples, channels]


@pytest.mark.parametrize("rate", [16000, 44100, 24000])
def test_files_are_downmixed_by_averaging_then_resampled(tmp_path, rate):
    rng = np.random.default_rng(rate)
    stereo = rng.uniform(-0.5, 0.5, (rate // 10 + 7, 2))
    stored = write_wav(tmp_path / "a.wav", stereo, rate)
    got = load_audio(tmp_path / "a.wav")
    want = resample(torch.from_numpy(stored.mean(axis=1)), rate, 24000)
    assert got.dtype == torch.float32 and got.shape == (math.ceil(stored.shape[0] * 24000 / rate),)
    assert torch.equal(got, want)


def test_every_source_form_gives_the_same_waveform(tmp_path):
    wave = np.sin(np.arange(4410) / 7.0) * 0.5
    write_wav(tmp_path / "a.flac", wave, 44100)
    data = (tmp_path / "a.flac").read_bytes()
    b64 = base64.b64encode(data).decode()
    want = load_audio(tmp_path / "a.flac")
    for src in (str(tmp_path / "a.flac"), data, f"data:audio/flac;base64,{b64}", {"data": b64, "format": "flac"}):
        assert torch.equal(load_audio(src), want), type(src)


def test_arrays_default_to_24khz_and_pcm_is_scaled():
    wave = np.linspace(-1, 1, 3001).astype(np.float32)
    assert torch.equal(load_audio(wave), torch.from_numpy(wave))
    assert load_audio(torch.from_numpy(wave), sampling_rate=16000).shape == (math.ceil(3001 * 1.5),)
    pcm = (wave * 32767).astype(np.int16)
    assert torch.allclose(load_audio(pcm), torch.from_numpy(pcm.astype(np.float32) / 32768))


def test_containers_soundfile_cannot_read_are_decoded_with_pyav(tmp_path):
    av = pytest.importorskip("av", reason="the media extra (av) is not installed")
    path = tmp_path / "tone.m4a"
    rate, n = 24000, 24000
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone[None], format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    got = load_audio(path)
    # AAC is lossy and adds encoder delay: check the length roughly and the pitch exactly
    assert abs(got.numel() - n) <= 2048
    spectrum = torch.fft.rfft(got.double()).abs()
    assert abs(spectrum.argmax().item() * 24000 / got.numel() - 440) <= 2


def test_openai_pcm16_is_raw_24khz_int16():
    pcm = (np.sin(np.arange(2401) / 5.0) * 20000).astype("<i2")
    wave = load_audio({"data": base64.b64encode(pcm.tobytes()).decode(), "format": "pcm16"})
    assert torch.equal(wave, torch.from_numpy(pcm.astype(np.float32) / 32768))
    from musecore.media import MediaError
    with pytest.raises(MediaError, match="pcm16 data has an odd number of bytes \\(3\\)"):
        load_audio({"data": base64.b64encode(b"abc").decode(), "format": "pcm16"})


def test_defaults_match_the_transformers_feature_extractor():
    from transformers.models.muse_spark.feature_extraction_muse_spark import MuseSparkFeatureExtractor
    from musecore.media import AudioSettings
    theirs, ours = MuseSparkFeatureExtractor(), AudioSettings()
    assert (ours.sampling_rate, ours.samples_per_token, ours.padding_value) == \
        (theirs.sampling_rate, theirs.samples_per_token, theirs.padding_value) == (24000, 1920, 0.0)
