"""Audio in, 24 kHz mono waveforms out, padded for the audio tower as transformers pads them.

The audio tower reads the raw waveform at 24 kHz (no spectrogram) and turns every 1920 samples
(80 ms) into one token, so the feature extractor only pads: every clip of a batch is right-padded
with zeros to the longest, rounded up to a multiple of 1920, with a mask of the real samples
(transformers 5.24 ``MuseSparkFeatureExtractor``).

Files are decoded with soundfile (WAV, FLAC, OGG/Vorbis, Opus, MP3, ...) or, for containers
libsndfile does not read (M4A/AAC, WebM, MP4 audio tracks), with PyAV; channels are averaged to
mono as transformers does. Other rates are resampled here in plain torch with a Hann-windowed
sinc (the filter of ``torchaudio.functional.resample``: 6 zero crossings, roll-off 0.99), because
torchaudio does not load beside the CPU torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .errors import MediaError, require
from .image import as_tensor
from .sources import decode_base64, describe, is_source, resolve, subject

SAMPLING_RATE = 24000
SAMPLES_PER_TOKEN = 1920  # 16 * 6 * 5 * 4, the audio tower's patch sizes
_CHUNK = 1 << 15          # output samples per resampling step (bounds memory to ~10 MB)


@dataclass(frozen=True)
class AudioSettings:
    """The feature extractor's settings (``preprocessor_config.json``), transformers' defaults."""

    sampling_rate: int = SAMPLING_RATE
    samples_per_token: int = SAMPLES_PER_TOKEN
    padding_value: float = 0.0


@dataclass
class AudioInputs:
    """Padded clips: ``input_values [n, L]`` float32 with L a multiple of 1920, ``mask [n, L]`` bool."""

    input_values: torch.Tensor
    mask: torch.Tensor
    samples_per_token: int = SAMPLES_PER_TOKEN

    def __len__(self) -> int:
        return int(self.input_values.shape[0])

    def num_tokens(self, index: int) -> int:
        """Audio tokens of clip ``index``: ceil(real samples / 1920)."""
        return -(-int(self.mask[index].sum()) // self.samples_per_token)


def load_audio(src: Any, sampling_rate: Optional[int] = None, *, name: Optional[str] = None,
               target_rate: int = SAMPLING_RATE) -> torch.Tensor:
    """Any supported audio input -> float32 mono waveform ``[samples]`` at ``target_rate`` (24 kHz).

    ``src``: a path, bytes, a ``data:audio/...;base64,`` URL, an OpenAI ``input_audio`` dict
    ``{"data": <base64>, "format": "wav"}`` (any file format; "pcm16" is raw 24 kHz int16), or a 1-D numpy array / tensor sampled at
    ``sampling_rate`` (default 24000; int16/int32 PCM is scaled to [-1, 1]).

    Example::

        wave = load_audio("speech.flac")                    # tensor [n], 24 kHz
        wave = load_audio(np.zeros(16000), sampling_rate=16000)   # 24000 samples
    """
    if isinstance(src, dict):
        label = subject("audio", name or "input_audio")
        if "data" not in src:
            raise MediaError(f"{label}: an input_audio dict needs a 'data' key with base64 audio "
                             f"(and 'format', e.g. 'wav')")
        audio_format = str(src.get("format") or "").lower()
        data = src["data"]
        src = decode_base64(data, "audio", label) if isinstance(data, str) else data
        name = label
        if audio_format == "pcm16":  # OpenAI's raw format: 16-bit little-endian mono at 24 kHz, no header
            if len(src) % 2:
                raise MediaError(f"{label}: pcm16 data has an odd number of bytes ({len(src)}); pass whole 16-bit "
                                 f"samples")
            src, sampling_rate = np.frombuffer(bytes(src), dtype="<i2").astype(np.int16), sampling_rate or 24000
    if isinstance(src, (np.ndarray, torch.Tensor)):
        label = subject("audio", name or "array")
        wave, rate = _array_to_mono(src, label), int(sampling_rate or SAMPLING_RATE)
    elif is_source(src):
        resolved = resolve(src, "audio", name)
        label = resolved.name
        wave, rate = _decode(resolved)
        if sampling_rate is not None and int(sampling_rate) != rate:
            raise MediaError(f"{label} is {rate} Hz but sampling_rate={sampling_rate} was given; drop "
                             f"sampling_rate for files (it is read from the file)")
    else:
        raise MediaError(f"{subject('audio', describe(src, name))}: expected a path, bytes, data: URL, input_audio "
                         f"dict or 1-D array, got {type(src).__name__}")
    if rate <= 0:
        raise MediaError(f"{label}: sampling rate {rate} Hz is not positive; pass the rate the audio was "
                         f"recorded at")
    if wave.numel() == 0:
        raise MediaError(f"{label} has no samples (zero length); pass a non-empty clip")
    if not bool(torch.isfinite(wave).all()):
        raise MediaError(f"{label} contains NaN or infinite samples; pass finite values in [-1, 1]")
    return resample(wave, rate, target_rate)


def resample(wave: torch.Tensor, orig_rate: int, new_rate: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Resample ``[samples]`` from ``orig_rate`` to ``new_rate`` Hz: Hann-windowed sinc interpolation.

    The filter of ``torchaudio.functional.resample`` (``sinc_interp_hann``): after dividing both rates
    by their gcd, output k sits at input position k * orig / new and takes the input samples within
    6 / cut-off of it (cut-off = 0.99 * the lower rate). The weights depend only on the output's phase
    k mod new, so they are one table ``[new, taps]``. Output length is ceil(samples * new / orig), as
    torchaudio and transformers' soundfile path give. Computed in float64, returned as float32.
    """
    wave = wave.reshape(-1)
    if orig_rate == new_rate:
        return wave.to(torch.float32)
    gcd = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // gcd, int(new_rate) // gcd
    out_length = -(-new * wave.numel() // orig)
    weights, first, width = _phase_table(orig, new, lowpass_filter_width, rolloff)
    x = wave.to(torch.float64)
    if new * (orig + 2 * width + 1) <= _DENSE_LIMIT:
        out = _apply_dense(x, weights, first, width, orig, new, out_length)
    else:  # e.g. 44101 -> 24000 Hz: a dense kernel would be new x orig (10^9) values
        out = _apply_gather(x, weights, first, width, orig, new, out_length)
    return out.to(torch.float32)


_DENSE_LIMIT = 1 << 22  # kernel values of the one-convolution form (32 MiB in float64)


def _phase_table(orig: int, new: int, lowpass_filter_width: int, rolloff: float):
    """Weights ``[new, 2*width + 2]`` of each output phase j for the input samples floor(j*orig/new) + (-width ..
    width+1), the first of those positions per phase, and ``width`` (input samples each side)."""
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    phase = torch.arange(new, dtype=torch.int64)
    first = (phase * orig) // new                                                     # [new]
    taps = first[:, None] + torch.arange(-width, width + 2, dtype=torch.int64)        # [new, T] input offsets
    t = (taps * new - (phase * orig)[:, None]).to(torch.float64) * (base / (orig * new))
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * (math.pi / lowpass_filter_width / 2)) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, 1.0, t))
    return sinc * window * (base / orig), first, width


