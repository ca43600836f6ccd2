"""trainer.logger: which loggers a value names, the trackers' runs read back with their own
readers (TensorBoard's EventAccumulator, MLflow's client, wandb's offline run file), the error for
a missing package, and one `rlgraph run` whose tracked values equal its metrics.jsonl."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlgraph
from rlgraph.errors import ConfigError
from rlgraph.graph.dsl import LOGGERS, parse_loggers
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.loggers import RUNS_FILE, WandbLogger, wandb_mode
from rlgraph.runtime.progress import FaultReporter, LogReporter
from rlgraph.runtime.reporting import make_reporter

PIPELINE = str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py")
RLGRAPH = str(Path(sys.executable).with_name("rlgraph"))
RECORDS = [{"step": 0, "schedule": "stream", "score/mean": 0.25, "timing/step_s": 1.5, "faults/retries": 0},
           {"step": 1, "schedule": "stream", "score/mean": 0.75, "timing/step_s": 1.25, "faults/retries": 1}]


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(PIPELINE)[0]


def plan_with(pipeline, *overrides: str):
    return rlgraph.compile(pipeline, list(overrides))


def run_reporter(reporter, records=RECORDS, first_step=0):
    reporter.start(first_step + len(records), first_step, ["score/mean"])
    for r in records:
        reporter.step_done(r)
    reporter.close()


@pytest.fixture
def no_tracking_env(monkeypatch, tmp_path):
    """No wandb or mlflow set up by the user: defaults apply, and nothing is written outside tmp_path."""
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "WANDB_MODE",
              "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no wandb login from the user's ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


# which loggers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[console,wandb]", "console,wandb", '["console","wandb"]', "['console', 'wandb']",
                                  " Console , WANDB ", "[console,wandb,console]"])
def test_every_spelling_of_a_list_names_the_same_loggers(text):
    assert parse_loggers(text) == ("console", "wandb")


def test_an_empty_list_names_none():
    assert parse_loggers("[]") == () == parse_loggers("")


def test_an_unknown_logger_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown loggers 'wandbb' \(did you mean 'wandb'\?\), 'neptune'; "
                                         r"the loggers are console, jsonl, tensorboard, wandb, mlflow"):
        parse_loggers("[console,wandbb,neptune]")


def test_the_default_is_console_jsonl_and_tensorboard():
    from rlgraph.graph.dsl import TRAINER_PARAMS

    assert parse_loggers(TRAINER_PARAMS["logger"].default) == ("console", "jsonl", "tensorboard")
    assert set(LOGGERS) == {"console", "jsonl", "tensorboard", "wandb", "mlflow"}


def test_compile_refuses_an_unknown_logger(pipeline):
    from rlgraph.errors import PipelineError

    with pytest.raises(PipelineError, match=r"\[config-type\] trainer.logger=\[console,wandbb\]: unknown logger "
                                            r"'wandbb' \(did you mean 'wandb'\?\)"):
        plan_with(pipeline, "trainer.logger=[console,wandbb]")


def test_make_reporter_refuses_an_unknown_logger_with_a_config_error(pipeline, tmp_path):
    plan = plan_with(pipeline)  # then edited by hand, as a plan.json can be
    plan = plan.model_copy(update={"config": {**plan.config, "trainer": {**plan.config["trainer"],
                                                                         "logger": "[console,tensorbord]"}}})
    with pytest.raises(ConfigError, match=r"trainer.logger=\[console,tensorbord\]: unknown logger 'tensorbord' "
                                          r"\(did you mean 'tensorboard'\?\)"):
        make_reporter(tmp_path, plan, tty=False)


@pytest.mark.parametrize("logger, pip", [("wandb", "pip install 'rlgraph[wandb]' (or pip install wandb)"),
                                         ("mlflow", "pip install 'rlgraph[mlflow]' (or pip install mlflow-skinny)"),
                                         ("tensorboard", "pip install tensorboard")])
def test_a_missing_package_is_a_config_error_naming_the_pip_line(pipeline, tmp_path, monkeypatch, logger, pip):
    monkeypatch.setitem(sys.modules, logger, None)  # `import <logger>` now raises ImportError
    plan = plan_with(pipeline, f"trainer.logger=[console,{logger}]")
    with pytest.raises(ConfigError) as info:
        make_reporter(tmp_path, plan, tty=False)
    assert f"trainer.logger includes {logger!r} but the {logger} package is not installed" in str(info.value)
    assert pip in str(info.value)
    assert not (tmp_path / RUNS_FILE).exists()  # nothing started


def test_without_console_nothing_is_printed_per_step_but_faults_are(pipeline, tmp_path, capsys):
    reporter = make_reporter(tmp_path, plan_with(pipeline, "trainer.logger=[jsonl]"), tty=False)
    assert [type(r) for r in reporter.reporters] == [FaultReporter]
    reporter.start(2, 0, ["score/mean"])
    reporter.phase("Ray: started")
    reporter.step_done(RECORDS[0])
    reporter.fault("actor[0] died at step 0; restarted it")
    reporter.close()
    assert capsys.readouterr().err == "rlgraph: actor[0] died at step 0; restarted it\n"


def test_console_prints_a_line_per_step(pipeline, tmp_path, capsys):
    reporter = make_reporter(tmp_path, plan_with(pipeline, "trainer.logger=console"), tty=False)
    assert [type(r) for r in reporter.reporters] == [LogReporter]
    run_reporter(reporter)
    assert "step 1/1 score/mean=0.75 timing/step_s=1.25" in capsys.readouterr().err


# TensorBoard --------------------------------------------------------------------------------------


def read_tensorboard(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("config/text_summary")]
    return scalars, texts


def test_tensorboard_logs_every_step_and_the_config(pipeline, tmp_path):
    plan = plan_with(pipeline, "trainer.logger=[tensorboard]", "trainer.seed=7")
    run_reporter(make_reporter(tmp_path, plan, tty=False))
    scalars, texts = read_tensorboard(tmp_path / "tensorboard")
    assert scalars == {"score/mean": [(0, 0.25), (1, 0.75)], "timing/step_s": [(0, 1.5), (1, 1.25)],
                       "faults/retries": [(0, 0.0), (1, 1.0)]}  # the schedule (a string) is no scalar
    (config,) = texts
    assert config.startswith("| key | value |\n|---|---|\n")
    assert "| `trainer.seed` | 7 |" in config and "| `trainer.logger` | [tensorboard] |" in config


def test_a_step_s_scalars_are_one_tensorboard_event_and_reach_the_file_while_the_run_goes_on(
        pipeline, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from rlgraph.runtime.loggers import TensorBoardLogger

    monkeypatch.setattr(TensorBoardLogger, "FLUSH_S", 0.2)
    reporter = make_reporter(tmp_path, plan_with(pipeline, "trainer.logger=[tensorboard]"), tty=False)
    reporter.start(2, 0, ["score/mean"])
    for r in RECORDS:
        reporter.step_done(r)
    try:  # not closed yet: a user watching with tensorboard sees the steps within FLUSH_S
        deadline, scalars = time.monotonic() + 10, {}
        while time.monotonic() < deadline and len(scalars.get("score/mean", ())) < 2:
            time.sleep(0.1)
            scalars = read_tensorboard(tmp_path / "tensorboard")[0]
        assert scalars["score/mean"] == [(0, 0.25), (1, 0.75)]
    finally:
        reporter.close()
    (events,) = [f for f in (tmp_path / "tensorboard").iterdir() if "tfevents" in f.name]
    steps = [e for e in EventFileLoader(str(events)).Load()
             if e.summary.value and not e.summary.value[0].tag.startswith("config")]
    assert [(e.step, sorted(v.tag for v in e.summary.value)) for e in steps] == [
        (0, ["faults/retries", "score/mean", "timing/step_s"]), (1, ["faults/retries", "score/mean", "timing/step_s"])]


def test_tensorboard_has_every_step_on_disk_before_a_checkpoint_is_written(pipeline, tmp_path, monkeypatch):
    from rlgraph.runtime.loggers import TensorBoardLogger

    monkeypatch.setattr(TensorBoardLogger, "FLUSH_S", 3600)  # no timed flush in this test
    reporter = make_reporter(tmp_path, plan_with(pipeline, "trainer.logger=[tensorboard]"), tty=False)
    reporter.start(2, 0, ["score/mean"])
    try:
        for r in RECORDS:
            reporter.step_done(r)
        reporter.checkpoint(1)  # what the runner calls before it writes the checkpoint of step 1
        assert read_tensorboard(tmp_path / "tensorboard")[0]["score/mean"] == [(0, 0.25), (1, 0.75)]
    finally:
        reporter.close()


def test_tensorboard_after_a_resume_shows_the_checkpointed_steps_then_the_new_ones(pipeline, tmp_path):
    plan = plan_with(pipeline, "trainer.logger=[tensorboard]")
    run_reporter(make_reporter(tmp_path, plan, tty=False))  # steps 0, 1; say the checkpoint is after step 0
    replayed = [{"step": 1, "score/mean": 0.5}, {"step": 2, "score/mean": 1.0}]
    run_reporter(make_reporter(tmp_path, plan, tty=False), replayed, first_step=1)
    assert read_tensorboard(tmp_path / "tensorboard")[0]["score/mean"] == [(0, 0.25), (1, 0.5), (2, 1.0)]
    # a fresh run into the same directory shows only itself, as metrics.jsonl does
    run_reporter(make_reporter(tmp_path, plan, tty=False), [{"step": 0, "score/mean": 9.0}])
    assert read_tensorboard(tmp_path / "tensorboard")[0]["score/mean"] == [(0, 9.0)]


# MLflow -------------------------------------------------------------------------------------------


def read_mlflow(out_dir: Path):
    from mlflow.tracking import MlflowClient

    saved = json.loads((out_dir / RUNS_FILE).read_text())["mlflow"]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as a user reading the store must (docs/runtime.md)
    client = MlflowClient(saved["tracking_uri"])
    return client, client.get_run(saved["run_id"])


def test_mlflow_logs_every_step_and_the_config_to_a_file_store_in_the_run_dir(pipeline, tmp_path, no_tracking_env):
    plan = plan_with(pipeline, "trainer.logger=[mlflow]", "trainer.run_name=first try")
    long = "x" * 7000  # over mlflow's 6000-character limit for a param value (a prompt template, say)
    plan = plan.model_copy(update={"config": {**plan.config, "notes": {"template": long}}})
    run_reporter(make_reporter(tmp_path / "run", plan, tty=False))
    client, run = read_mlflow(tmp_path / "run")
    assert client.tracking_uri == (tmp_path / "run" / "mlruns").as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # mlflow 3 refuses a file store without it
    assert run.info.status == "FINISHED" and run.info.run_name == "first try"
    assert client.get_experiment(run.info.experiment_id).name == "rlgraph"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "score/mean")] == [(0, 0.25),
                                                                                                     (1, 0.75)]
    assert set(run.data.metrics) == {"score/mean", "timing/step_s", "faults/retries"}
    params = run.data.params
    assert params["trainer.logger"] == "[mlflow]" and params["trainer.steps"] == "3"
    assert params["trainer.project"] == "null" and params["notes.template"] == long[:6000]
    assert run.data.tags["rlgraph.pipeline"] == plan.pipeline


def test_mlflow_honours_the_tracking_uri_and_experiment_from_the_environment(pipeline, tmp_path, no_tracking_env,
                                                                             monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    run_reporter(make_reporter(tmp_path / "run", plan_with(pipeline, "trainer.logger=mlflow"), tty=False))
    client, run = read_mlflow(tmp_path / "run")
    assert client.tracking_uri == store.as_uri() and not (tmp_path / "run" / "mlruns").exists()
    assert client.get_experiment(run.info.experiment_id).name == "from-env"
    assert run.info.run_name == "run"  # the run directory's name


def test_mlflow_marks_a_run_that_ends_on_an_error_failed_and_a_resume_continues_it(pipeline, tmp_path,
                                                                                   no_tracking_env):
    plan = plan_with(pipeline, "trainer.logger=[mlflow]", "trainer.project=mine")
    reporter = make_reporter(tmp_path, plan, tty=False)
    reporter.start(3, 0)
    reporter.step_done(RECORDS[0])
    reporter.close(RuntimeError("a worker died"))  # as the runner closes its reporter on an error
    client, run = read_mlflow(tmp_path)
    assert run.info.status == "FAILED" and client.get_experiment(run.info.experiment_id).name == "mine"
    run_reporter(make_reporter(tmp_path, plan, tty=False), RECORDS[1:], first_step=1)  # --resume after step 0
    client, resumed = read_mlflow(tmp_path)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "score/mean")] == [0, 1]


# wandb --------------------------------------------------------------------------------------------


def test_wandb_is_offline_unless_the_user_set_it_up(no_tracking_env, monkeypatch):
    assert wandb_mode(lambda: False) == "offline"
    assert wandb_mode(lambda: True) is None  # logged in: wandb's own settings (online)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode(lambda: False) is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(lambda: False) is None  # wandb reads WANDB_MODE itself


def test_wandb_init_arguments(pipeline, tmp_path, no_tracking_env, monkeypatch):
    fake = type(sys)("wandb")
    fake.login = lambda **kw: False  # not logged in
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    plan = plan_with(pipeline, "trainer.logger=[wandb]")
    (tracker,) = [r for r in make_reporter(tmp_path / "grpo-lr", plan, tty=False).reporters if
                  isinstance(r, WandbLogger)]
    args = tracker.init_args(first_step=0)
    assert args["mode"] == "offline" and args["project"] == "from-env" and args["name"] == "grpo-lr"
    assert args["dir"] == str(tmp_path / "grpo-lr") and args["config"] == plan.config and "resume" not in args
    (tmp_path / "grpo-lr").mkdir()
    (tmp_path / "grpo-lr" / RUNS_FILE).write_text(json.dumps({"wandb": {"id": "abc123"}}))
    resumed = tracker.init_args(first_step=5)
    assert resumed["id"] == "abc123" and resumed["resume"] == "allow"
    assert tracker.init_args(first_step=0)["id"] != "abc123"  # a fresh run is a new wandb run


def read_wandb_offline_run(run_file: Path) -> list:
    """The records of a wandb run file: a LevelDB-style log of 32 KiB blocks after a 7-byte header
    (``:W&B``, magic, version); each chunk is crc32 (4), length (2), type (1: full, 2: first,
    3: middle, 4: last), data; each record a wandb_internal ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, part, records = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if pos + 7 + n > len(raw):  # still being written
            break
        part += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def test_wandb_offline_run_holds_every_step_and_the_config(pipeline, tmp_path, no_tracking_env):
    pytest.importorskip("wandb")
    plan = plan_with(pipeline, "trainer.logger=[wandb]", "trainer.project=demo")
    run_reporter(make_reporter(tmp_path, plan, tty=False))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.time() + 30  # wandb's service process may still be writing the file when finish() returns
    records = read_wandb_offline_run(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.time() < deadline, f"{run_file} has no exit record after 30 s"
        time.sleep(0.2)
        records = read_wandb_offline_run(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "demo" and run.display_name == tmp_path.name
    assert run.run_id == json.loads((tmp_path / RUNS_FILE).read_text())["wandb"]["id"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["trainer"]["logger"] == "[wandb]" and config["data"] == plan.config["data"]
    steps = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
             for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: s[k] for k in ("_step", "score/mean", "timing/step_s", "faults/retries")} for s in steps] == \
        [{"_step": 0, "score/mean": 0.25, "timing/step_s": 1.5, "faults/retries": 0},
         {"_step": 1, "score/mean": 0.75, "timing/step_s": 1.25, "faults/retries": 1}]


# end to end ---------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_rlgraph_run_logs_to_tensorboard_and_mlflow_what_it_writes_to_metrics_jsonl(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI",
                                                            "MLFLOW_EXPERIMENT_NAME")}
    out = tmp_path / "run"
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(out), "--steps", "2", "--dataplane", "ray",
                          "trainer.logger=[console,tensorboard,mlflow]"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step 1/1 " in res.stderr  # console
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    numeric = {k for r in records for k, v in r.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    expected = {k: [(r["step"], float(r[k])) for r in records if k in r] for k in numeric}

    scalars, (config,) = read_tensorboard(out / "tensorboard")
    assert set(scalars) == numeric
    for k, points in expected.items():  # TensorBoard keeps float32
        assert scalars[k] == [(s, pytest.approx(v, rel=1e-6, abs=1e-30)) for s, v in points], k
    assert "| `trainer.logger` | [console,tensorboard,mlflow] |" in config

    client, run = read_mlflow(out)
    assert run.info.status == "FINISHED" and set(run.data.metrics) == numeric
    for k, points in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] == points, k
    assert run.data.params["trainer.logger"] == "[console,tensorboard,mlflow]"


def test_a_tracker_that_fails_mid_run_is_left_out_and_the_others_go_on(capsys):
    from rlgraph.runtime.reporter import Reporter
    from rlgraph.runtime.reporting import _Many

    class Broken(Reporter):
        def step_done(self, record):
            raise ConnectionError("tracking server gone")

    class Counting(Reporter):
        def __init__(self):
            self.steps, self.closed = [], None

        def step_done(self, record):
            self.steps.append(record["step"])

        def close(self, error=None):
            self.closed = error

    broken, counting = Broken(), Counting()
    many = _Many([broken, counting])
    many.start(2, 0)
    many.step_done({"step": 0})
    many.step_done({"step": 1})
    many.close(None)
    assert counting.steps == [0, 1] and counting.closed is None and many.reporters == [counting]
    err = capsys.readouterr().err
    assert err.count("the Broken failed in step_done (ConnectionError: tracking server gone); it logs nothing "
                     "more in this run") == 1

    class NoStart(Reporter):
        def start(self, *a, **k):
            raise RuntimeError("wandb.init failed")

    with pytest.raises(RuntimeError, match="wandb.init failed"):
        _Many([Counting(), NoStart()]).start(2, 0)
