"""Experiment trackers for ``trainer.logger``: TensorBoard, Weights & Biases, MLflow.

Each is a `Reporter`: it opens its run in `start` and logs the run config there once, logs every
step's numeric metrics in `step_done` (the record that goes to metrics.jsonl, step as the x
axis), and ends the run in `close`, as failed when the run is ending on an exception. Their
packages are imported when they are made, before Ray starts, so a missing one is a `ConfigError`
naming the pip install line rather than a failure after minutes of start-up.

Nothing leaves the machine unless the user set that up: wandb runs offline (DIR/wandb, upload
later with ``wandb sync``) unless WANDB_MODE, WANDB_API_KEY or a ``wandb login`` says otherwise;
mlflow writes to a file store in DIR/mlruns unless MLFLOW_TRACKING_URI names a server. With
``--resume`` wandb and mlflow continue the run they started (its id is kept in
DIR/logger_runs.json); TensorBoard hides what it logged after the checkpoint, as metrics.jsonl
drops it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from rlgraph.errors import ConfigError
from rlgraph.graph.config import flatten
from rlgraph.runtime.reporter import Reporter

__all__ = ["TensorBoardLogger", "WandbLogger", "MLflowLogger", "require", "scalars", "wandb_mode", "RUNS_FILE"]

RUNS_FILE = "logger_runs.json"  # in the run directory: the wandb and mlflow run ids, for --resume

# logger -> (module to import, how to install it)
_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'rlgraph[wandb]' (or pip install wandb)"),
    "mlflow": ("mlflow", "pip install 'rlgraph[mlflow]' (or pip install mlflow-skinny)"),
}


def require(logger: str) -> ModuleType:
    """Import the package behind `logger`; a `ConfigError` saying how to install it if it is missing."""
    module, pip = _PACKAGES[logger]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"trainer.logger includes {logger!r} but the {module} package is not installed ({e}): "
                          f"{pip}, or leave {logger!r} out of trainer.logger") from None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step record (not the step itself, flags or strings such as the schedule)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _saved_run(out_dir: Path, logger: str) -> dict[str, Any] | None:
    path = out_dir / RUNS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(logger)
    except (ValueError, AttributeError):  # damaged: start a new tracker run rather than fail the training run
        return None


def _save_run(out_dir: Path, logger: str, entry: Mapping[str, Any]) -> None:
    path = out_dir / RUNS_FILE
    saved: dict[str, Any] = {}
    if path.is_file():
        try:
            saved = dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            saved = {}
    saved[logger] = dict(entry)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------- TensorBoard
def _config_markdown(config: Mapping[str, Any]) -> str:
    rows = [f"| `{k}` | {_text(v).replace('|', '&#124;')} |" for k, v in sorted(flatten(config).items())]
    return "\n".join(["| key | value |", "|---|---|", *rows])


class TensorBoardLogger(Reporter):
    """Scalars of every step, and the config as a table (TEXT tab, tag ``config``), in DIR/tensorboard.

    A step's scalars go out as one event (one summary holding them all), not one event each, and
    the file is flushed every `FLUSH_S` seconds, before each checkpoint and at the end, rather than
    after every step: a step's ~80 scalars one by one, flushed, cost the driver ~5 ms on the path
    between one step's end and the next step's calls; this way ~0.5 ms. TensorBoard reads both
    layouts the same. A run killed outright loses at most the last `FLUSH_S` seconds of events, all
    after its last checkpoint, which a resume writes again."""

    FLUSH_S = 5

    def __init__(self, log_dir: Path, config: Mapping[str, Any]) -> None:
        require("tensorboard")
        self.log_dir, self.config = Path(log_dir), config
        self.writer: Any = None

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides events at steps >= first_step that earlier runs wrote to this
        # directory, as metrics.jsonl drops them: a fresh run shows only itself, a resumed one continues
        self.writer = SummaryWriter(str(self.log_dir), purge_step=first_step, flush_secs=self.FLUSH_S)
        self.writer.add_text("config", _config_markdown(self.config), global_step=first_step)
        self.writer.flush()

    def step_done(self, record: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # the values add_scalar would write (a simple_value per tag), in one summary of one event
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()])
        self.writer._get_file_writer().add_summary(summary, record["step"])

    def checkpoint(self, step: int) -> None:
        self.writer.flush()  # a kill after the checkpoint must not leave a gap a resume would not fill

    def close(self, error: BaseException | None = None) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------------------- wandb
def _wandb_logged_in(wandb: ModuleType) -> bool:
    """Whether wandb has an API key (``wandb login``, a settings file, .netrc), asking nothing and
    calling no server."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # wandb before login(prompt=...)
        return bool(getattr(getattr(wandb, "api", None), "api_key", None))


