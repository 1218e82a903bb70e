"""The cross-backend accuracy matrix: every target's numerics on one machine, against BF16.

One BF16 checkpoint is converted into each format a target ships (``musecore_quant.convert``,
cached), each row loads it as that device would (``musecore.load(ckpt, device, emulate=True)``:
the device's own weight conversion and activation quantization, bit for bit, on reference
kernels) and, where the device's backend is here, natively as well. Every row is judged on the
same held-out token windows against the BF16 reference: perplexity and its change, mean
KL(BF16 || row), top-1 agreement and the largest logit error, with paired block-bootstrap 95%
intervals for the perplexity change and the agreement (``musecore.evaluate.paired_bootstrap``).
``musecore matrix`` prints it and writes the Markdown table and PNG heatmap
(``docs/accuracy-matrix.md``). Everything it reads besides the checkpoint is package data
(``musecore/data/eval``), so it runs from an installed wheel.

Each technique has its row beside the one it improves on: load-time requantization by the
producer's rule (``MUSECORE_REQUANTIZATION=producer``) and by the least-error search (the
default), dense groups rounded to nearest at load and tuned by AutoRound in the checkpoint.
Converted checkpoints are cached under a key of the source's content and the calibration tokens,
so AutoRound (the slow part, minutes per checkpoint) runs once; :func:`cache_status` says up front
what is cached and what a run will have to build.

Example::

    from musecore.matrix import run_matrix
    report = run_matrix("muse-tiny", tokens=4096)
    for row in report.rows:
        print(row.device, row.format, row.mode, row.kl)
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from musecore_quant.formats.facts import producer_options

from musecore import compile_cache
from musecore.backends.registry import unavailable_reason
from musecore.devices import CATALOG
from musecore.evaluate import AccuracyMeter, batched_logits, eval_batches, evaluate, paired_bootstrap
from musecore.names import (EXPERT_PROJECTIONS, experts_prefix, fused_expert_name, per_expert_name,
                            quantized_expert_layers, quantized_expert_patterns)

# Held-out text shipped as package data: 22 standard-library files the bundled model never saw in
# training, 66,222 tokens (issue 28 asks for >= 64K); its manifest beside it says which files and why.
DEFAULT_EVAL_TEXT = Path(str(files("musecore") / "data" / "eval" / "stdlib_heldout_64k.jsonl.gz"))
RECIPE_VERSION = 3  # bump when a recipe changes, so cached checkpoints are rebuilt
BUILD_FILE = "matrix_build.json"  # how long a cached checkpoint took to build, written beside it
JSON_KEYS = ("device", "format", "mode", "perplexity", "delta_perplexity_pct", "delta_perplexity_pct_ci", "kl",
             "top1_agreement", "top1_agreement_ci", "max_abs_logit_error", "requantization", "status", "note")
DENSE_GROUPS = ("attention", "pooler/unpooler", "lm_head")  # what xeon6 quantizes at load by default
# The dense-AutoRound checkpoint tunes attention and pooler/unpooler; lm_head stays BF16 in it and xeon6
# rounds it at load. (Its first build also tuned lm_head, but convert's default exclude kept it out of the
# checkpoint; tuning it costs most of the build, so the recipe says what the cached checkpoint holds.)
AUTOROUND_DENSE_GROUPS = ("attention", "pooler/unpooler")
AUTOROUND_RECIPES = ("int4-autoround", "int4-autoround-dense")
GPTQ_RECIPES = ("int4-gptq", "int4-gptq-dense", "int4-gptq-attention", "mxfp4-gptq")
# GPTQ's Hessians want more rows than AutoRound's per-expert samples: all 14,407 tokens of the calibration
# modules, cut to 28 windows of 512 (the first 2,048 are the other recipes' calibration tokens).
GPTQ_CALIBRATION_TOKENS = 14336
METRICS = ("perplexity", "delta_perplexity_pct", "kl", "top1_agreement", "max_abs_logit_error")


@dataclass(frozen=True)
class RowSpec:
    """A target profile and the checkpoint it loads: ``id`` is what ``--rows`` selects."""

    device: str
    format: str        # as shown in the table and the JSON
    checkpoint: str    # key of RECIPES
    explanation: str   # what the device does with that checkpoint
    # passed to ``musecore.load``: False (most rows) converts only what the checkpoint quantized,
    # so the rows compare formats on the same weights; None is the device's own default; a tuple of
    # group names converts only those (a mixed plan: the others stay as the checkpoint has them)
    quantize_dense: Union[None, bool, tuple[str, ...]] = False
    # the load-time rule (MUSECORE_REQUANTIZATION): "producer" bytes or the "least-error" search
    requantization: str = "producer"

    @property
    def id(self) -> str:
        dense = ("" if self.quantize_dense is False else
                 "+" + "+".join(self.quantize_dense) if isinstance(self.quantize_dense, tuple) else "+dense")
        return f"{self.device}/{self.checkpoint}{dense}" + ("+least-error" if self.requantization == "least-error" else "")


ROWS: tuple[RowSpec, ...] = (
    RowSpec("cpu", "bf16", "bf16", "the reference: BF16 weights, fp32 math"),
    RowSpec("b300", "nvfp4 (W4A4)", "nvfp4", "NVFP4 experts and NVFP4 activations (calibrated static scales)"),
    RowSpec("h200", "nvfp4 (W4A16)", "nvfp4", "NVFP4 experts upcast in registers, BF16 activations"),
    RowSpec("h200-fp8", "fp8 W8A8 per token (requantized from nvfp4)", "nvfp4",
            "the throughput option: NVFP4 experts requantized to FP8 E4M3 at load (per-expert scale, ModelOpt rule), "
            "FP8 activations with a dynamic scale per token"),
    RowSpec("mi355x", "mxfp4 (requantized from nvfp4, EVEN)", "nvfp4",
            "the NVFP4 checkpoint requantized to MXFP4 at load by Quark's EVEN rule (producer parity); "
            "MXFP4 activations"),
    RowSpec("mi355x", "mxfp4 (requantized from nvfp4, least-error)", "nvfp4",
            "the same, each 32-block's E8M0 exponent searched (EVEN or EVEN-1) for the least error against "
            "the NVFP4 values it replaces (musecore's default)", requantization="least-error"),
    RowSpec("mi355x", "mxfp4 (from bf16, EVEN)", "mxfp4",
            "BF16 quantized straight to MXFP4 (Quark rule); MXFP4 activations"),
    RowSpec("mi355x", "mxfp4 (from bf16, least-error)", "mxfp4-least-error",
            "BF16 quantized straight to MXFP4, exponents searched for the least error; MXFP4 activations"),
    RowSpec("mi355x", "mxfp4 (GPTQ from bf16, fitted to MXFP4 activations)", "mxfp4-gptq",
            "experts rounded to MXFP4 (EVEN scales) by GPTQ, each on a Hessian of its routed inputs quantized to "
            "MXFP4 as the device quantizes them; MXFP4 activations"),
    RowSpec("mi300x", "mxfp4 W4A16 (from bf16, EVEN)", "mxfp4",
            "the mi355x EVEN checkpoint with 16-bit activations (gfx942 has no FP4 matrix cores): the same weights "
            "without activation quantization, to split the mi355x loss into weights and activations"),
    RowSpec("mi300x", "mxfp4 W4A16 (requantized from nvfp4, least-error)", "nvfp4",
            "the NVFP4 checkpoint requantized to MXFP4 at load (least-error), 16-bit activations: the mi355x "
            "requantized row without activation quantization", requantization="least-error"),
    RowSpec("xeon6", "int4 (RTN)", "int4-rtn",
            "INT4 g128 symmetric experts, round to nearest; BF16 activations and dense weights"),
    RowSpec("xeon6", "int4 (AutoRound)", "int4-autoround", "INT4 g128 symmetric experts with AutoRound-tuned rounding"),
    RowSpec("xeon6", "int4 (RTN) + dense INT4 RTN (default plan)", "int4-rtn",
            "the RTN checkpoint as xeon6 loads it by default: attention, pooler/unpooler and lm_head also "
            "quantized to INT4 g128 at load, round to nearest (producer rule)", quantize_dense=None),
    RowSpec("xeon6", "int4 (RTN) + dense INT4 least-error (default plan)", "int4-rtn",
            "the same, each dense group's scale searched at load for the least weight error (musecore's "
            "default rule)", quantize_dense=None, requantization="least-error"),
    RowSpec("xeon6", "int4 (AutoRound) + dense INT4 RTN (default plan)", "int4-autoround",
            "AutoRound experts; attention, pooler/unpooler and lm_head rounded to nearest at load",
            quantize_dense=None),
    RowSpec("xeon6", "int4 (AutoRound) + dense AutoRound (default plan)", "int4-autoround-dense",
            "AutoRound experts, and attention and pooler/unpooler tuned by AutoRound on their own inputs and stored "
            "INT4 in the checkpoint (xeon6 keeps them as they are); lm_head rounded to nearest at load",
            quantize_dense=None),
    RowSpec("xeon6", "int4 (GPTQ)", "int4-gptq",
            "INT4 g128 symmetric experts rounded by GPTQ (act-order, Hessians of the routed inputs weighted by "
            "routing weight / output RMS, layer by layer); BF16 activations and dense weights"),
    RowSpec("xeon6", "int4 (RTN) + dense GPTQ (default plan)", "int4-gptq-dense",
            "RTN experts, and attention, pooler/unpooler and lm_head rounded by GPTQ on the Hessians of their "
            "inputs in the BF16 model, stored INT4 in the checkpoint (xeon6 keeps them as they are)",
            quantize_dense=None),
    RowSpec("xeon6", "int4 (RTN) + attention GPTQ, lm_head INT4 least-error; pooler/unpooler BF16 (mixed plan)",
            "int4-gptq-attention", "a mixed plan: RTN experts and attention rounded by GPTQ in the checkpoint, lm_head "
            "quantized at load (least-error), pooler/unpooler kept BF16 (quantize_dense=('lm_head',))",
            quantize_dense=("lm_head",), requantization="least-error"),
    RowSpec("xeon6", "int4 (RTN) + lm_head INT4 least-error; attention, pooler/unpooler BF16 (mixed plan)",
            "int4-rtn", "a mixed plan: the RTN checkpoint with only lm_head quantized at load (least-error); "
            "attention and pooler/unpooler kept BF16 (quantize_dense=('lm_head',))",
            quantize_dense=("lm_head",), requantization="least-error"),
    RowSpec("tpu-v6e", "bf16", "bf16", "BF16 weights and activations"),
    RowSpec("tpu-v6e-int8", "int8 W8A8 per token (requantized from nvfp4)", "nvfp4",
            "the v6e throughput option: NVFP4 experts requantized to INT8 at load (one fp32 scale per output "
            "channel, amax/127), INT8 activations with a dynamic scale per token (amax/127)"),
)


@dataclass
class MatrixRow:
    """One row of the matrix; ``to_json`` gives exactly ``JSON_KEYS``."""

    device: str
    format: str
    mode: str                                  # emulated | native
    perplexity: Optional[float] = None
    delta_perplexity_pct: Optional[float] = None
    kl: Optional[float] = None
    top1_agreement: Optional[float] = None
    max_abs_logit_error: Optional[float] = None
    delta_perplexity_pct_ci: Optional[list[float]] = None  # 95% paired block-bootstrap interval [low, high]
    top1_agreement_ci: Optional[list[float]] = None
    requantization: str = "producer"
    status: str = "ok"                         # ok | unavailable | error
    note: str = ""
    row_id: str = ""
    weight_sqnr_db: Optional[float] = None     # in-memory quantized expert weights vs the BF16 source
    activation_sqnr_db: Optional[float] = None  # activation quantization on calibration samples (W4A4)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(getattr(self, k)) for k in JSON_KEYS}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class MatrixReport:
    model: str
    eval_source: str
    tokens: int
    seq_len: int
    rows: list[MatrixRow]
    op_results: dict[str, list[Any]] = field(default_factory=dict)  # backend -> [CaseResult]
    op_skipped: dict[str, str] = field(default_factory=dict)        # backend -> why it was not run
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    native_skipped: dict[str, str] = field(default_factory=dict)    # device -> why no native row
    seconds: float = 0.0

    def to_json(self) -> list[dict[str, Any]]:
        return [row.to_json() for row in self.rows]


# -- checkpoints ---------------------------------------------------------------------------------

def source_fingerprint(folder: Path, calibration: torch.Tensor) -> str:
    digest = hashlib.sha256(f"recipe-v{RECIPE_VERSION}".encode())
    for path in sorted(folder.iterdir()):
        if path.is_file() and (path.suffix == ".safetensors" or path.name == "config.json"):
            digest.update(path.name.encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    digest.update(calibration.numpy().tobytes())
    return digest.hexdigest()[:16]


def find_autoround() -> tuple[Optional[Callable], str]:
    """musecore's AutoRound converter (``musecore.calibrate.convert_autoround``) if this musecore has
    one, else why not: a row then says ``unavailable`` instead of showing a number it did not measure."""
    import importlib

    try:
        module = importlib.import_module("musecore.calibrate")
    except ModuleNotFoundError as err:
        if err.name != "musecore.calibrate":
            raise
        module = None
    if module is not None and hasattr(module, "convert_autoround"):
        return module.convert_autoround, ""
    return None, ("AutoRound needs a calibrated quantizer (musecore_quant.convert(method='autoround', "
                  "calibrated_quantizer=...)) and this musecore provides none (no musecore.calibrate.convert_autoround)")


class CheckpointCache:
    """Builds (once) and finds the converted checkpoints of one BF16 source under ``root``."""

    def __init__(self, source: Path, config: Any, root: Path, calibration: torch.Tensor, seq_len: int,
                 progress: bool, autoround_iters: int = 200, log: Optional[Callable[[str], None]] = None,
                 gptq_calibration: Optional[torch.Tensor] = None) -> None:
        self.source, self.config, self.progress = source, config, progress
        self.say = log or (lambda msg: None)
        self.calibration_stream, self.seq_len, self.autoround_iters = calibration, seq_len, autoround_iters
        # GPTQ's longer stream (GPTQ_CALIBRATION_TOKENS; its folder names carry the count)
        self.gptq_stream = calibration if gptq_calibration is None else gptq_calibration
        self.calibration = eval_batches(calibration, seq_len)
        key = source_fingerprint(source, calibration)
        self.root = Path(root) / f"{source.name}-{key}"
        self.info: dict[str, dict[str, Any]] = {"bf16": {"folder": str(source), "how": "the source checkpoint"}}
        self.stats: Any = None

    def folder(self, name: str) -> Path:
        return self.root / name

    def cached(self, name: str) -> bool:
        return (self.folder(name) / "config.json").is_file()

    def build_seconds(self, name: str) -> Optional[float]:
        """How long building ``name`` took when it was built (written beside it), or None."""
        path = self.folder(name) / BUILD_FILE
        return json.loads(path.read_text()).get("seconds") if path.is_file() else None

    def _convert(self, name: str, to: str, make: Optional[Callable[[Path], Any]] = None, how: str = "",
                 **options: Any) -> Path:
        from musecore_quant import convert
        dst = self.folder(name)
        built_now = not self.cached(name)
        if built_now:
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.say(f"checkpoint {name}: building (not cached)")
            started = time.perf_counter()
            if make is not None:
                make(dst)
            else:
                convert(self.source, dst, to=to, include=quantized_expert_patterns(self.config),
                        progress=self.progress, **options)
            (dst / BUILD_FILE).write_text(json.dumps({"seconds": time.perf_counter() - started}) + "\n")
        report = json.loads((dst / "conversion_report.json").read_text())
        summary = report.get("summary", {})
        seconds = self.build_seconds(name)
        self.say(f"checkpoint {name}: {'built' if built_now else 'cached'}"
                 + (f" (build took {seconds:.0f} s)" if seconds is not None else ""))
        self.info[name] = {"folder": str(dst), "how": how or f"musecore_quant.convert(to={to!r}, "
                           f"method={report.get('method')!r})", "min_sqnr_db": summary.get("min_sqnr_db"),
                           "mean_sqnr_db": summary.get("mean_sqnr_db"), "build_seconds": seconds,
                           "cached": not built_now}
        return dst

    def calibration_stats(self) -> Any:
        if self.stats is None:
            import musecore
            from musecore.calibrate import calibrate_expert_inputs
            bf16 = musecore.load(self.source, device="cpu", progress=False)
            self.stats = calibrate_expert_inputs(bf16, self.calibration)
        return self.stats

    def get(self, recipe: str) -> Path:
        """The folder of ``recipe``'s checkpoint; raises :class:`RowUnavailable` when it cannot exist."""
        if recipe == "bf16":
            return self.source
        if recipe == "mxfp4":
            return self._convert("mxfp4", "mxfp4")
        if recipe == "mxfp4-least-error":
            return self._convert("mxfp4-least-error", "mxfp4", quantize_options={"scale_mode": "mse"},
                                 how="musecore_quant.convert(to='mxfp4', quantize_options={'scale_mode': 'mse'}): "
                                 "exponents searched for the least error (the config still says EVEN: readers "
                                 "decode it the same)")
        if recipe == "int4-rtn":
            return self._convert("int4-rtn", "int4", quantize_options=producer_options("int4"))
        if recipe == "nvfp4":
            rtn = self._convert("nvfp4-weights", "nvfp4")
            dst = self.root / "nvfp4"
            if not (dst / "config.json").is_file():
                from musecore.calibrate import write_with_input_scales
                write_with_input_scales(rtn, dst, self.calibration_stats())
            self.info["nvfp4"] = {**self.info["nvfp4-weights"], "folder": str(dst),
                                  "how": self.info["nvfp4-weights"]["how"] + " + static activation scales "
                                  "(input_scale) calibrated on the calibration tokens"}
            return dst
        if recipe in AUTOROUND_RECIPES:
            convert_autoround, why = find_autoround()
            if convert_autoround is None:
                raise RowUnavailable(why)
            stream = self.calibration_stream
            seq_len = min(self.seq_len, stream.numel())
            extra: dict[str, Any] = {}
            how = "musecore.calibrate.convert_autoround: experts tuned"
            if recipe == "int4-autoround-dense":  # the experts are reused from the experts-only checkpoint
                extra = {"dense_groups": AUTOROUND_DENSE_GROUPS, "expert_checkpoint": self.get("int4-autoround")}
                how += (f" (reused from int4-autoround-i{self.autoround_iters}), and {', '.join(AUTOROUND_DENSE_GROUPS)} "
                        "tuned (lm_head BF16)")
            make = lambda dst: convert_autoround(self.source, dst, stream, tokens=stream.numel(),  # noqa: E731
                                                 seq_len=seq_len, progress=self.progress, iters=self.autoround_iters,
                                                 **extra)
            return self._convert(self.folder_name(recipe), "int4", make, how=how + f", {self.autoround_iters} iterations")
        if recipe in GPTQ_RECIPES:
            return self._gptq(recipe)
        raise ValueError(f"unknown checkpoint recipe {recipe!r}; known: bf16, nvfp4, mxfp4, mxfp4-least-error, int4-rtn, "
                         f"{', '.join(AUTOROUND_RECIPES + GPTQ_RECIPES)}")

    def _gptq(self, recipe: str) -> Path:
        from musecore.calibrate_gptq import convert_gptq
        stream = self.gptq_stream
        seq_len = min(self.seq_len, stream.numel())
        fmt = "mxfp4" if recipe == "mxfp4-gptq" else "int4"
        kwargs: dict[str, Any] = {"fmt": fmt}
        how = f"musecore.calibrate_gptq.convert_gptq: experts by GPTQ ({fmt}, act-order, damp 0.01"
        if recipe == "mxfp4-gptq":
            kwargs["act_format"] = "mxfp4"
            how += ", Hessians of MXFP4-quantized inputs"
        how += ")"
        if recipe in ("int4-gptq-dense", "int4-gptq-attention"):  # RTN experts: GPTQ's own row shows its experts
            groups = DENSE_GROUPS if recipe == "int4-gptq-dense" else ("attention",)
            kwargs.update(dense_groups=groups, experts="rtn")
            how = f"musecore.calibrate_gptq.convert_gptq: experts RTN, {', '.join(groups)} by GPTQ (act-order, damp 0.01)"
        make = lambda dst: convert_gptq(self.source, dst, stream, tokens=stream.numel(), seq_len=seq_len,  # noqa: E731
                                        progress=self.progress, **kwargs)
        return self._convert(self.folder_name(recipe), fmt, make,
                             how=how + f", on {self.gptq_tokens} calibration tokens")

    def folder_name(self, recipe: str) -> str:
        """The cache folder of ``recipe`` (AutoRound ones carry their iteration count)."""
        if recipe in AUTOROUND_RECIPES:
            return f"{recipe}-i{self.autoround_iters}"
        if recipe in GPTQ_RECIPES:
            return f"{recipe}-t{self.gptq_tokens}"
        return recipe

    @property
    def gptq_tokens(self) -> int:
        """The calibration tokens GPTQ recipes use: whole windows of the GPTQ stream."""
        seq_len = min(self.seq_len, self.gptq_stream.numel())
        return self.gptq_stream.numel() // seq_len * seq_len


