"""StepBook: chunking and readiness, pure bookkeeping (no Ray)."""

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.book import StepBook, make_chunks


def _plan(example, *overrides):
    pipeline, _ = load_pipeline(f"tests/resources/{example}_pinned.py")
    return compile(pipeline, list(overrides))


def _uids(batch, n, pad):
    # rows of one prompt are contiguous; each padding row is its own group
    return [p for p in range(batch) for _ in range(n)] + [batch + i for i in range(pad)]


def test_chunks_cover_rows_once_per_mode():
    plan = _plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2",
                 "rollout.micro_batch_size=2", "reward.micro_batch_size=5")
    # 3 prompts x 4 = 12 samples; multiple = lcm(1, 2*4) = 8 -> padded 16: 4 padding rows
    assert plan.batch.padded_batch == 16
    uids = _uids(3, 4, 4)
    gen = make_chunks(plan.op("generate"), uids)  # group mode, 2 groups per chunk
    assert [c.rows for c in gen] == [tuple(range(0, 8)), (8, 9, 10, 11, 12), (13, 14), (15,)]
    rew = make_chunks(plan.op("reward"), uids)  # stream mode, 5 rows per chunk
    assert [len(c.rows) for c in rew] == [5, 5, 5, 1]
    upd = make_chunks(plan.op("update_actor"), uids)  # barrier: one chunk of all rows
    assert upd[0].rows == tuple(range(16)) and len(upd) == 1
    for chunks in (gen, rew, upd):
        rows = [r for c in chunks for r in c.rows]
        assert sorted(rows) == list(range(16))


def _drain(book):
    """Run every runnable chunk to completion, one wave at a time; return the waves."""
    waves = []
    while not book.finished:
        wave = book.all_runnable()
        assert wave, f"deadlock: {book.unfinished()}"
        for c in wave:
            book.start(c)
        for c in wave:
            book.complete(c)
        waves.append(wave)
    return waves


@pytest.mark.parametrize("schedule", ["stream", "sync"])
def test_same_calls_under_both_schedules(schedule):
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "rollout.micro_batch_size=1")
    uids = _uids(4, 2, plan.batch.pad_rows)
    book = StepBook(plan, uids, step=0, schedule=schedule)
    waves = _drain(book)
    calls = sorted((c.op, c.index, c.rows) for w in waves for c in w)
    ref = StepBook(plan, uids, step=0, schedule="stream" if schedule == "sync" else "sync")
    other = sorted((c.op, c.index, c.rows) for w in _drain(ref) for c in w)
    assert calls == other


def test_stream_starts_reward_before_generation_ends_and_sync_does_not():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "rollout.micro_batch_size=1",
                 "reward.micro_batch_size=2")
    uids = _uids(4, 2, plan.batch.pad_rows)
    stream = StepBook(plan, uids, step=0, schedule="stream")
    first_gen = stream.runnable("generate")[0]
    stream.start(first_gen)
    stream.complete(first_gen)  # rows 0,1 generated
    assert [c.rows for c in stream.runnable("reward")] == [(0, 1)]
    assert stream.runnable("advantage") == []  # barrier: waits for every row
    sync = StepBook(plan, uids, step=0, schedule="sync")
    g = sync.runnable("generate")[0]
    sync.start(g)
    sync.complete(g)
    assert sync.runnable("reward") == []  # stage 1 waits for all of stage 0


def test_warmup_skips_gated_op_and_retry_requeues():
    plan = _plan("ppo", "trainer.critic_warmup=2")
    uids = _uids(8, 4, plan.batch.pad_rows_warmup)
    book = StepBook(plan, uids, step=0)
    assert book.ops["update_actor"].skipped and not book.ops["update_critic"].skipped
    chunk = book.runnable("generate")[0]
    book.start(chunk)
    assert chunk not in book.runnable("generate")
    book.retry(chunk)
    assert book.runnable("generate")[0] == chunk
    assert "generate" in book.unfinished()
