"""End-to-end accuracy of a model against a baseline: perplexity, KL, top-1 agreement, logit error.

These are the columns of the accuracy matrix (``musecore matrix``) and what end-to-end tests
assert: a quantized or emulated model is judged by how far its next-token distributions move
from the BF16 reference on held-out text, not only by its own perplexity, which can hide errors
that happen to cancel. Logits are compared position by position, so both models must see the
same token windows (:func:`eval_batches`). The logits come from ``MuseModel.forward``, nothing else.

Per-position values are kept (a few floats per token), so a row's change against the baseline
gets a paired block-bootstrap interval (:func:`paired_bootstrap`): on a few thousand tokens a
0.3% perplexity difference is noise, and the interval says so.

Example::

    from musecore.evaluate import eval_batches, evaluate
    batches = eval_batches(ids, seq_len=512)
    print(evaluate(model, batches, baseline=None).perplexity)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F


def eval_batches(stream: torch.Tensor, seq_len: int, batch_size: int = 8
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs [b,T], targets [b,T])`` batches predicting every token of ``stream`` but the first.

    Windows of ``seq_len`` inputs step by ``seq_len`` and overlap their targets by one token, as the
    training run's evaluation does (so the BF16 perplexity here is the one it reports); a shorter
    last window is a batch of its own.
    """
    stream = stream.reshape(-1).long()
    n = stream.numel() - 1
    if n < 1:
        raise ValueError(f"need at least 2 evaluation tokens to predict one; got {stream.numel()}")
    starts = list(range(0, n, seq_len))
    full = [s for s in starts if s + seq_len <= n]
    batches = []
    for i in range(0, len(full), batch_size):
        idx = torch.tensor(full[i:i + batch_size])[:, None] + torch.arange(seq_len + 1)
        chunk = stream[idx]
        batches.append((chunk[:, :-1], chunk[:, 1:]))
    for s in starts[len(full):]:
        chunk = stream[s:n + 1][None]
        batches.append((chunk[:, :-1], chunk[:, 1:]))
    return batches