def cache_status(cache: CheckpointCache, specs: Sequence[RowSpec]) -> list[str]:
    """One line per checkpoint the rows need: cached (and what building it cost), or to be built;
    AutoRound ones are the slow builds."""
    lines, needed = [], []
    for spec in specs:
        for recipe in (["int4-autoround"] if spec.checkpoint == "int4-autoround-dense" else []) + [spec.checkpoint]:
            if recipe != "bf16" and recipe not in needed:
                needed.append(recipe)
    for recipe in needed:
        name = cache.folder_name(recipe)
        if cache.cached(name):
            seconds = cache.build_seconds(name)
            lines.append(f"{name}: cached" + (f" (its build took {seconds:.0f} s)" if seconds is not None else ""))
        else:
            slow = (f" (AutoRound, {cache.autoround_iters} iterations per expert/Linear: the slow build, "
                    "minutes to tens of minutes on a small CPU)" if recipe in AUTOROUND_RECIPES else
                    " (GPTQ: about a minute on a small CPU)" if recipe in GPTQ_RECIPES else "")
            lines.append(f"{name}: to build{slow}")
    return lines


class RowUnavailable(RuntimeError):
    """A row cannot be measured here (its checkpoint or backend is missing); the row says why."""


# -- evaluation tokens -----------------------------------------------------------------------------

