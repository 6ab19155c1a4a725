"""Log-probabilities of generated tokens and their most likely alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token id, logprob) of the most likely tokens, most likely first."""


def token_logprob(logits: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    """Log-probability of `token_id` under softmax(logits), with the `top_n` most likely tokens."""
    values = logits.astype(np.float64)
    peak = values.max()
    log_total = peak + np.log(np.exp(values - peak).sum())
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, values.shape[0])
        best = np.argpartition(values, values.shape[0] - n)[values.shape[0] - n :]
        best = best[np.lexsort((best, -values[best]))]
        top = tuple((int(i), float(values[i] - log_total)) for i in best)
    return TokenLogprob(token_id=token_id, logprob=float(values[token_id] - log_total), top=top)
