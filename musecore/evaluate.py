"""End-to-end accuracy of a model against a baseline: perplexity, KL, top-1 agreement, logit error.

These are the columns of the accuracy matrix (``musecore matrix``) and what end-to-end tests
assert: a quantized or emulated model is judged by how far its next-token distributions move
from the BF16 reference on held-out text, not only by its own perplexity, which can hide errors
that happen to cancel. Logits are compared position by position, so both models must see the
same token windows (:func:`eval_batches`). The logits come from ``MuseModel.forward``, nothing else.

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

    def update(self, targets: torch.Tensor, logits: torch.Tensor, baseline: Optional[torch.Tensor] = None) -> None:
        """``targets [b,T]`` (the next token of each input position), ``logits``/``baseline`` ``[b,T,V]``."""
        logits = logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        self.nll += float(nll)
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
        self.agree += int((baseline.argmax(-1) == logits.argmax(-1)).sum())
        self.positions += kl.numel()
        self.max_abs = max(self.max_abs, float((logits - baseline).abs().max()))

    def result(self) -> Accuracy:
        if not self.predicted:
            raise ValueError("no tokens were evaluated")
        positions = max(self.positions, 1)
        return Accuracy(perplexity=math.exp(self.nll / self.predicted), kl=self.kl / positions,
                        top1_agreement=self.agree / positions, max_abs_logit_error=self.max_abs,
                        positions=self.positions, predicted_tokens=self.predicted)


def evaluate(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
             baseline: Optional[list[torch.Tensor]] = None) -> Accuracy:
    """``model``'s :class:`Accuracy` on ``batches`` (from :func:`eval_batches`), against ``baseline``'s
    logits on the same batches (None: perplexity only)."""
    meter = AccuracyMeter()
    for i, ((_, targets), logits) in enumerate(zip(batches, batched_logits(model, batches))):
        meter.update(targets, logits, None if baseline is None else baseline[i])
    return meter.result()