def load_eval_tokens(folder: Path, eval_text: Optional[Union[str, Path]], tokens: Optional[int],
                     vocab_size: int, random_tokens: bool = False, seed: int = 0) -> tuple[torch.Tensor, str]:
    """The evaluation stream and a description of where it came from.

    ``eval_text``: a ``.jsonl`` of ``{"text": ...}`` documents (each framed BOS + text + EOS, as the
    training run frames them) or a plain text file, either of them gzipped (``.jsonl.gz``, ``.txt.gz``);
    ``random_tokens`` for checkpoints without a tokenizer (development only: random tokens measure
    numerics, not language modelling). With ``tokens``, documents are encoded only until the stream
    has ``tokens + 1`` ids, so a short run does not pay for encoding the whole text.
    """
    if random_tokens:
        gen = torch.Generator().manual_seed(seed)
        n = tokens or 1024
        return torch.randint(0, vocab_size, (n,), generator=gen), f"{n} random token ids (seed {seed})"
    path = Path(eval_text) if eval_text is not None else DEFAULT_EVAL_TEXT
    if not path.is_file():
        raise FileNotFoundError(f"no evaluation text at {path}; pass --eval-text FILE (.jsonl of {{\"text\": ...}} "
                                "or plain text), or --random-tokens for a checkpoint without a tokenizer")
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json to encode {path.name}; pass --random-tokens")
    from musecore.tokenizer import load_tokenizer
    tok = load_tokenizer(folder)
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = list(tok.eos_ids[:1])
    ids: list[int] = []
    gzipped = path.suffix == ".gz"
    content = gzip.decompress(path.read_bytes()).decode("utf-8") if gzipped else path.read_text(encoding="utf-8")
    if (path.with_suffix("") if gzipped else path).suffix == ".jsonl":
        for line in content.splitlines():
            if tokens and len(ids) > tokens:
                break
            if line.strip():
                ids += bos + tok.encode(json.loads(line)["text"], add_special_tokens=False) + eos
    else:
        ids = bos + tok.encode(content, add_special_tokens=False)
    stream = torch.tensor(ids[: tokens + 1] if tokens else ids)
    return stream, f"{path.name}: {stream.numel()} tokens" + (f" (first {tokens} + 1)" if tokens else "")


