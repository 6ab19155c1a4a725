"""Run a model once before serving it, so the first request does not pay for a cold runtime.

ONNX Runtime sets up kernels and memory arenas on a session's first runs; on the CPU the first
prefill of SmolLM2 took about three times as long as later ones. One short prefill and two
decode steps move that cost to start-up, where health still says NOT_SERVING.
"""

from __future__ import annotations

import logging
import time

from tokenwire.server.models.runner import ModelRunner

log = logging.getLogger(__name__)

WARMUP_SEQUENCE = -1
"""A sequence id no request uses (the engine numbers requests from 1)."""


def warm_up(runner: ModelRunner, *, prompt_tokens: int = 16, decode_steps: int = 2) -> float:
    """Prefill a short prompt and decode a few tokens, then free the slot; returns the seconds taken."""
    started = time.perf_counter()
    vocab = runner.info.vocab_size
    prompt = [token % vocab for token in range(1, prompt_tokens + 1)]
    try:
        logits = runner.prefill(WARMUP_SEQUENCE, prompt, start=0)
        for _ in range(decode_steps):
            logits = runner.decode([WARMUP_SEQUENCE], [int(logits.argmax())])[0]
    finally:
        runner.release(WARMUP_SEQUENCE)
    seconds = time.perf_counter() - started
    log.info("model %s warmed up in %.2fs", runner.info.name, seconds)
    return seconds
