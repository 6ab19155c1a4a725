"""Running a round's planned embedding jobs on the runner (the core's, on the engine thread).

Every input of the round's jobs is run in passes of at most a decode batch's rows, sorted by
length so little padding is run; each input's hidden states are pooled (models/pooling.py) and
each job is handed its vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenwire.server.engine.embedding import EmbeddingJob, EmbeddingResult
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.models.pooling import Pooling, pool
from tokenwire.server.models.runner import HiddenStates


def run_embeddings(
    runner: HiddenStates, jobs: Sequence[EmbeddingJob], *, pooling: Pooling, max_rows: int
) -> None:
    """Embed every input of `jobs`, at most `max_rows` inputs per model call, and deliver each
    job's vectors; should a call fail, every job of the round hears the error."""
    flat = [(index, row) for index, job in enumerate(jobs) for row in range(len(job.request.inputs))]
    flat.sort(key=lambda item: len(jobs[item[0]].request.inputs[item[1]]))
    vectors: list[list[np.ndarray | None]] = [[None] * len(job.request.inputs) for job in jobs]
    try:
        for start in range(0, len(flat), max(1, max_rows)):
            batch = flat[start : start + max(1, max_rows)]
            states = runner.hidden_states([jobs[index].request.inputs[row] for index, row in batch])
            for (index, row), hidden in zip(batch, states, strict=True):
                vectors[index][row] = pool(hidden, pooling)
    except Exception as error:  # a failed model call fails this round's embeddings, nothing else
        failure = GenerationError(ErrorKind.INTERNAL, f"embedding failed: {error}", reason="INTERNAL")
        for job in jobs:
            job.deliver(failure)
        return
    for job, rows in zip(jobs, vectors, strict=True):
        job.deliver(EmbeddingResult(np.stack([v for v in rows if v is not None]), job.request.tokens))