# Calibration text: Python standard-library modules in the *held-out* split of muse-tiny's training
# corpus (training/corpus_manifest.tsv: never trained on) and not in the evaluation text. Fixed
# files, so the cache key (which hashes these tokens) does not move when musecore's code changes.
CALIBRATION_MODULES = ("copy.py", "getopt.py", "cProfile.py", "opcode.py", "unittest/runner.py")


def calibration_tokens(vocab_size: int, folder: Path, tokens: int = 2048, seed: int = 1) -> torch.Tensor:
    """Calibration ids, never the evaluation text: :data:`CALIBRATION_MODULES` from this Python's
    standard library when the model has a tokenizer (code, like the training corpus, but held out
    from it), else musecore's own sources, else random ids."""
    if (folder / "tokenizer.json").is_file():
        import sysconfig

        from musecore.tokenizer import load_tokenizer
        tok = load_tokenizer(folder)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        paths = [stdlib / name for name in CALIBRATION_MODULES]
        if not all(p.is_file() for p in paths):
            paths = sorted((Path(str(p)) for p in files("musecore").iterdir() if p.name.endswith(".py")),
                           key=lambda p: p.name)
        text = "\n".join(p.read_text(encoding="utf-8") for p in paths)
        ids = tok.encode(text, add_special_tokens=False)[:tokens]
        if len(ids) >= tokens // 2:
            return torch.tensor(ids)
    return torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))


