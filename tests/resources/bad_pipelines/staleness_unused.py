"""trainer.max_staleness=2 on a pipeline where nothing may run ahead: no op declared stale_ok reads state."""

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op


@op(outputs={"score": T.float32()}, group="w")
def judge(prompt_ids: T.int64("prompt_len")):
    raise AssertionError("never run: the pipeline does not compile")


pipeline = Pipeline("staleness_unused", DataSource({"prompt_ids": T.int64("prompt_len")}), [judge], [WorkerGroup("w")],
                    outputs=["score"], config={"trainer": {"max_staleness": 2}})
