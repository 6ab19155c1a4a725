"""How one input's hidden states become its embedding, per model: last token or mean, unit length."""

from __future__ import annotations

import json
import logging
from enum import Enum
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class Pooling(Enum):
    """How one input's hidden states become its embedding."""

    LAST = "last"
    """The last token's state: the only position a causal model lets read the whole input."""
    MEAN = "mean"
    """The mean of every position's state."""


POOLING_CONFIG = Path("1_Pooling") / "config.json"
"""sentence-transformers' pooling file in a model directory; its mode, when present, is used."""


def read_pooling(model_dir: Path) -> Pooling:
    """The model's pooling: sentence-transformers' `1_Pooling/config.json` names it (mean tokens or
    last token); without that file a causal LM pools its last token."""
    path = model_dir / POOLING_CONFIG
    if not path.is_file():
        return Pooling.LAST
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        log.warning("%s cannot be read as JSON: embeddings pool the last token", path)
        return Pooling.LAST
    if isinstance(config, dict) and config.get("pooling_mode_mean_tokens") is True:
        return Pooling.MEAN
    if isinstance(config, dict) and config.get("pooling_mode_lasttoken") is True:
        return Pooling.LAST
    log.warning("%s names no mean-tokens or last-token pooling: embeddings pool the last token", path)
    return Pooling.LAST


def pool(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One input's embedding from its hidden states [positions, hidden]: pooled, then scaled to
    unit length (float32). Accumulated in float64, so a long input's mean loses nothing."""
    states = np.asarray(hidden, dtype=np.float64)
    vector = states[-1] if pooling is Pooling.LAST else states.mean(axis=0)
    norm = float(np.linalg.norm(vector))
    unit: np.ndarray = (vector / norm if norm > 0 else vector).astype(np.float32)
    return unit