def wandb_mode(logged_in: Callable[[], bool]) -> str | None:
    """``"offline"``, unless the user set wandb up (WANDB_MODE or WANDB_API_KEY set, or logged in):
    then None, and wandb follows its own settings."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    return None if logged_in() else "offline"


class WandbLogger(Reporter):
    """A wandb run in DIR/wandb: the config as its config, every step's metrics at that step."""

    def __init__(self, out_dir: Path, config: Mapping[str, Any], project: str | None, run_name: str) -> None:
        self.wandb = require("wandb")
        self.out_dir, self.config = Path(out_dir), config
        self.project = project or os.environ.get("WANDB_PROJECT") or "rlgraph"
        self.run_name = run_name
        self.run: Any = None

    def init_args(self, first_step: int) -> dict[str, Any]:
        """The keywords of ``wandb.init``: a resumed run (first_step > 0) continues the wandb run the
        first one started."""
        saved = _saved_run(self.out_dir, "wandb") if first_step > 0 else None
        args: dict[str, Any] = {
            "project": self.project, "name": self.run_name, "dir": str(self.out_dir), "config": dict(self.config),
            "id": saved["id"] if saved else uuid.uuid4().hex[:12],
        }
        if saved:
            args["resume"] = "allow"
        mode = wandb_mode(lambda: _wandb_logged_in(self.wandb))
        if mode is not None:
            args["mode"] = mode
        return args

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None:
        args = self.init_args(first_step)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(**args)
        _save_run(self.out_dir, "wandb", {"id": args["id"], "project": self.project})

    def step_done(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self, error: BaseException | None = None) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if error is None else 1)
            self.run = None


# ---------------------------------------------------------------------------------- MLflow
_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")  # mlflow allows alphanumerics, _ - . space / and :


def _mlflow_key(key: str) -> str:
    return _MLFLOW_BAD.sub("_", key)[:250]


class MLflowLogger(Reporter):
    """An mlflow run: the config flattened as its params (values cut to mlflow's length limit),
    every step's metrics at that step. Written to $MLFLOW_TRACKING_URI, else a file store in
    DIR/mlruns (``mlflow ui --backend-store-uri DIR/mlruns``)."""

    def __init__(self, out_dir: Path, config: Mapping[str, Any], project: str | None, run_name: str,
                 pipeline: str = "") -> None:
        require("mlflow")
        self.out_dir, self.config = Path(out_dir), config
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (self.out_dir.resolve() / "mlruns").as_uri()
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            # mlflow 3 keeps its file store "in maintenance mode" and refuses it without this
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.experiment = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlgraph"
        self.run_name, self.pipeline = run_name, pipeline
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.client = MlflowClient(self.tracking_uri)
        saved = _saved_run(self.out_dir, "mlflow") if first_step > 0 else None
        if saved and saved.get("tracking_uri") == self.tracking_uri:  # --resume: go on with the same run
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
        run = self.client.create_run(exp_id, run_name=self.run_name,
                                     tags={"rlgraph.pipeline": self.pipeline, "rlgraph.run_dir": str(self.out_dir)})
        self.run_id = run.info.run_id
        params = [Param(_mlflow_key(k), _text(v)[:MAX_PARAM_VAL_LENGTH])
                  for k, v in sorted(flatten(self.config).items())]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        _save_run(self.out_dir, "mlflow", {"tracking_uri": self.tracking_uri, "run_id": self.run_id,
                                           "experiment": self.experiment})

    def step_done(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def close(self, error: BaseException | None = None) -> None:
        if self.run_id is not None:
            status = "FINISHED" if error is None else "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            self.client.set_terminated(self.run_id, status)
            self.run_id = None
