"""What logit_bias and the presence and frequency penalties cost per decode step, against no
controls, at batch 1 and 8, greedy and sampled.

Runs the engine's own `pick_tokens` on logits the width of the default model's vocabulary, for 256
steps per run: each step gets fresh random logits (copied in outside the timed part, since
sampling rewrites them) and every row observes its chosen token, so the penalties' history grows
to 256 tokens as in a real generation. "bias" is 300 biased tokens (the most a request may send),
"penalties" is presence 0.5 and frequency 0.5, "all" is both. Settings take turns within each
repetition (the order rotates); figures are medians over repetitions of the mean time per step, with the
time added to no controls and the median of the per-repetition ratios.

    python benchmarks/sampling_controls.py [--repetitions 5]
"""

from __future__ import annotations

import time

import benchkit
import numpy as np

from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.sampling.sampler import SequenceSampler, pick_tokens

STEPS = 256
BATCHES = (1, 8)
CONTROLS = ("none", "bias", "penalties", "all")
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


def _vocab_size() -> int:
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(benchkit.model_dir() / "tokenizer.json")).get_vocab_size())


def _params(control: str, mode: str, seed: int, vocab: int) -> SamplingParams:
    rng = np.random.default_rng(seed)
    bias: tuple[tuple[int, float], ...] = ()
    if control in ("bias", "all"):
        ids = np.sort(rng.choice(vocab, size=300, replace=False))
        bias = tuple((int(t), float(b)) for t, b in zip(ids, rng.uniform(-5, 5, 300), strict=True))
    penalty = 0.5 if control in ("penalties", "all") else 0.0
    return SamplingParams(
        seed=seed, logit_bias=bias, presence_penalty=penalty, frequency_penalty=penalty, **MODES[mode]
    )


def _ms_per_step(control: str, mode: str, batch: int, logits: np.ndarray) -> float:
    vocab = logits.shape[2]
    samplers = [SequenceSampler(_params(control, mode, row, vocab)) for row in range(batch)]
    work = np.empty((batch, vocab), dtype=np.float32)
    spent = 0.0
    for step in range(STEPS):
        np.copyto(work, logits[step, :batch])
        began = time.perf_counter()
        tokens = pick_tokens(work, samplers)
        for sampler, token in zip(samplers, tokens, strict=True):
            sampler.observe(token)
        spent += time.perf_counter() - began
    return spent / STEPS * 1000


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions
    vocab = _vocab_size()
    # Model-like logits: a few dozen favourites holding nearly all the mass above a broad, low
    # tail. (A flat tail would send top-p through a sort of the whole vocabulary every step and
    # measure that instead.)
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.5, (STEPS, max(BATCHES), vocab)).astype(np.float32)
    for step in range(STEPS):
        for row in range(max(BATCHES)):
            favourites = rng.choice(vocab, size=32, replace=False)
            logits[step, row, favourites] = rng.uniform(10.0, 16.0, 32)
    found: dict[str, list[float]] = {}
    for repetition in range(repetitions):
        benchkit.wait_for_quiet()
        order = CONTROLS[repetition % len(CONTROLS) :] + CONTROLS[: repetition % len(CONTROLS)]
        for mode in MODES:
            for batch in BATCHES:
                for control in order:
                    key = f"{mode}/{batch}/{control}"
                    found.setdefault(key, []).append(_ms_per_step(control, mode, batch, logits))
    rows = []
    for mode in MODES:
        for batch in BATCHES:
            baseline = found[f"{mode}/{batch}/none"]
            none = benchkit.median(baseline)
            cells: list[object] = [mode, batch, f"{none:.3f}"]
            for control in CONTROLS[1:]:
                timed = found[f"{mode}/{batch}/{control}"]
                ratios = [c / n for c, n in zip(timed, baseline, strict=True)]
                value = benchkit.median(timed)
                cells.append(f"{value:.3f} ({value - none:+.3f}, {benchkit.median(ratios):.2f}x)")
            rows.append(cells)
    print(
        f"\n## Sampling controls: ms per step in pick_tokens, vocabulary {vocab}, median of {repetitions}\n"
    )
    print(benchkit.markdown_table(["mode", "batch", "none", *CONTROLS[1:]], rows))
    path = benchkit.save_results("sampling_controls", {"vocab": vocab, "steps": STEPS, "ms_per_step": found})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