# -- rows ------------------------------------------------------------------------------------------

def select_rows(selectors: Optional[Sequence[str]] = None) -> list[RowSpec]:
    """Rows by id (``mi355x/mxfp4``) or device (``xeon6``: all its rows); all rows when None."""
    if not selectors:
        return list(ROWS)
    chosen: list[RowSpec] = []
    for sel in selectors:
        found = [r for r in ROWS if sel in (r.id, r.device)]
        if not found:
            raise ValueError(f"unknown matrix row {sel!r}; choose row ids {[r.id for r in ROWS]} or devices "
                             f"{sorted({r.device for r in ROWS})}")
        chosen += [r for r in found if r not in chosen]
    return chosen


def native_backend_here(device: str, records: dict) -> Optional[str]:
    """The reason a native row is impossible, or None when the device's backend serves it here."""
    return unavailable_reason(records, CATALOG[device].backend, device)


def expert_weight_sqnr(model: Any, source: Path) -> Optional[float]:
    """SQNR (dB) of the model's in-memory quantized-layer expert weights against the BF16 source,
    over all of them; None when the backend's layout is not dense (native kernels)."""
    from musecore_quant.checkpoint import open_checkpoint
    config = model.config
    signal = noise = 0.0
    with open_checkpoint(source) as reader:
        names = set(reader.weight_names())
        for i in quantized_expert_layers(config):
            experts, prefix = model.layers[i].mlp.experts, experts_prefix(i)
            gate_up_name, down_name = fused_expert_name(prefix, "gate"), fused_expert_name(prefix, "down")
            if gate_up_name in names:  # transformers' fused layout
                gate_up = reader.read(gate_up_name).double()
                half = gate_up.shape[1] // 2
                refs = {"gate": gate_up[:, :half], "up": gate_up[:, half:], "down": reader.read(down_name)}
            else:  # a producer's per-expert keys
                refs = {proj.removesuffix("_proj"): torch.stack([reader.read(per_expert_name(prefix, e, proj))
                                                                 for e in range(config.num_local_experts)])
                        for proj in EXPERT_PROJECTIONS}
            for proj, stack in (("gate", experts.gate), ("up", experts.up), ("down", experts.down)):
                if not isinstance(stack, torch.Tensor):
                    return None
                ref = refs[proj].double()
                signal += float((ref ** 2).sum())
                noise += float(((stack.double().cpu() - ref) ** 2).sum())
    if noise == 0.0:
        return math.inf
    return 10 * math.log10(signal / noise)


