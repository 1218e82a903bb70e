"""AutoRound on one routed expert at a time, mapped onto the canonical INT4 layout.

auto-round (Intel) tunes the rounding (and the group min/max) of every Linear of a *block* by
sign-gradient descent on the block's output error over captured inputs. It knows Hugging Face
decoder layers, not Muse experts, so we hand it a block of our own through its public
single-block API (``CompressionOrchestrator.quantize_block``, the entry point llm-compressor
uses, FORMATS.md): :class:`ExpertBlock` is one expert exactly as the MoE uses it (MODEL.md
section 1), ``routing_weight * InputScaledRMSNorm(down(silu(gate(z)) * up(z)), post_expert_norm)``
with the layer's one post-expert norm (shared by all experts, scale first), so the loss AutoRound
minimises is the expert's error as it enters the layer's weighted sum, on the pooled latents ``z``
that the router really sent to it. The norm makes the loss blind to a uniform rescaling of the
output, exactly as the model is.

After tuning, auto-round leaves each Linear's fake-quantized weight and its fp16 ``scale`` (and
``zp``); the codes are recovered exactly (``scale * q`` is exact in fp32 for fp16 scales and
|q| <= 8) and checked by dequantizing (:func:`canonical_int4_from_autoround`). auto-round's
symmetric grid is the one ``musecore_quant``'s INT4 RTN uses (full range, signed scales, code
``q + 8``), so iteration 0 of the tuning *is* our RTN and AutoRound keeps the best iteration.

Example::

    tuner = ExpertTuner(hidden=128, intermediate=256, post_eps=1e-8, options=AutoRoundOptions(iters=200))
    result = tuner.tune(gate, up, down, post_expert_norm, z, routing_weights)  # post_expert_norm: 1 + w
    result.qtensors["down_proj"]              # canonical int4 QTensor
    result.loss_autoround <= result.loss_rtn  # on these tokens, with the default full batch
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from musecore_quant import QTensor, quantize
from musecore_quant.formats.facts import block_size
from musecore_quant.formats.fp4 import pack_nibbles
from musecore_quant.formats.int4 import INT4_MAX_CODE, INT4_SYMMETRIC_ZERO, int4_dequantize

from musecore.names import EXPERT_PROJECTIONS

PROJECTIONS = EXPERT_PROJECTIONS  # one routed expert's SwiGLU, in order
TESTED_AUTO_ROUND = "0.16.1"
AUTO_ROUND_INT_MULTIPLE = 32  # auto-round leaves INT Linears with other dims unquantized
INSTALL_HINT = ("pip install 'auto-round==0.16.1' (or pip install -e '.[autoround]'); if pip wants another torch, "
                "install auto-round with --no-deps and add its pure-Python dependencies by hand")


def auto_round_version() -> Optional[str]:
    """The installed auto-round version, or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("auto-round")
    except PackageNotFoundError:
        return None


class AutoRoundMissing(ImportError):
    """auto-round is not installed (the message says how to install it)."""


def require_auto_round() -> None:
    """Import auto-round or raise :class:`AutoRoundMissing` (an ImportError) that says how to install it."""
    try:
        import auto_round  # noqa: F401
    except ImportError as e:
        raise AutoRoundMissing(f"AutoRound calibration needs the auto-round package ({e}); {INSTALL_HINT}") from e


