"""The vision tower: images and video frames -> features in the text width (MODEL.md section 2).

Transformers' ``MuseSparkVisionModel`` then ``MuseSparkModel.get_image_features``: patches of
``2 x 14 x 14`` pixels (two frames; an image is its frame twice) are embedded by one linear, the
learned 32x32 position table is resampled to each grid, ``ln_pre``, then pre-LN blocks of
bidirectional attention (q/k/v biases, axial 2-D RoPE) and a GELU MLP. Attention runs inside 32x32
patch windows on most layers and over the whole frame on the config's ``full_attention`` layers;
every image and frame of a call is packed into one sequence and the segments are ``cu_seqlens``
boundaries (``varlen_attention``). Then ``ln_post``, a 2x2 pixel-shuffle merge, the vision
adapter (fc1, GELU, fc2, GELU), the projection to the text width and a weightless RMSNorm.

Example::

    feats = model.encode_images(pixel_values, grid_thw)   # list of [t*h*w/4, H], one per image
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from musecore.names import VISION
from musecore.ops import Ops

TOWER = "model.vision_tower."
ADAPTER = "model.vision_adapter."
PROJECTION = "model.vision_projection.weight"


@dataclass
class VisionGeometry:
    """Everything about a call's packed patches that depends only on ``grid_thw``."""

    window_index: torch.Tensor     # [N] long: packed order -> window order (a permutation)
    cu_windows: torch.Tensor       # [S_w+1] int32: window segments, in window order
    cu_frames: torch.Tensor        # [S_f+1] int32: one segment per frame (full-attention layers)
    positions: torch.Tensor        # [N, 2] long: (w + 1, h + 1) of each patch, in window order
    merge_index: torch.Tensor      # [N] long: packed order -> 2x2 merge-block order
    sizes: list[int]               # output rows per image: t*h*w / merge^2