def _row(spec: RowSpec, mode: str, status: str = "ok", note: str = "") -> MatrixRow:
    return MatrixRow(spec.device, spec.format, mode, status=status, note=note, row_id=spec.id)


@contextlib.contextmanager
def requantization_rule(rule: str):
    """``MUSECORE_REQUANTIZATION`` set to ``rule`` while a row loads (how a user selects it), then restored."""
    saved = os.environ.get("MUSECORE_REQUANTIZATION")
    os.environ["MUSECORE_REQUANTIZATION"] = rule
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MUSECORE_REQUANTIZATION", None)
        else:
            os.environ["MUSECORE_REQUANTIZATION"] = saved


def measure_row(spec: RowSpec, mode: str, cache: CheckpointCache, batches: list, baseline: list,
                bf16_perplexity: float, bf16_nll: Optional[torch.Tensor] = None) -> MatrixRow:
    """Load ``spec``'s checkpoint on its device (emulated or native) and measure it against ``baseline``
    (``bf16_nll``: the baseline's per-token NLL, for the paired bootstrap intervals)."""
    import musecore
    from musecore.planning import PlanError

    started = time.perf_counter()
    row = _row(spec, mode, note=spec.explanation)
    row.requantization = spec.requantization
    from musecore.autoround import AutoRoundMissing

    try:
        folder = cache.get(spec.checkpoint)
    except (RowUnavailable, NotImplementedError, AutoRoundMissing) as err:
        return _row(spec, mode, "unavailable", str(err))
    try:
        with requantization_rule(spec.requantization):
            model = musecore.load(folder, device=spec.device, emulate=(mode == "emulated"), progress=False,
                                  quantize_dense=spec.quantize_dense)
    except PlanError as err:
        return _row(spec, mode, "unavailable", str(err).replace("\n", " "))
    meter = AccuracyMeter()
    acc = evaluate(model, batches, baseline, meter=meter)
    if bf16_nll is not None:
        nll, agree = meter.per_token()
        ci = paired_bootstrap(nll, bf16_nll, agree)
        row.delta_perplexity_pct_ci = [ci["delta_perplexity_pct"].low, ci["delta_perplexity_pct"].high]
        row.top1_agreement_ci = [ci["top1_agreement"].low, ci["top1_agreement"].high]
    row.perplexity, row.kl, row.top1_agreement = acc.perplexity, acc.kl, acc.top1_agreement
    row.max_abs_logit_error = acc.max_abs_logit_error
    row.delta_perplexity_pct = 100.0 * (acc.perplexity / bf16_perplexity - 1.0)
    if spec.checkpoint != "bf16" or CATALOG[spec.device].conversion("bf16").target != "bf16":
        row.weight_sqnr_db = expert_weight_sqnr(model, cache.source)
    act = model.plan.profile.conversion(model.plan.checkpoint_format).act_format
    if act in ("nvfp4", "mxfp4") and mode == "emulated":
        from musecore.calibrate import activation_sqnr_db
        row.activation_sqnr_db = activation_sqnr_db(cache.calibration_stats(), act,
                                                    quantized_expert_layers(model.config))
    row.seconds = time.perf_counter() - started
    return row


