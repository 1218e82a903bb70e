"""EncoderCache: content keys, LRU order, the byte bound, counters (with a counting fake encoder)."""

from __future__ import annotations

import pytest
import torch

from musecore.multimodal import (CACHE_BYTES_ENV, DEFAULT_CACHE_BYTES, EncoderCache, cache_bytes_from_env,
                                 content_key, encoder_cache, parse_bytes)


class CountingEncoder:
    """Encodes item i of ``inputs`` as a [rows, 4] fp32 tensor (16 bytes a row); counts calls and items."""

    def __init__(self, inputs: list[torch.Tensor], rows: int = 4) -> None:
        self.inputs, self.rows = inputs, rows
        self.calls, self.items = 0, 0

    def __call__(self, indices: list[int]) -> list[torch.Tensor]:
        self.calls += 1
        self.items += len(indices)
        return [self.inputs[i].float().sum() + torch.zeros(self.rows, 4) for i in indices]


def keys_of(inputs: list[torch.Tensor]) -> list[str]:
    return [content_key("image", (t,)) for t in inputs]


def test_key_depends_on_kind_shape_dtype_and_bytes_only():
    a = torch.arange(12, dtype=torch.float32)
    assert content_key("image", (a,)) == content_key("image", (a.clone(),))
    assert content_key("image", (a,)) != content_key("audio", (a,))
    assert content_key("image", (a,)) != content_key("image", (a.view(3, 4),))
    assert content_key("image", (a,)) != content_key("image", (a.double(),))
    b = a.clone()
    b[5] += 1e-6
    assert content_key("image", (a,)) != content_key("image", (b,))
    assert content_key("image", (a[::2],)) == content_key("image", (a[::2].contiguous(),))  # strided views too


def test_second_turn_with_the_same_image_runs_the_encoder_zero_times():
    cache = EncoderCache(1 << 20)
    image = [torch.arange(6.0)]
    enc = CountingEncoder(image)
    first = cache.encode(keys_of(image), enc)
    assert (enc.calls, cache.misses, cache.hits) == (1, 1, 0)
    second = cache.encode(keys_of([torch.arange(6.0)]), CountingEncoder(image))  # an equal tensor, another object
    assert cache.encoder_calls == 1 and cache.hits == 1
    assert second[0] is first[0]


def test_one_image_repeated_in_a_batch_is_encoded_once():
    cache = EncoderCache(1 << 20)
    a, b = torch.arange(6.0), torch.ones(6)
    inputs = [a, b, a.clone(), a.clone()]
    enc = CountingEncoder(inputs)
    out = cache.encode(keys_of(inputs), enc)
    assert enc.calls == 1 and enc.items == 2, f"encoded {enc.items} items in {enc.calls} calls"
    assert (cache.misses, cache.hits) == (2, 2)
    assert out[0] is out[2] is out[3] and not torch.equal(out[0], out[1])


def test_repeats_are_encoded_once_even_when_nothing_is_kept():
    cache = EncoderCache(0)
    inputs = [torch.arange(6.0)] * 3
    enc = CountingEncoder(inputs)
    cache.encode(keys_of(inputs), enc)
    assert enc.items == 1 and len(cache) == 0 and cache.bytes == 0 and cache.too_large == 1


def test_bytes_never_exceed_the_bound_and_the_least_recently_used_goes_first():
    row_bytes = 16
    cache = EncoderCache(3 * 4 * row_bytes)  # room for three 4-row outputs
    inputs = [torch.full((3,), float(i)) for i in range(6)]
    keys = keys_of(inputs)
    enc = CountingEncoder(inputs)
    for i in range(3):
        cache.encode([keys[i]], enc)
        assert cache.bytes <= cache.max_bytes
    cache.encode([keys[0]], enc)  # 0 is now the most recently used; 1 the least
    cache.encode([keys[3]], enc)
    assert cache.bytes == cache.max_bytes and cache.evictions == 1
    assert keys[1] not in cache and all(keys[i] in cache for i in (0, 2, 3))
    for i in range(6):  # churn: the bound holds after every call
        cache.encode([keys[i], keys[(i + 2) % 6]], enc)
        assert cache.bytes <= cache.max_bytes, f"{cache.bytes} > {cache.max_bytes}"
        assert cache.bytes == sum(t.numel() * t.element_size() for t in cache._entries.values())


def test_an_output_larger_than_the_bound_is_used_once_not_cached_and_counted():
    cache = EncoderCache(100)
    inputs = [torch.arange(3.0)]
    enc = CountingEncoder(inputs, rows=8)  # 128 bytes > 100
    out = cache.encode(keys_of(inputs), enc)
    assert out[0].shape == (8, 4) and len(cache) == 0 and cache.bytes == 0 and cache.too_large == 1
    cache.encode(keys_of(inputs), enc)
    assert enc.calls == 2 and cache.too_large == 2


def test_put_replacing_a_key_keeps_the_byte_count_exact():
    cache = EncoderCache(1000)
    cache.put("k", torch.zeros(10, 4))
    cache.put("k", torch.zeros(5, 4))
    assert cache.bytes == 80 and len(cache) == 1


def test_encoder_returning_the_wrong_count_is_an_error():
    cache = EncoderCache(1000)
    with pytest.raises(ValueError, match="returned 0 outputs for 1 inputs"):
        cache.encode(["k"], lambda idx: [])


def test_bad_bounds_are_refused():
    for bad in (-1, 1.5, True, "1M"):
        with pytest.raises(ValueError, match="max_bytes"):
            EncoderCache(bad)


@pytest.mark.parametrize("text, want", [("0", 0), ("4096", 4096), ("256M", 256 << 20), ("256MiB", 256 << 20),
                                        ("256MB", 256_000_000), ("1G", 1 << 30), ("1.5k", 1536)])
def test_sizes_parse(text, want):
    assert parse_bytes(text) == want


def test_env_sets_the_default_bound_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.delenv(CACHE_BYTES_ENV, raising=False)
    assert cache_bytes_from_env() == DEFAULT_CACHE_BYTES
    monkeypatch.setenv(CACHE_BYTES_ENV, "64M")
    assert EncoderCache.from_env().max_bytes == 64 << 20
    monkeypatch.setenv(CACHE_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=f"{CACHE_BYTES_ENV}='lots': set it to a size"):
        cache_bytes_from_env()


def test_one_cache_per_model_made_on_first_use(monkeypatch):
    monkeypatch.setenv(CACHE_BYTES_ENV, "1M")

    class Model:
        pass

    model = Model()
    cache = encoder_cache(model)
    assert cache is encoder_cache(model) is model.encoder_cache and cache.max_bytes == 1 << 20


def test_an_encoder_that_fails_leaves_the_cache_as_it_was():
    cache = EncoderCache(1 << 20)
    cache.put("old", torch.zeros(2, 4))

    def broken(indices):
        raise RuntimeError("tower failed")

    with pytest.raises(RuntimeError, match="tower failed"):
        cache.encode(["old", "new"], broken)
    assert "old" in cache and "new" not in cache and cache.bytes == 32