def batched_logits(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """``model.forward`` on each batch's inputs, as fp32 CPU logits ``[b, T, V]``."""
    with torch.inference_mode():
        for inputs, _ in batches:
            yield model.forward(inputs).float().cpu()


@dataclass
class Accuracy:
    """One model's numbers against a baseline over the same windows (see the module doc)."""

    perplexity: float
    kl: float                     # mean over positions of KL(baseline || model), nats
    top1_agreement: float         # fraction of positions where both argmax agree
    max_abs_logit_error: float
    positions: int
    predicted_tokens: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class AccuracyMeter:
    """Accumulates :class:`Accuracy` batch by batch, so no model's full logits must be kept.

    Example::

        meter = AccuracyMeter()
        for (inputs, targets), logits, base in zip(batches, batched_logits(model, batches), baseline):
            meter.update(targets, logits, base)
        print(meter.result())
    """

    def __init__(self) -> None:
        self.nll = 0.0
        self.predicted = 0
        self.kl = 0.0
        self.agree = 0
        self.positions = 0
        self.max_abs = 0.0
        self.token_nll: list[torch.Tensor] = []     # per predicted token, in stream order (float64)
        self.token_agree: list[torch.Tensor] = []   # per position against the baseline (bool)

    def update(self, targets: torch.Tensor, logits: torch.Tensor, baseline: Optional[torch.Tensor] = None) -> None:
        """``targets [b,T]`` (the next token of each input position), ``logits``/``baseline`` ``[b,T,V]``."""
        logits = logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        self.nll += float(nll.double().sum())
        self.token_nll.append(nll.double())
        self.predicted += targets.numel()
        if baseline is None:
            return
        baseline = baseline.float()
        if baseline.shape != logits.shape:
            raise ValueError(f"baseline logits {list(baseline.shape)} and model logits {list(logits.shape)} differ "
                             "in shape; evaluate both on the same windows")
        base_logp, logp = F.log_softmax(baseline, -1), F.log_softmax(logits, -1)
        kl = (base_logp.exp() * (base_logp - logp)).sum(-1)  # [b,T]
        self.kl += float(kl.double().sum())
        agree = (baseline.argmax(-1) == logits.argmax(-1)).reshape(-1)
        self.agree += int(agree.sum())
        self.token_agree.append(agree)
        self.positions += kl.numel()
        self.max_abs = max(self.max_abs, float((logits - baseline).abs().max()))

    def per_token(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(NLL per predicted token, top-1 agreement per position or None without a baseline)."""
        nll = torch.cat(self.token_nll) if self.token_nll else torch.zeros(0, dtype=torch.float64)
        return nll, (torch.cat(self.token_agree) if self.token_agree else None)

    def result(self) -> Accuracy:
        if not self.predicted:
            raise ValueError("no tokens were evaluated")
        positions = max(self.positions, 1)
        return Accuracy(perplexity=math.exp(self.nll / self.predicted), kl=self.kl / positions,
                        top1_agreement=self.agree / positions, max_abs_logit_error=self.max_abs,
                        positions=self.positions, predicted_tokens=self.predicted)


def evaluate(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
             baseline: Optional[list[torch.Tensor]] = None, meter: Optional[AccuracyMeter] = None) -> Accuracy:
    """``model``'s :class:`Accuracy` on ``batches`` (from :func:`eval_batches`), against ``baseline``'s
    logits on the same batches (None: perplexity only). Pass ``meter`` to keep its per-token values."""
    meter = AccuracyMeter() if meter is None else meter
    for i, ((_, targets), logits) in enumerate(zip(batches, batched_logits(model, batches))):
        meter.update(targets, logits, None if baseline is None else baseline[i])
    return meter.result()


@dataclass
class Interval:
    """A statistic and its bootstrap percentile interval."""

    value: float
    low: float
    high: float
    level: float = 0.95


def paired_bootstrap(row_nll: torch.Tensor, base_nll: torch.Tensor, agree: Optional[torch.Tensor] = None, *,
                     block: int = 128, resamples: int = 2000, level: float = 0.95, seed: int = 0
                     ) -> dict[str, Interval]:
    """Intervals for a row's perplexity change against the baseline (``delta_perplexity_pct``) and
    its top-1 agreement, by a paired moving-block bootstrap over the token stream.

    Neighbouring tokens are not independent (one hard file makes many hard tokens), so the stream
    is cut into ``block``-token blocks (fewer tokens when that would leave under 16 blocks) and
    whole blocks are resampled with replacement; both models
    are scored on the same resample (paired), which is what makes a small difference measurable.

    Example::

        ci = paired_bootstrap(row_nll, bf16_nll, agree)
        ci["delta_perplexity_pct"].low, ci["delta_perplexity_pct"].high
    """
    if row_nll.shape != base_nll.shape:
        raise ValueError(f"paired bootstrap needs both models' NLL on the same tokens; got {list(row_nll.shape)} "
                         f"and {list(base_nll.shape)}")
    n = row_nll.numel()
    block = max(1, min(block, n // 16))  # at least 16 blocks on a short stream
    starts = torch.arange(0, n, block)
    blocks = len(starts)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, blocks, (resamples, blocks), generator=gen)
    counts = torch.diff(torch.cat([starts, torch.tensor([n])])).double()[pick].sum(-1)  # the last block may be short

    def resampled_sums(x: torch.Tensor) -> torch.Tensor:
        per_block = torch.zeros(blocks, dtype=torch.float64).index_add_(
            0, torch.arange(n) // block, x.reshape(-1).double())
        return per_block[pick].sum(-1)

    delta = 100.0 * (torch.exp((resampled_sums(row_nll) - resampled_sums(base_nll)) / counts) - 1.0)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    point = 100.0 * (math.exp(float(row_nll.double().sum() - base_nll.double().sum()) / n) - 1.0)
    low, high = torch.quantile(delta, q).tolist()
    out = {"delta_perplexity_pct": Interval(point, low, high, level)}
    if agree is not None:
        share = resampled_sums(agree.double()) / counts
        low, high = torch.quantile(share, q).tolist()
        out["top1_agreement"] = Interval(float(agree.double().mean()), low, high, level)
    return out
