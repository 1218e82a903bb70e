"""The KV cache: all positions for full-attention layers, a ring buffer of W for sliding ones.

Each layer's cache keeps keys, values and the absolute position held in every slot (``-1`` for an
empty slot), so the attention op needs no other bookkeeping: its mask is computed from positions
alone, which makes ring buffers, left-padded batches and prefill chunks one case. A step attends
over ``[cached, new]`` and only then writes the new entries, so a prefill longer than the window
still sees every key it needs. FP8 caches hold E4M3 with one fixed per-tensor scale for keys and one for
values (1.0 unless given, as vLLM does for checkpoints without KV scales; keys are RMS-normed so
they sit well inside E4M3's range), and new entries are quantized before attention, so
incremental decode sees exactly what a whole-sequence pass through the same cache sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from musecore.config import SLIDING, MuseConfig

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: E4M3's largest finite value
KV_FORMATS = ("bf16", "fp8")


def write_static(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool) -> None:
    """Scatter new entries ``[B,T,...]`` into a static layer cache of ``capacity + 1`` slots, no host sync.

    Entry ``(b, t)`` goes to slot ``pos % capacity`` (ring) or ``pos`` (full layer); padding (-1) and
    out-of-range positions go to the trash slot ``capacity``, which no view reads. Positions beyond
    a full layer's capacity cannot be reported here without a sync; the caller (``generate``) sizes
    the cache for the prompt plus ``max_new_tokens`` up front. This is the reference for a backend's
    ``kv_write`` (same signature), which a static cache calls instead when the backend has one.
    """
    B, T = pos_new.shape
    if ring:
        slot = torch.where(pos_new >= 0, pos_new % capacity, capacity)
    else:
        slot = torch.where((pos_new >= 0) & (pos_new < capacity), pos_new, capacity)
    b = torch.arange(B, device=pos_new.device)[:, None].expand(B, T)
    k[b, slot], v[b, slot], positions[b, slot] = k_new, v_new, pos_new


KVWriter = Callable[..., None]  # write_static's signature
# ``row_writer(k, v, positions, k_new, v_new, slot, position) -> bool``: a backend's copy of one decode entry per batch
# row, every row at ``position``, into ``slot`` of a (non-static) CPU layer cache; False where it does not apply (the
# cache then writes by narrowing). The entries are the same either way.
RowWriter = Callable[..., bool]


@dataclass
class KVView:
    k: torch.Tensor  # [B,S,nkv,d]
    v: torch.Tensor
    positions: torch.Tensor  # [B,S] long, -1 = empty
    k_scale: Optional[float] = None
    v_scale: Optional[float] = None


class LayerCache:
    def __init__(self, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *, ring: bool,
                 kv_format: str, dtype: torch.dtype, device: torch.device,
                 k_scale: float = 1.0, v_scale: float = 1.0, static: bool = False,
                 writer: Optional[KVWriter] = None, row_writer: Optional[RowWriter] = None) -> None:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"unknown KV cache format {kv_format!r}; choose one of {KV_FORMATS}")
        store = torch.float8_e4m3fn if kv_format == "fp8" else dtype
        self.ring, self.capacity, self.kv_format, self.static = ring, capacity, kv_format, static
        # A static cache has one extra "trash" slot that padding entries are written to, so a write
        # never needs to know on the host which entries are real (no device sync: graph-capturable).
        slots = capacity + 1 if static else capacity
        self.k = torch.zeros(batch, slots, num_kv_heads, head_dim, dtype=store, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.full((batch, slots), -1, dtype=torch.long, device=device)
        self.writer = writer or write_static  # static writes: a backend's fused kernel, or the reference
        self.row_writer = row_writer  # CPU decode writes (one position for every row): a backend's one call, or None
        self.used = 0  # slots [0, used) may hold entries (full layers); ring layers use all
        # a static full layer's read bound: attention reads slots [0, reads) when set (a view over rows whose positions
        # all lie below it, e.g. the serve engine's per-length decode graphs), else the whole capacity
        self.reads: Optional[int] = None
        fp8 = kv_format == "fp8"
        self.k_scale: Optional[float] = k_scale if fp8 else None
        self.v_scale: Optional[float] = v_scale if fp8 else None
        self._whole: Optional[KVView] = None  # the view of every slot (ring and static layers read all): made once

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys/values in the cache's storage format."""
        if self.kv_format != "fp8":
            if k.dtype is self.k.dtype and v.dtype is self.v.dtype:  # the usual case: no dispatch per layer and token
                return k, v
            return k.to(self.k.dtype), v.to(self.v.dtype)
        quant = lambda x, s: (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # noqa: E731
        return quant(k, self.k_scale), quant(v, self.v_scale)

    @property
    def readable(self) -> int:
        """Slots attention reads: the whole ring, a static layer's capacity or read bound (never its trash slot),
        else the filled ones."""
        if self.ring:
            return self.capacity
        if self.static:
            return self.capacity if self.reads is None else min(self.reads, self.capacity)
        return self.used

    def stored(self) -> KVView:
        """The slots attention reads, as views of the cache (no copy). A ring or static layer reads every slot,
        so its view never changes and is made once (each slice costs a few microseconds on the CPU, per layer
        and token); a full layer's grows with ``used``."""
        if self._whole is not None:
            return self._whole
        c = self.readable  # narrow, not [:, :c]: ~1 us less per slice (a full layer's decode view is new every step)
        view = KVView(self.k.narrow(1, 0, c), self.v.narrow(1, 0, c), self.positions.narrow(1, 0, c), self.k_scale,
                      self.v_scale)
        if self.ring or self.static:
            self._whole = view
        return view

    def view_with(self, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor) -> KVView:
        """Cached entries followed by the (encoded) new ones: what this step's attention reads."""
        limit = self.readable
        return KVView(torch.cat([self.k[:, :limit], k_new], 1), torch.cat([self.v[:, :limit], v_new], 1),
                      torch.cat([self.positions[:, :limit], pos_new], 1), self.k_scale, self.v_scale)

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor) -> KVView:
        """Store this step's (encoded) entries and return what its attention reads.

        At decode (one new entry per row) the cache is written first and then read in place, with no
        copy of it: the slot the new entry takes in a ring held the position one window back, which
        the window no longer sees. Otherwise (prefill, where new entries may overwrite ring slots
        that earlier queries of the same step still need) the view is a concatenation made before
        the write.
        """
        if k_new.shape[1] == 1:
            self.write(k_new, v_new, pos_new)
            return self.stored()
        view = self.view_with(k_new, v_new, pos_new)
        self.write(k_new, v_new, pos_new)
        return view

    def write(self, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor) -> None:
        if self.ring and k_new.shape[1] > self.capacity:  # older entries would be overwritten anyway
            k_new, v_new, pos_new = (t[:, -self.capacity:] for t in (k_new, v_new, pos_new))
        if self.static:
            self.writer(self.k, self.v, self.positions, k_new, v_new, pos_new, self.capacity, self.ring)
            return
        if k_new.shape[1] == 1 and self.k.device.type == "cpu":
            self._write_one(k_new, v_new, pos_new)
            return
        b, t = (pos_new >= 0).nonzero(as_tuple=True)
        pos = pos_new[b, t]
        if pos.numel():
            self.check_capacity(int(pos.max()))
        slots = pos % self.capacity if self.ring else pos
        self.k[b, slots], self.v[b, slots], self.positions[b, slots] = k_new[b, t], v_new[b, t], pos
        if not self.ring and pos.numel():
            self.used = max(self.used, int(pos.max()) + 1)

    def check_capacity(self, last: int) -> None:
        """A full (non-ring) layer cannot hold position ``last`` past its capacity."""
        if not self.ring and last >= self.capacity:
            raise ValueError(f"sequence position {last} exceeds the KV cache capacity {self.capacity}; "
                             "create the cache with a larger max_length")

    def _write_one(self, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor) -> None:
        """Decode on the CPU: one entry per batch row, written by narrowing. The indexed writes above (nonzero, three
        index_put) cost ~90-150 us per layer on the 2-core EPYC (~2 ms of a muse-small token); when every row is at
        one position (one sequence, or a batch in step) three narrow copies take ~10 us, else one write per row."""
        # one row (the usual decode): int() reads it about 3 us faster than tolist() on the 2-core EPYC
        positions = [int(pos_new)] if pos_new.shape[0] == 1 else pos_new[:, 0].tolist()
        if not positions:
            return
        self.check_capacity(max(positions))  # before any write: nothing half-written
        first = positions[0]
        if first >= 0 and positions.count(first) == len(positions):
            slot = first % self.capacity if self.ring else first
            if self.row_writer is None or not self.row_writer(self.k, self.v, self.positions, k_new, v_new, slot, first):
                self.k.narrow(1, slot, 1).copy_(k_new)
                self.v.narrow(1, slot, 1).copy_(v_new)
                self.positions.narrow(1, slot, 1).fill_(first)
            if not self.ring:
                self.used = max(self.used, first + 1)
            return
        for b, pos in enumerate(positions):
            if pos < 0:  # padding
                continue
            slot = pos % self.capacity if self.ring else pos
            self.k[b, slot], self.v[b, slot], self.positions[b, slot] = k_new[b, 0], v_new[b, 0], pos
            if not self.ring:
                self.used = max(self.used, pos + 1)