def _apply_dense(x, weights, first, width, orig, new, out_length) -> torch.Tensor:
    """One strided conv1d: every phase's weights placed at its offset in a ``[new, 1, orig + 2*width + 1]`` kernel."""
    size = orig + 2 * width + 1
    kernel = torch.zeros(new, size, dtype=torch.float64)
    columns = first[:, None] + torch.arange(weights.shape[1])                         # [new, T] in 0..size-1
    kernel.scatter_(1, columns, weights)
    blocks = -(-out_length // new)
    right = max(0, (blocks - 1) * orig + size - width - x.numel())
    padded = torch.nn.functional.pad(x[None, None], (width, right))
    out = torch.nn.functional.conv1d(padded, kernel[:, None], stride=orig)            # [1, new, blocks]
    return out[0, :, :blocks].transpose(0, 1).reshape(-1)[:out_length]


def _apply_gather(x, weights, first, width, orig, new, out_length) -> torch.Tensor:
    """Per output sample, in chunks: gather its taps and weight them by its phase's row of the table."""
    length = x.numel()
    offsets = torch.arange(-width, width + 2, dtype=torch.int64)
    out = torch.empty(out_length, dtype=torch.float64)
    for start in range(0, out_length, _CHUNK):
        k = torch.arange(start, min(start + _CHUNK, out_length), dtype=torch.int64)
        phase = k % new
        m = ((k // new) * orig + first[phase])[:, None] + offsets                     # [K, T] input indices
        inside = (m >= 0) & (m < length)
        taps = torch.where(inside, x[m.clamp(0, length - 1)], 0.0)
        out[start:start + k.numel()] = (taps * weights[phase]).sum(dim=1)
    return out


def process_audio(waves: Sequence[torch.Tensor], settings: AudioSettings = AudioSettings()) -> AudioInputs:
    """24 kHz mono waveforms -> :class:`AudioInputs`: right-padded to the longest clip rounded up to a
    multiple of ``samples_per_token`` (transformers' ``MuseSparkFeatureExtractor(padding="longest")``).

    Example::

        inputs = process_audio([load_audio("a.wav"), load_audio("b.wav")])
        inputs.input_values.shape     # [2, L], L % 1920 == 0
    """
    clips = []
    for index, wave in enumerate(waves):
        wave = torch.as_tensor(wave)
        if wave.ndim != 1:
            raise MediaError(f"audio #{index + 1} has shape {tuple(wave.shape)}; pass 1-D mono waveforms "
                             f"(load_audio returns them)")
        if wave.numel() == 0:
            raise MediaError(f"audio #{index + 1} has no samples (zero length); pass a non-empty clip")
        clips.append(wave.to(torch.float32))
    step = settings.samples_per_token
    longest = max((c.numel() for c in clips), default=0)
    length = -(-longest // step) * step
    values = torch.full((len(clips), length), float(settings.padding_value), dtype=torch.float32)
    mask = torch.zeros((len(clips), length), dtype=torch.bool)
    for row, clip in enumerate(clips):
        values[row, :clip.numel()] = clip
        mask[row, :clip.numel()] = True
    return AudioInputs(values, mask, step)


def _array_to_mono(array: Any, label: str) -> torch.Tensor:
    tensor = array.detach().cpu() if isinstance(array, torch.Tensor) else as_tensor(array)
    if tensor.ndim != 1:
        raise MediaError(f"{label} has shape {tuple(tensor.shape)}; pass a 1-D mono waveform "
                         f"(average the channels first, e.g. x.mean(axis=0))")
    if tensor.dtype == torch.int16:
        return tensor.to(torch.float32) / 32768.0
    if tensor.dtype == torch.int32:
        return tensor.to(torch.float32) / 2147483648.0
    if not tensor.is_floating_point():
        raise MediaError(f"{label} has dtype {tensor.dtype}; pass float samples in [-1, 1] or int16/int32 PCM")
    return tensor.to(torch.float32)


def _decode(resolved) -> tuple[torch.Tensor, int]:
    """Decode a file or bytes to (mono float32 waveform, sampling rate): soundfile, else PyAV."""
    soundfile = require("soundfile")
    try:
        with soundfile.SoundFile(resolved.file()) as f:
            rate = f.samplerate
            frames = f.read(dtype="float32", always_2d=True)            # [samples, channels]
    except (RuntimeError, TypeError, ValueError, EOFError, OSError) as exc:  # LibsndfileError is a RuntimeError
        soundfile_reason = _reason(exc)
    else:
        mono = frames.mean(axis=1) if frames.shape[1] > 1 else frames[:, 0]   # transformers' downmix
        return torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32)), int(rate)
    return _decode_av(resolved, soundfile_reason)


def _decode_av(resolved, soundfile_reason: str) -> tuple[torch.Tensor, int]:
    """Audio libsndfile cannot read (M4A/AAC, WebM, MP4...): decode the first audio stream with PyAV."""
    label = resolved.name
    try:
        av = require("av")
    except MediaError:
        raise MediaError(f"{label} cannot be decoded by soundfile ({soundfile_reason}) and PyAV is not "
                         f"installed for other containers; convert it to WAV or FLAC, or install: "
                         f'pip install "musecore[media]"') from None
    try:
        with av.open(resolved.file()) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise MediaError(f"{label} has no audio stream; pass an audio file (WAV, FLAC, MP3, OGG, M4A)")
            chunks, rate = [], None
            for frame in container.decode(stream):
                rate = rate or frame.sample_rate
                channels = len(frame.layout.channels)
                samples = frame.to_ndarray()
                if not frame.format.is_planar:                       # packed: [1, samples * channels]
                    samples = samples.reshape(-1, channels).T
                chunks.append(_pcm_to_float(samples).mean(axis=0))
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise MediaError(f"{label} cannot be decoded (soundfile: {soundfile_reason}; PyAV: {_reason(exc)}); "
                         f"it is corrupt or an unsupported format: convert it to WAV or FLAC") from None
    if not chunks or rate is None:
        raise MediaError(f"{label} has no samples (zero length); pass a non-empty clip")
    return torch.from_numpy(np.concatenate(chunks).astype(np.float32)), int(rate)


def _pcm_to_float(samples: np.ndarray) -> np.ndarray:
    if samples.dtype == np.int16:
        return samples.astype(np.float32) / 32768.0
    if samples.dtype == np.int32:
        return samples.astype(np.float32) / 2147483648.0
    if samples.dtype == np.uint8:
        return (samples.astype(np.float32) - 128.0) / 128.0
    return samples.astype(np.float32)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