@dataclass(frozen=True)
class AutoRoundOptions:
    """How each expert is tuned. Defaults follow auto-round (200 iterations, lr 1/iters, min/max
    tuning on) and the INT4 export (4 bits, group 128, symmetric).

    An expert's calibration tokens are cut into at most ``nsamples`` samples of
    ``tokens_per_sample`` tokens (so at most ``nsamples * tokens_per_sample`` tokens per expert);
    ``batch_size`` samples make one optimiser step (None: all of the expert's samples, i.e. full
    batch, which also makes "keep the best iteration" compare whole-set losses).
    """

    iters: int = 200
    nsamples: int = 128  # auto-round's default; 2048 tokens per expert generalise much better than 512
    tokens_per_sample: int = 16
    batch_size: Optional[int] = None
    group_size: int = block_size("int4")  # the INT4 export's group (128)
    sym: bool = True
    lr: Optional[float] = None
    seed: int = 42
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("iters", "nsamples", "tokens_per_sample", "group_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"AutoRoundOptions.{name} must be a positive int; got {getattr(self, name)!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size <= 0):
            raise ValueError(f"AutoRoundOptions.batch_size must be a positive int or None; got {self.batch_size!r}")

    @property
    def max_tokens(self) -> int:
        return self.nsamples * self.tokens_per_sample

    def as_dict(self) -> dict:
        return asdict(self)


class ExpertBlock(torch.nn.Module):
    """One routed expert as its MoE layer sees it (MODEL.md section 1), in fp32:
    ``routing_weight * rms(down(silu(gate(z)) * up(z)) * post_norm)``.

    ``post_norm`` is the layer's shared post-expert norm as the model holds it (``1 + w``), applied
    before normalising (transformers' ``InputScaledRMSNorm``) and before the routing weight."""

    def __init__(self, hidden: int, intermediate: int, post_eps: float) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("post_norm", torch.ones(hidden))
        self.post_eps = post_eps

    @torch.no_grad()
    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, post_norm: torch.Tensor) -> None:
        for linear, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
            if tuple(w.shape) != tuple(linear.weight.shape):
                raise ValueError(f"expert weight of shape {list(w.shape)} does not fit {list(linear.weight.shape)}")
            linear.weight.data.copy_(w.float())
        if tuple(post_norm.shape) != tuple(self.post_norm.shape):
            raise ValueError(f"post-expert norm of shape {list(post_norm.shape)} does not fit "
                             f"{list(self.post_norm.shape)}")
        self.post_norm.copy_(post_norm.float())

    def forward(self, hidden_states: torch.Tensor, routing_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        z = hidden_states.float()
        y = self.down_proj(F.silu(self.gate_proj(z)) * self.up_proj(z)) * self.post_norm  # [..., h], scale first
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.post_eps)               # then normalise
        return y if routing_weight is None else y * routing_weight.float()[..., None]