def cache_bytes(config: MuseConfig, batch: int, max_length: int, kv_heads: int, kv_format: str, dtype: torch.dtype,
                static: bool) -> int:
    """The bytes :class:`KVCache` allocates for these arguments: K, V and the positions of every layer's slots."""
    value = 1 if kv_format == "fp8" else torch.empty((), dtype=dtype).element_size()
    per_slot = 2 * kv_heads * config.head_dim * value + 8  # K and V, and the int64 position
    slots = sum((min(config.sliding_window, max_length) if kind == SLIDING else max_length) + int(static)
                for kind in config.layer_types)
    return batch * slots * per_slot


def check_fits(config: MuseConfig, batch: int, max_length: int, kv_heads: int, kv_format: str, dtype: torch.dtype,
               device: torch.device, static: bool) -> None:
    """A ValueError with the cache's size and what to lower when it would not fit in the memory free on ``device``
    now (where that is known), before a byte of it is allocated: not an allocator error part way through."""
    need = cache_bytes(config, batch, max_length, kv_heads, kv_format, dtype, static)
    free = free_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"a KV cache of {batch} rows x {max_length} positions ({kv_format}) needs {need / 2**30:.1f} "
                         f"GiB and {device} has {free / 2**30:.1f} GiB free; use fewer rows (a smaller batch, "
                         "--max-batch) or fewer positions (max_new_tokens, --max-model-len)")


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Bytes free for new tensors on ``device`` now: the GPU's own count, the host's available memory for the CPU;
    None where it is not known (a TPU, another platform)."""
    if device.type == "cuda":  # not while a graph is captured: no driver query inside a capture
        if torch.cuda.is_current_stream_capturing():
            return None
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's, free to reuse
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type == "cpu":  # Linux's MemAvailable counts the page cache it can drop (free pages alone do not)
        try:
            with open("/proc/meminfo") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            return int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return None


class KVCache:
    """One :class:`LayerCache` per layer, sized by the config: ``KVCache(config, batch, max_length)``.

    ``static=True`` keeps every shape fixed and every write free of host syncs (attention reads the
    whole capacity, masked by positions), which is what CUDA-graph capture of a decode step needs;
    its writes go through ``writer`` (a backend's ``kv_write``) when given, else :func:`write_static`;
    the default trims full layers to the filled length, which is faster on the CPU. ``row_writer`` (a backend's
    ``kv_write_row``, see :data:`RowWriter`) takes a non-static CPU cache's decode writes when given.
    """

    def __init__(self, config: MuseConfig, batch: int, max_length: int, *, kv_format: str = "bf16",
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 static: bool = False, writer: Optional[KVWriter] = None, num_kv_heads: Optional[int] = None,
                 row_writer: Optional[RowWriter] = None) -> None:
        device = torch.device(device)
        kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads  # a rank's share (TP)
        check_fits(config, batch, max_length, kv_heads, kv_format, dtype, device, static)
        self.static = static
        self.layers = []
        for kind in config.layer_types:
            ring = kind == SLIDING
            capacity = min(config.sliding_window, max_length) if ring else max_length
            self.layers.append(LayerCache(batch, capacity, kv_heads, config.head_dim,
                                          ring=ring, kv_format=kv_format, dtype=dtype, device=device,
                                          static=static, writer=writer if static else None,
                                          row_writer=None if static else row_writer))
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def reset(self) -> None:
        """Empty the cache in place (every entry invisible, next position 0), keeping its buffers, so a
        decode step captured on it (a CUDA graph holds their addresses) stays valid."""
        for layer in self.layers:
            layer.positions.fill_(-1)
            layer.used = 0
        self.next_position.zero_()