def vision_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision tower, adapter and projection (transformers' names) and its shape."""
    v = config.vision_config
    D, inter, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    shapes = {TOWER + "patch_embedder.patch_embedding.weight": (D, v["patch_temporal"] * 3 * p * p),
              TOWER + "patch_embedder.position_embedding_table.weight": (v["pos_emb_height"] * v["pos_emb_width"], D),
              TOWER + "ln_pre.weight": (D,), TOWER + "ln_pre.bias": (D,),
              TOWER + "ln_post.weight": (D,), TOWER + "ln_post.bias": (D,)}
    for i in range(v["num_hidden_layers"]):
        q = f"{TOWER}layers.{i}."
        for norm in ("norm1", "norm2"):
            shapes.update({q + f"{norm}.weight": (D,), q + f"{norm}.bias": (D,)})
        for proj in ("q_proj", "k_proj", "v_proj", "proj"):
            shapes.update({q + f"attn.{proj}.weight": (D, D), q + f"attn.{proj}.bias": (D,)})
        shapes.update({q + "mlp.fc1.weight": (inter, D), q + "mlp.fc1.bias": (inter,),
                       q + "mlp.fc2.weight": (D, inter), q + "mlp.fc2.bias": (D,)})
    P = config.projector_hidden_size
    shapes.update({ADAPTER + "fc1.weight": (P, config.out_hidden_size), ADAPTER + "fc2.weight": (P, P),
                   PROJECTION: (config.hidden_size, P)})
    return shapes


def check_vision_config(config: Any) -> None:
    """What the tower needs of ``vision_config`` beyond transformers' own checks; ConfigError naming the field."""
    from musecore.config import ConfigError
    from musecore.towers import gelu_approximation
    v = config.vision_config
    D, heads = v["hidden_size"], v["num_attention_heads"]
    if D % heads or (D // heads) % 4:
        raise ConfigError("vision_config.num_attention_heads", f"must divide hidden_size ({D}) into heads whose "
                          "width is a multiple of 4 (axial 2-D RoPE)", heads)
    if v["pos_emb_height"] != v["pos_emb_width"]:
        raise ConfigError("vision_config.pos_emb_width", f"must equal pos_emb_height ({v['pos_emb_height']}), as "
                          "transformers assumes a square position table", v["pos_emb_width"])
    types = v["layer_types"]
    if len(types) != v["num_hidden_layers"] or set(types) - {"full_attention", "window_attention"}:
        raise ConfigError("vision_config.layer_types", f"must list {v['num_hidden_layers']} entries, each "
                          "'full_attention' or 'window_attention'", types)
    if v["rope_parameters"].get("rope_type", "axial") != "axial":
        raise ConfigError("vision_config.rope_parameters.rope_type", "must be 'axial'", v["rope_parameters"])
    if config.out_hidden_size != D * v["merge_size"] ** 2:
        raise ConfigError("out_hidden_size", f"must equal vision_config.hidden_size x merge_size^2 "
                          f"({D} x {v['merge_size']}^2 = {D * v['merge_size'] ** 2}): the merged patches feed the "
                          "vision adapter", config.out_hidden_size)
    gelu_approximation(v["hidden_act"], "vision_config.hidden_act")
    gelu_approximation(config.projector_hidden_act, "projector_hidden_act")


# A block's linears: (checkpoint module, weight attribute, bias attribute) of VisionLayer.
LAYER_LINEARS = (("attn.q_proj", "q_proj", "q_bias"), ("attn.k_proj", "k_proj", "k_bias"),
                 ("attn.v_proj", "v_proj", "v_bias"), ("attn.proj", "proj", "proj_bias"),
                 ("mlp.fc1", "fc1", "fc1_bias"), ("mlp.fc2", "fc2", "fc2_bias"))


class VisionLayer:
    """One pre-LN block: attention with q/k/v biases and 2-D RoPE, then a GELU MLP, each with a residual."""

    def __init__(self) -> None:
        self.norm1_weight = self.norm1_bias = self.norm2_weight = self.norm2_bias = None
        self.q_proj = self.k_proj = self.v_proj = self.proj = self.fc1 = self.fc2 = None  # Weights
        self.q_bias = self.k_bias = self.v_bias = self.proj_bias = self.fc1_bias = self.fc2_bias = None


class VisionTower:
    """``tower(pixel_values [P, 3*2*14*14], grid_thw [n,3]) -> [P/4, 4*D]`` (``MuseSparkVisionModel``),
    and ``features(...)`` -> ``[P/4, H]`` after the adapter, projection and norm (``get_image_features``)."""

    kind = VISION

    def __init__(self, config: Any, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        from musecore.towers import gelu_approximation
        check_vision_config(config)
        v = config.vision_config
        self.ops, self.dtype, self.device = ops, dtype, device
        self.hidden, self.heads = v["hidden_size"], v["num_attention_heads"]
        self.head_dim = self.hidden // self.heads
        self.patch, self.temporal, self.merge = v["patch_size"], v["patch_temporal"], v["merge_size"]
        self.side = v["pos_emb_height"]  # the table's side, and the window's side in patches (448 px / 14)
        self.eps, self.layer_types = v["layer_norm_eps"], list(v["layer_types"])
        self.act = gelu_approximation(v["hidden_act"], "vision_config.hidden_act")
        self.projector_act = gelu_approximation(config.projector_hidden_act, "projector_hidden_act")
        self.text_eps = config.rms_norm_eps
        theta = float(v["rope_parameters"].get("rope_theta", 10000.0))
        spatial = self.head_dim // 2  # each axis rotates half the head: d/4 frequencies, used twice
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.layers = [VisionLayer() for _ in range(v["num_hidden_layers"])]
        self.patch_embedding = self.position_table = None
        self.ln_pre_weight = self.ln_pre_bias = self.ln_post_weight = self.ln_post_bias = None
        self.adapter_fc1 = self.adapter_fc2 = self.projection = None

    @classmethod
    def linear_names(cls, config: Any) -> list[str]:
        """The checkpoint tensors this tower runs through ``linear`` (the plan asks backends about them)."""
        tower = cls(config, None, torch.bfloat16, torch.device("cpu"))
        return [name for name, (_owner, _attr, role) in tower.weights().items() if role == "linear"]

    @property
    def input_width(self) -> int:
        return 3 * self.temporal * self.patch * self.patch

    def weights(self) -> dict[str, tuple[Any, str, str]]:
        """Checkpoint tensor -> (owner, attribute, role) for the loader (roles as ``musecore.model.SLOT_ROLES``)."""
        out = {TOWER + "patch_embedder.patch_embedding.weight": (self, "patch_embedding", "linear"),
               TOWER + "patch_embedder.position_embedding_table.weight": (self, "position_table", "vector"),
               ADAPTER + "fc1.weight": (self, "adapter_fc1", "linear"),
               ADAPTER + "fc2.weight": (self, "adapter_fc2", "linear"),
               PROJECTION: (self, "projection", "linear")}
        for ln in ("ln_pre", "ln_post"):
            out[f"{TOWER}{ln}.weight"] = (self, f"{ln}_weight", "vector")
            out[f"{TOWER}{ln}.bias"] = (self, f"{ln}_bias", "vector")
        for i, layer in enumerate(self.layers):
            q = f"{TOWER}layers.{i}."
            for norm in ("norm1", "norm2"):
                out[f"{q}{norm}.weight"] = (layer, f"{norm}_weight", "vector")
                out[f"{q}{norm}.bias"] = (layer, f"{norm}_bias", "vector")
            for module, attr, bias in LAYER_LINEARS:
                out[f"{q}{module}.weight"] = (layer, attr, "linear")
                out[f"{q}{module}.bias"] = (layer, bias, "vector")
        return out

    # -- geometry -------------------------------------------------------------------------------------

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.input_width:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; the vision tower takes "
                             f"[patches, {self.input_width}] (3 x {self.temporal} frames x {self.patch}x{self.patch} "
                             "pixels per patch, as the image processor makes them)")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.dtype.is_floating_point:
            raise ValueError(f"grid_thw must be an integer tensor [images, 3] (t, h, w patches); got "
                             f"{grid_thw.dtype} {list(grid_thw.shape)}")
        for i, (t, h, w) in enumerate(grid_thw.tolist()):
            if min(t, h, w) < 1 or h % self.merge or w % self.merge:
                raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: t, h, w must be positive and h, w multiples of "
                                 f"merge_size {self.merge} (resize the image to a multiple of "
                                 f"{self.patch * self.merge} pixels, as the image processor does)")
        total = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thw describes {total} patches but pixel_values has {pixel_values.shape[0]} rows")

    def geometry(self, grid_thw: torch.Tensor) -> VisionGeometry:
        """Window order, segment boundaries, RoPE positions and the merge order of a call's patches."""
        W, m = self.side, self.merge
        window_index, windows, frames, positions, merge_index, sizes = [], [], [], [], [], []
        offset = 0
        for t, h, w in grid_thw.tolist():
            index = torch.arange(t * h * w).view(t, h, w)
            nh, nw = -(-h // W), -(-w // W)
            padded = F.pad(index, (0, nw * W - w, 0, nh * W - h), value=-1)  # whole windows; -1 outside the frame
            blocks = padded.view(t, nh, W, nw, W).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, W * W)
            windows += (blocks >= 0).sum(-1).tolist()  # patches per window, windows in row-major order per frame
            order = blocks[blocks >= 0]
            window_index.append(order + offset)
            frames += [h * w] * t
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).view(h * w, 2)
            positions.append(hw.flip(-1).repeat(t, 1) + 1)  # (w, h) order, offset by 1 as transformers does
            block = torch.arange(h * w).view(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)
            merge_index.append((block[None] + (torch.arange(t) * h * w)[:, None]).reshape(-1) + offset)
            sizes.append(t * h * w // (m * m))
            offset += t * h * w
        window_index = torch.cat(window_index)
        cu = lambda lengths: F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)  # noqa: E731
        dev = self.device
        return VisionGeometry(window_index.to(dev), cu(windows).to(dev), cu(frames).to(dev),
                              torch.cat(positions)[window_index].to(dev), torch.cat(merge_index).to(dev), sizes)

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The position table resampled to every grid (``[N, D]`` in packed order, model dtype).

        ``grid_sample`` (bilinear, ``align_corners=False``, zero padding) at the centre of each cell of
        a ``w x h`` grid, flattened over the frame's ``h x w`` patches: transformers reads the table at
        (w, h) (its reference passes ``meshgrid(pos_h, pos_w, indexing="xy")`` to ``grid_sample``)."""
        D, side = self.hidden, self.side
        table = self.position_table.float().view(side, side, D).permute(2, 0, 1)[None]  # [1,D,rows,cols]
        out, cached = [], {}
        for t, h, w in grid_thw.tolist():
            if (h, w) not in cached:
                xs = (2 * torch.arange(h, dtype=torch.float32, device=table.device) + 1) / h - 1
                ys = (2 * torch.arange(w, dtype=torch.float32, device=table.device) + 1) / w - 1
                grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1)[None]  # [1,w,h,2] of (x, y)
                sampled = F.grid_sample(table, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
                cached[(h, w)] = sampled[0].permute(1, 2, 0).reshape(h * w, D).to(self.dtype)
            out.append(cached[(h, w)].repeat(t, 1))
        return torch.cat(out)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Axial 2-D RoPE angles ``[N, d]``: the first position's frequencies, then the second's, twice;
        rounded to the model dtype (as transformers hands them to the rotation)."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [N,2,d/4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], -1)  # [N,d/2]
        angles = torch.cat([half, half], -1)  # [N,d]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    # -- the computation ------------------------------------------------------------------------------

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``MuseSparkVisionModel``'s ``last_hidden_state``: ``[P / merge^2, D * merge^2]``, merged patches
        of every image in order."""
        ops = self.ops
        grid_thw = torch.as_tensor(grid_thw).cpu()
        self.check_inputs(pixel_values, grid_thw)
        geo = self.geometry(grid_thw)
        x = ops.linear(pixel_values.to(self.device, self.dtype), self.patch_embedding)  # [N,D]
        x = x + self.position_embeddings(grid_thw)
        x = ops.layer_norm(x, self.ln_pre_weight, self.ln_pre_bias, self.eps)
        x = x[geo.window_index]  # window order for every layer: a window is one contiguous segment
        cos, sin = self.rotary(geo.positions)
        for layer, kind in zip(self.layers, self.layer_types):
            x = self.block(layer, x, cos, sin, geo.cu_frames if kind == "full_attention" else geo.cu_windows)
        x = x[torch.argsort(geo.window_index)]  # back to packed order
        x = ops.layer_norm(x, self.ln_post_weight, self.ln_post_bias, self.eps)
        m2 = self.merge * self.merge  # 2x2 pixel shuffle: [N,D] -> [N/4, D*4], channel-major
        return x[geo.merge_index].view(-1, m2, self.hidden).transpose(1, 2).reshape(-1, self.hidden * m2)

    def block(self, layer: VisionLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cu_seqlens: torch.Tensor) -> torch.Tensor:
        ops, N = self.ops, x.shape[0]
        a = ops.layer_norm(x, layer.norm1_weight, layer.norm1_bias, 1e-5)  # transformers fixes the blocks' eps
        q, k, v = (biased(ops, a, w, b).view(N, self.heads, self.head_dim)
                   for w, b in ((layer.q_proj, layer.q_bias), (layer.k_proj, layer.k_bias), (layer.v_proj, layer.v_bias)))
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ops.varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)  # [N,nh,d]
        x = x + biased(ops, o.reshape(N, self.hidden), layer.proj, layer.proj_bias)
        m = ops.layer_norm(x, layer.norm2_weight, layer.norm2_bias, 1e-5)
        h = ops.gelu(biased(ops, m, layer.fc1, layer.fc1_bias), self.act)
        return x + biased(ops, h, layer.fc2, layer.fc2_bias)

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """``get_image_features``: the tower, the adapter (fc1, GELU, fc2, GELU), the projection to the
        text width and the weightless ``perception_emb_norm``; one ``[t*h*w/4, H]`` tensor per image."""
        ops = self.ops
        grid_thw = torch.as_tensor(grid_thw).cpu()
        merged = self(pixel_values, grid_thw)  # [P/4, out_hidden_size]
        a = ops.gelu(ops.linear(ops.gelu(ops.linear(merged, self.adapter_fc1), self.projector_act), self.adapter_fc2),
                     self.projector_act)
        feats = ops.rms_norm(ops.linear(a, self.projection), None, self.text_eps)  # [P/4, H]
        sizes = (grid_thw.prod(-1) // (self.merge * self.merge)).tolist()
        return list(feats.split(sizes))


def biased(ops: Ops, x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``linear(x, W) + b``, the bias added in the activation dtype (the towers' linears have biases;
    the ``linear`` op has none)."""
    y = ops.linear(x, weight)
    return y if bias is None else y + bias