class _Decoder(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([block])


class _SingleBlockModel(torch.nn.Module):
    """The smallest model auto-round accepts: ``model.layers[0]`` is the block, a config without a
    hub name (so auto-round never tries to download anything)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        from transformers import PretrainedConfig
        self.model = _Decoder(block)
        self.config = PretrainedConfig(architectures=["MuseRoutedExpert"], model_type="muse_routed_expert")
        self.dtype = torch.float32

    def forward(self, *args, **kwargs):
        return self.model.layers[0](*args, **kwargs)


@dataclass
class ExpertResult:
    """One tuned expert: its three INT4 weights and the routed-output error before/after tuning."""

    qtensors: dict[str, QTensor]
    loss_rtn: float          # weighted MSE of the expert's routed output, RTN weights, on its tokens
    loss_autoround: float    # the same with the tuned weights
    tokens: int
    heldout_loss_rtn: Optional[float] = None        # the same two on routed tokens it was not tuned on
    heldout_loss_autoround: Optional[float] = None
    heldout_tokens: int = 0


def weighted_output_mse(block: ExpertBlock, weights: dict[str, torch.Tensor], z: torch.Tensor,
                        routing_weight: torch.Tensor, reference: torch.Tensor) -> float:
    """MSE between ``reference`` and the block's routed output with ``weights`` swapped in."""
    saved = {p: getattr(block, p).weight.data.clone() for p in PROJECTIONS}
    try:
        with torch.no_grad():
            for p in PROJECTIONS:
                getattr(block, p).weight.data.copy_(weights[p])
            out = block(z, routing_weight)
        return float(F.mse_loss(out, reference))
    finally:
        with torch.no_grad():
            for p in PROJECTIONS:
                getattr(block, p).weight.data.copy_(saved[p])


def canonical_int4_from_autoround(qdq_weight: torch.Tensor, scale: torch.Tensor, zero_point, group_size: int,
                                  sym: bool) -> QTensor:
    """The canonical INT4 QTensor of a Linear that auto-round has tuned.

    auto-round leaves ``weight = scale * q`` (fp32, ``q`` in -8..7 for symmetric; asymmetric:
    ``scale * (q - zp)`` with ``q`` in 0..15) and ``scale`` fp16 ``[out, in/g]``. Our codes are
    ``q + 8`` (symmetric) or ``q`` with zero ``zp``. Raises when the weights are not exactly on
    that grid (another auto-round version changing its conventions must not pass silently).
    """
    out_features, in_features = qdq_weight.shape
    groups = in_features // group_size
    if scale is None or tuple(scale.shape) != (out_features, groups):
        raise RuntimeError(f"auto-round left scale {None if scale is None else list(scale.shape)}; expected "
                           f"[{out_features}, {groups}] (group_size {group_size}); auto-round {auto_round_version()} "
                           f"may not match the tested {TESTED_AUTO_ROUND}")
    scale16 = scale.to(torch.float16)
    if not torch.equal(scale16.float(), scale.float()):
        raise RuntimeError("auto-round scales are not fp16 values; INT4 stores fp16 scales")
    w = qdq_weight.float().unflatten(-1, (groups, group_size))                    # [out, in/g, g]
    s = scale16.float().unsqueeze(-1)
    if sym:
        zero = torch.full((out_features, groups), INT4_SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        if not isinstance(zero_point, torch.Tensor):
            raise RuntimeError(f"asymmetric auto-round result without per-group zero points (zp={zero_point!r})")
        zero = zero_point.float().reshape(out_features, groups)
    codes = torch.round(w / s) + zero.unsqueeze(-1)
    if codes.min() < 0 or codes.max() > INT4_MAX_CODE:
        raise RuntimeError(f"auto-round codes fall outside 0..15 ({codes.min().item()}..{codes.max().item()})")
    qt = QTensor(format="int4", data=pack_nibbles(codes.to(torch.uint8).flatten(-2)), scale=scale16.contiguous(),
                 shape=(out_features, in_features), group_size=group_size,
                 zero=None if sym else zero.to(torch.uint8).contiguous())
    error = (int4_dequantize(qt) - qdq_weight.float()).abs().max().item()
    if error != 0.0:
        raise RuntimeError(f"canonical INT4 does not reproduce auto-round's weights (max |diff| {error:.3g})")
    return qt


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    logger = logging.getLogger("autoround")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """auto-round calls ``gc.collect()`` several times per block; with torch and transformers
    loaded that walks a large heap and costs more than tuning a small expert. Objects that exist
    before the call are moved out of the collector's sight meanwhile (``gc.freeze``), then back."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """auto-round draws batches from Python's ``random`` and initialises through torch's RNG:
    seed both for a reproducible expert, and give the caller its RNG states back."""
    state = random.getstate()
    with torch.random.fork_rng():
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(state)


def _compressor_for(block: torch.nn.Module, options: AutoRoundOptions):
    """One auto-round compressor around ``block`` (frozen), for its public ``quantize_block``."""
    for p in block.parameters():
        p.requires_grad_(False)
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.config import SignRoundConfig
    from auto_round.schemes import QuantizationScheme
    scheme = QuantizationScheme(bits=4, group_size=options.group_size, sym=options.sym, data_type="int",
                                act_bits=16)
    with _quiet(options.verbose), _seeded(options.seed):
        compressor = AutoRound(
            model=_SingleBlockModel(block), tokenizer="", scheme=scheme,  # "": no tokenizer (inputs are given)
            alg_configs=SignRoundConfig(iters=options.iters, lr=options.lr),
            nsamples=options.nsamples, seqlen=options.tokens_per_sample,
            batch_size=options.batch_size or options.nsamples,
            enable_torch_compile=False, device_map="cpu", amp=False, seed=options.seed)
        compressor.batch_dim = 0
    return compressor


class ExpertTuner:
    """Tunes experts of one shape with one auto-round compressor (built once: its set-up costs
    seconds, a tuning step milliseconds). Each expert is loaded into the same :class:`ExpertBlock`."""

    def __init__(self, hidden: int, intermediate: int, post_eps: float, options: AutoRoundOptions = AutoRoundOptions()):
        require_auto_round()
        for dim, what in ((hidden, "hidden (gate/up input)"), (intermediate, "intermediate (down input)")):
            if dim % options.group_size:
                raise ValueError(f"INT4 group_size {options.group_size} must divide the expert's {what} width {dim}; "
                                 "pass a group_size that divides both")
            if dim % AUTO_ROUND_INT_MULTIPLE:
                raise ValueError(f"auto-round keeps INT Linears whose dims are not multiples of "
                                 f"{AUTO_ROUND_INT_MULTIPLE} in 16 bits; the expert's {what} width is {dim}. "
                                 "Quantize this model with RTN (every Muse preset is a multiple of 128)")
        self.options = options
        self.block = ExpertBlock(hidden, intermediate, post_eps)
        self._compressor = _compressor_for(self.block, options)

    def samples(self, z: torch.Tensor, routing_weight: torch.Tensor) -> list:
        """auto-round's captured-input form: one ``((args, kwargs),)`` per sample of ``[1, S, h]``.

        auto-round concatenates samples, so all have ``S`` tokens: the last is padded with zero
        latents of routing weight 0, whose routed output is 0 with any weights (no loss, no gradient).
        """
        S = self.options.tokens_per_sample
        pad = -len(z) % S
        if pad:
            z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
            routing_weight = torch.cat([routing_weight, routing_weight.new_zeros(pad)])
        return [(((z[i:i + S][None],), {"routing_weight": routing_weight[i:i + S][None]}),)
                for i in range(0, len(z), S)]

    def tune(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, post_norm: torch.Tensor,
             z: torch.Tensor, routing_weight: torch.Tensor, seed: Optional[int] = None,
             heldout: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> ExpertResult:
        """Tune one expert (``gate``/``up`` ``[I, h]``, ``down`` ``[h, I]``) on its routed tokens ``z [n, h]``
        with routing weights ``[n]`` (n >= 1); ``post_norm`` is the layer's shared post-expert norm
        (``1 + w``). ``heldout`` (z, weights) of other routed tokens measures RTN and AutoRound off the
        tuning set."""
        if len(z) == 0:
            raise ValueError("an expert with no calibration tokens cannot be tuned; quantize it with RTN")
        z, routing_weight = z.float().contiguous(), routing_weight.float().contiguous()
        opts, block = self.options, self.block
        source = {"gate_proj": gate.float(), "up_proj": up.float(), "down_proj": down.float()}
        block.load(gate, up, down, post_norm)
        with torch.no_grad():
            reference = block(z, routing_weight)
        rtn = {p: quantize(w, "int4", group_size=opts.group_size, sym=opts.sym) for p, w in source.items()}
        loss_rtn = weighted_output_mse(block, {p: int4_dequantize(q) for p, q in rtn.items()}, z, routing_weight,
                                       reference)
        with _quiet(opts.verbose), _seeded(opts.seed if seed is None else seed), _frozen_heap(), torch.enable_grad():
            self._compressor.quantize_block(block=block, inputs=self.samples(z, routing_weight), q_input=None,
                                            device="cpu", auto_offload=False)
        qtensors = {}
        for p in PROJECTIONS:
            linear = getattr(block, p)
            qtensors[p] = canonical_int4_from_autoround(linear.weight.data, getattr(linear, "scale", None),
                                                        getattr(linear, "zp", None), opts.group_size, opts.sym)
            for attr in ("scale", "zp"):  # leave nothing of this expert on the shared block
                if hasattr(linear, attr):
                    delattr(linear, attr)
        tuned = {p: int4_dequantize(q) for p, q in qtensors.items()}
        block.load(source["gate_proj"], source["up_proj"], source["down_proj"], post_norm)
        loss_ar = weighted_output_mse(block, tuned, z, routing_weight, reference)
        result = ExpertResult(qtensors, loss_rtn, loss_ar, len(z))
        if heldout is not None and len(heldout[0]):
            hz, hw = heldout[0].float(), heldout[1].float()
            with torch.no_grad():
                href = block(hz, hw)
            result.heldout_loss_rtn = weighted_output_mse(block, {p: int4_dequantize(q) for p, q in rtn.items()},
                                                          hz, hw, href)
            result.heldout_loss_autoround = weighted_output_mse(block, tuned, hz, hw, href)
            result.heldout_tokens = len(hz)
        return result


class LinearBlock(torch.nn.Module):
    """One dense Linear (attention, pooler/unpooler, lm_head, dense MLP) as auto-round's block, fp32:
    the loss it minimises is the Linear's own output error on the inputs it really receives."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float())


@dataclass
class LinearResult:
    """One tuned dense Linear: its INT4 weight and its output MSE with RTN and with AutoRound, on the
    tuning rows and on rows it was not tuned on."""

    qtensor: QTensor
    loss_rtn: float
    loss_autoround: float
    tokens: int
    heldout_loss_rtn: Optional[float] = None
    heldout_loss_autoround: Optional[float] = None
    heldout_tokens: int = 0


class LinearTuner:
    """Tunes dense Linears of one shape ``[out, in]`` with one auto-round compressor (see ExpertTuner).

    Example::

        tuner = LinearTuner(256, 256, AutoRoundOptions(iters=200))
        result = tuner.tune(weight, x)            # x [n, in]: the inputs this Linear received
        result.loss_autoround <= result.loss_rtn
    """

    def __init__(self, in_features: int, out_features: int, options: AutoRoundOptions = AutoRoundOptions()):
        require_auto_round()
        for dim, what in ((in_features, "in_features"), (out_features, "out_features")):
            if dim % AUTO_ROUND_INT_MULTIPLE:
                raise ValueError(f"auto-round keeps INT Linears whose dims are not multiples of "
                                 f"{AUTO_ROUND_INT_MULTIPLE} in 16 bits; this Linear's {what} is {dim}. Quantize it "
                                 "with RTN")
        if in_features % options.group_size:
            raise ValueError(f"INT4 group_size {options.group_size} must divide in_features {in_features}")
        self.options = options
        self.block = LinearBlock(in_features, out_features)
        self._compressor = _compressor_for(self.block, options)

    def samples(self, x: torch.Tensor) -> list:
        """auto-round's captured-input form, ``tokens_per_sample`` rows each; the last is padded with
        zero rows, whose output is 0 with any weight (no loss, no gradient)."""
        S = self.options.tokens_per_sample
        pad = -len(x) % S
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return [(((x[i:i + S][None],), {}),) for i in range(0, len(x), S)]

    def _mse(self, weight: torch.Tensor, x: torch.Tensor, reference: torch.Tensor) -> float:
        return float(F.mse_loss(x @ weight.T, reference))

    def tune(self, weight: torch.Tensor, x: torch.Tensor, seed: Optional[int] = None,
             heldout: Optional[torch.Tensor] = None) -> LinearResult:
        """Tune ``weight [out, in]`` on its inputs ``x [n, in]`` (at most ``options.max_tokens`` rows are
        used); ``heldout [m, in]`` measures RTN and AutoRound on rows not tuned on."""
        if len(x) == 0:
            raise ValueError("a Linear with no calibration rows cannot be tuned; quantize it with RTN")
        opts = self.options
        weight, x = weight.float().contiguous(), x.float()[:opts.max_tokens].contiguous()
        with torch.no_grad():
            self.block.proj.weight.data.copy_(weight)
            reference = x @ weight.T
        rtn = quantize(weight, "int4", group_size=opts.group_size, sym=opts.sym)
        loss_rtn = self._mse(int4_dequantize(rtn), x, reference)
        with _quiet(opts.verbose), _seeded(opts.seed if seed is None else seed), _frozen_heap(), torch.enable_grad():
            self._compressor.quantize_block(block=self.block, inputs=self.samples(x), q_input=None,
                                            device="cpu", auto_offload=False)
        linear = self.block.proj
        qt = canonical_int4_from_autoround(linear.weight.data, getattr(linear, "scale", None),
                                           getattr(linear, "zp", None), opts.group_size, opts.sym)
        for attr in ("scale", "zp"):  # leave nothing of this Linear on the shared block
            if hasattr(linear, attr):
                delattr(linear, attr)
        tuned = int4_dequantize(qt)
        result = LinearResult(qt, loss_rtn, self._mse(tuned, x, reference), len(x))
        if heldout is not None and len(heldout):
            h = heldout.float()
            href = h @ weight.T
            result.heldout_loss_rtn = self._mse(int4_dequantize(rtn), h, href)
            result.heldout_loss_autoround = self._mse(tuned, h, href)
            result.heldout_tokens = len(h)
        return result


def rtn_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               options: AutoRoundOptions) -> dict[str, QTensor]:
    """Round-to-nearest INT4 of an expert (the fallback for one that received no calibration token)."""
    return {p: quantize(w.float(), "int4", group_size=options.group_size, sym=options.sym)
            for p, w in zip(PROJECTIONS, (gate, up, down))}


def relative_gain(loss_rtn: float, loss_autoround: float) -> float:
    """How much of RTN's routed-output error AutoRound removed (0.3 = 30 % less)."""
    return 0.0 if loss_rtn == 0 or math.isnan(loss_rtn) else 1.0 - loss_autoround / loss_rtn
