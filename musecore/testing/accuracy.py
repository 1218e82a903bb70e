"""End-to-end accuracy of a model against a baseline: perplexity, KL, top-1 agreement, logit error.

These are the columns of the accuracy matrix (``musecore matrix``) and what end-to-end tests
assert: a quantized or emulated model is judged by how far its next-token distributions move
from the BF16 reference on held-out text, not only by its own perplexity, which can hide errors
that happen to cancel. Logits are compared position by position, so both models must see the
same token windows (:func:`token_windows`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F


def token_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D token stream into ``[N, seq_len]`` windows (the last partial window is dropped,
    unless the stream is shorter than one window, which then becomes the only window)."""
    tokens = tokens.reshape(-1).long()
    if tokens.numel() < 2:
        raise ValueError(f"need at least 2 evaluation tokens to predict one; got {tokens.numel()}")
    if tokens.numel() <= seq_len:
        return tokens[None]
    n = tokens.numel() // seq_len
    return tokens[: n * seq_len].view(n, seq_len)


def batched_logits(model: Any, windows: torch.Tensor, batch_size: int = 8) -> Iterator[torch.Tensor]:
    """``model.forward`` over ``windows`` in batches, as fp32 CPU logits ``[b, T, V]``."""
    with torch.inference_mode():
        for start in range(0, windows.shape[0], batch_size):
            yield model.forward(windows[start:start + batch_size]).float().cpu()


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
        for base, logits, window in zip(baseline_batches, model_batches, windows_batches):
            meter.update(window, logits, base)
        print(meter.result())
    """

    def __init__(self) -> None:
        self.nll = 0.0
        self.predicted = 0
        self.kl = 0.0
        self.agree = 0
        self.positions = 0
        self.max_abs = 0.0

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, baseline: Optional[torch.Tensor] = None) -> None:
        """``tokens [b,T]``, ``logits`` and ``baseline`` ``[b,T,V]``; position t predicts token t+1."""
        logits = logits.float()
        if tokens.shape[1] > 1:
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                  reduction="sum")
            self.nll += float(nll)
            self.predicted += tokens[:, 1:].numel()
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
            raise ValueError("no predicted tokens were evaluated (windows of one token?)")
        positions = max(self.positions, 1)
        return Accuracy(perplexity=math.exp(self.nll / self.predicted), kl=self.kl / positions,
                        top1_agreement=self.agree / positions, max_abs_logit_error=self.max_abs,
                        positions=self.positions, predicted_tokens=self.predicted)