# -- the whole matrix ------------------------------------------------------------------------------

def op_conformance(sizes: Sequence[str], records: dict, progress: bool = False
                   ) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """The conformance suite on every backend installed and available here (per-op NMSE table)."""
    from musecore.testing import run_conformance
    results, skipped = {}, {}
    for name, record in sorted(records.items()):
        why = unavailable_reason(records, name)
        if why is not None:
            skipped[name] = why
        else:
            results[name] = run_conformance(record.backend_class(), sizes=sizes, progress=progress)
    return results, skipped


def run_matrix(model: Union[str, Path] = "muse-tiny", *, rows: Optional[Sequence[str]] = None,
               tokens: Optional[int] = None, seq_len: int = 512, batch_size: int = 8,
               eval_text: Optional[Union[str, Path]] = None, random_tokens: bool = False,
               cache_dir: Optional[Union[str, Path]] = None, native: bool = True,
               op_sizes: Sequence[str] = ("tiny",), autoround_iters: int = 200, progress: bool = False,
               log: Optional[Callable[[str], None]] = None) -> MatrixReport:
    """Measure every selected row (see the module doc) on the BF16 checkpoint ``model``.

    ``tokens`` caps the evaluation tokens; ``seq_len`` is the window; ``cache_dir`` holds the
    converted checkpoints (default ``matrix/`` under :func:`musecore.compile_cache.root`: ``$MUSECORE_CACHE``, else
    ``$XDG_CACHE_HOME/musecore``, else ``~/.cache/musecore``); ``native=False`` skips native
    rows; ``op_sizes`` are the conformance sizes of the per-op table (``()`` skips it);
    ``autoround_iters`` the tuning steps per expert of the AutoRound row (auto-round's default 200).
    """
    import musecore
    from musecore.api import resolve_model, summarize
    from musecore.backends.registry import discover

    say = log or (lambda msg: None)
    started = time.perf_counter()
    name, folder = resolve_model(model)
    if folder is None:
        raise FileNotFoundError(f"{model!r} is a preset without weights; the matrix needs a BF16 checkpoint folder")
    summary, _ = summarize(folder)
    if summary.format != "bf16":
        raise ValueError(f"{folder} is a {summary.format} checkpoint; the matrix converts from BF16, so pass the "
                         "BF16 checkpoint (musecore-quant convert SRC DST --to bf16 makes one)")
    specs = select_rows(rows)
    config = summary.config
    stream, source = load_eval_tokens(folder, eval_text, tokens, config.vocab_size, random_tokens)
    batches = eval_batches(stream, seq_len, batch_size)
    calibration = calibration_tokens(config.vocab_size, folder, seed=1)
    gptq_calibration = (calibration_tokens(config.vocab_size, folder, tokens=GPTQ_CALIBRATION_TOKENS, seed=1)
                        if any(s.checkpoint in GPTQ_RECIPES for s in specs) else None)
    cache_dir = Path(cache_dir) if cache_dir else compile_cache.root() / "matrix"
    cache = CheckpointCache(folder, config, cache_dir, calibration, seq_len,
                            progress, autoround_iters, log=say, gptq_calibration=gptq_calibration)
    records = discover()

    say(f"{len(specs)} rows; converted checkpoints under {cache.root}:")
    for line in cache_status(cache, specs):
        say(f"  {line}")
    say(f"baseline: {name} BF16 on the reference backend, {source}")
    reference = musecore.load(folder, device="cpu", progress=False)
    baseline = list(batched_logits(reference, batches))
    del reference
    meter = AccuracyMeter()  # the reference against itself: KL 0, agreement 1, by construction
    for (_, targets), logits in zip(batches, baseline):
        meter.update(targets, logits, logits)
    bf16 = meter.result()
    bf16_nll, _ = meter.per_token()
    out: list[MatrixRow] = []
    native_skipped: dict[str, str] = {}
    for spec in specs:
        modes = ["native"] if CATALOG[spec.device].backend == "reference" else ["emulated"]
        why_not = native_backend_here(spec.device, records) if native and "emulated" in modes else None
        if native and "emulated" in modes and why_not is None:
            modes.append("native")
        elif why_not:
            native_skipped[spec.device] = why_not
        for mode in modes:
            say(f"row {spec.id} ({mode}): loading and evaluating")
            if spec.id == "cpu/bf16":
                row = _row(spec, mode, note=spec.explanation)
                row.perplexity, row.delta_perplexity_pct, row.kl = bf16.perplexity, 0.0, bf16.kl
                row.top1_agreement, row.max_abs_logit_error = bf16.top1_agreement, bf16.max_abs_logit_error
            else:
                row = measure_row(spec, mode, cache, batches, baseline, bf16.perplexity, bf16_nll)
            if row.status == "ok":
                ci = row.delta_perplexity_pct_ci
                say(f"row {spec.id} ({mode}): perplexity {row.perplexity:.3f} ({row.delta_perplexity_pct:+.2f}%"
                    + (f", 95% [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + f"), top-1 {row.top1_agreement:.4f}"
                    f" in {row.seconds:.0f} s")
            else:
                say(f"row {spec.id} ({mode}): {row.status}: {row.note}")
            out.append(row)
    if op_sizes:
        say(f"per-op conformance suite on the backends here ({', '.join(op_sizes)} shapes)")
    op_results, op_skipped = op_conformance(op_sizes, records, progress) if op_sizes else ({}, {})
    return MatrixReport(name, source, int(sum(t.numel() for _, t in batches)), seq_len, out, op_results,
                        op_skipped, cache.info, native_skipped, time.perf_counter() - started)
