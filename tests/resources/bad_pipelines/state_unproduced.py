"""An op reads a state column that nothing writes: it would read None at every step."""

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op


@op(outputs={"score": T.float32()}, group="w")
def judge(prompt_ids: T.int64("prompt_len"), judge_weights: T.opaque().state()):
    raise AssertionError("never run: the pipeline does not compile")


pipeline = Pipeline("state_unproduced", DataSource({"prompt_ids": T.int64("prompt_len")}), [judge], [WorkerGroup("w")],
                    outputs=["score"])
