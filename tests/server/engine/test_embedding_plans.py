"""The scheduler plans embedding jobs as prefill-only work: whole jobs, oldest first, within one
prompt chunk's budget per round (the oldest always runs), no slot taken; a full queue refuses."""

from __future__ import annotations

from tests.server.engine.test_scheduler_plans import scheduler
from tokenwire.server.engine.embedding import EmbeddingJob, EmbeddingRequest, EmbeddingResult
from tokenwire.server.engine.errors import ErrorKind, GenerationError


def job(key: int, *lengths: int) -> EmbeddingJob:
    def deliver(_: EmbeddingResult | GenerationError) -> None:
        raise AssertionError("the scheduler delivers nothing")

    return EmbeddingJob(key, EmbeddingRequest(f"emb-{key}", tuple((1,) * n for n in lengths)), deliver)


def test_a_round_runs_whole_jobs_within_the_prompt_budget_oldest_first() -> None:
    planner, _ = scheduler(chunk=100)
    for each in (job(1, 40, 30), job(2, 20), job(3, 50), job(4, 10)):
        assert planner.add_embedding(each) is None
    assert planner.has_work()
    first = planner.schedule(0.0)
    assert [j.key for j in first.embeddings] == [1, 2]  # 90 tokens; job 3 would make 140
    assert first.admitted == () and first.prompts == ()
    second = planner.schedule(1.0)
    assert [j.key for j in second.embeddings] == [3, 4]
    assert not planner.has_work()


def test_a_job_larger_than_the_budget_runs_alone() -> None:
    planner, _ = scheduler(chunk=16)
    planner.add_embedding(job(1, 200))
    planner.add_embedding(job(2, 1))
    assert [j.key for j in planner.schedule(0.0).embeddings] == [1]
    assert [j.key for j in planner.schedule(1.0).embeddings] == [2]


def test_a_full_embedding_queue_refuses_and_a_stopping_engine_plans_none() -> None:
    planner, _ = scheduler(queue=2)
    assert planner.add_embedding(job(1, 1)) is None
    assert planner.add_embedding(job(2, 1)) is None
    refusal = planner.add_embedding(job(3, 1))
    assert refusal is not None and refusal.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert planner.schedule(0.0, admit=False).embeddings == ()
    assert [j.key for j in planner.take_embeddings()] == [1, 2]
    assert not planner.has_work()
