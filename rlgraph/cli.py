"""The `rlgraph` command: compile, validate, draw, describe and run pipelines.

    rlgraph compile examples/ppo.py -o build/ppo data.batch_size=45
    rlgraph validate examples/ppo.py actor.lr=1e-6
    rlgraph viz examples/ppo.py -o ppo.svg
    rlgraph describe examples/ppo.py rollout.n=8      # or a compiled build/ppo/plan.json
    rlgraph describe examples/ppo.py --config         # every config key: type, default, doc
    rlgraph run examples/ppo.py -o runs/ppo --steps 3 # on Ray, local on 127.0.0.1 by default
    rlgraph export runs/ppo -o ppo-policy             # the trained policy as a Hugging Face directory

PIPELINE is a Python file or ``module:attr``; trailing ``key=value`` arguments override its
config. Exit status: 0 success; 1 a problem with the pipeline, its config or a plan file
(printed without a traceback); 2 bad usage.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from rlgraph.version import __version__
from rlgraph.errors import ConfigError, PipelineError, RLGraphError
from rlgraph.graph import describe as show
from rlgraph.graph.build import build
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.config import parse_overrides
from rlgraph.graph.loader import load_pipeline
from rlgraph.graph.plan import Plan, load_plan

__all__ = ["cli", "main"]

_PLAN_SUFFIX = ".json"
_OVERRIDES_HELP = (
    "Trailing key=value arguments override config keys (`rlgraph describe PIPELINE --config` lists them)."
)


class _UserError(click.ClickException):
    """An `RLGraphError` on its way to the terminal: its message, no traceback, exit status 1."""

    exit_code = 1


class _Refused(click.ClickException):
    """A run refused before it starts (its directory holds an earlier run, cannot be written): exit status 2."""

    exit_code = 2


# the last "rlgraph.<module>.<Class>: message" in a Ray error's text (a traceback ends with it)
_REMOTE_ERROR = re.compile(r"^(rlgraph(?:\.\w+)+)\.(\w+): ", re.MULTILINE)
_ACTOR_INIT = re.compile(r"ray::(\w+)\.__init__\(\)")


def _is_rlgraph_error(module: str, name: str) -> bool:
    try:  # only rlgraph's own modules are imported, to look the class up
        cls = getattr(importlib.import_module(module), name, None)
    except Exception:
        return False
    return isinstance(cls, type) and issubclass(cls, RLGraphError)


def _user_message(e: BaseException) -> str | None:
    """The message to print for an error a user can fix, or None for anything else (a bug: traceback).

    An `RLGraphError`, also one raised inside a Ray actor: Ray wraps it in a `RayTaskError` (whose
    `cause` is the original), or, when it was raised in an actor's constructor, in an
    `ActorDiedError` that keeps only the text, from which the typed error's message is taken.
    """
    cause = getattr(e, "cause", None)
    if isinstance(cause, RLGraphError):  # RayTaskError (also its subclass mixed with the cause's type)
        return str(cause)
    if isinstance(e, RLGraphError):
        return str(e)
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if isinstance(e, RayActorError) and getattr(e, "_actor_init_failed", False):
        text = getattr(e, "error_msg", "") or str(e)
        found = [m for m in _REMOTE_ERROR.finditer(text) if _is_rlgraph_error(m.group(1), m.group(2))]
        if found:
            actor = _ACTOR_INIT.search(text)
            where = f"{actor.group(1)} failed to start: " if actor else "a Ray actor failed to start: "
            return where + text[found[-1].end():].strip()
    return None


class _Cli(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as e:  # click's own exceptions and bugs pass through unchanged
            if isinstance(e, click.ClickException) or isinstance(e, click.exceptions.Exit):
                raise
            message = _user_message(e)
            if message is None:
                raise
            raise _UserError(message) from None


def _compile(pipeline_ref: str, overrides: tuple[str, ...]) -> Plan:

    try:  # a malformed item is bad usage (exit 2), found before the pipeline is imported
        parsed = parse_overrides(overrides)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    pipeline, ref = load_pipeline(pipeline_ref)
    return compile_pipeline(pipeline, parsed, pipeline_ref=ref)


def _is_plan(target: str) -> bool:
    return target.endswith(_PLAN_SUFFIX)


def _plan_or_compile(target: str, overrides: tuple[str, ...]) -> Plan:
    """A plan file, loaded as it is, or a PIPELINE compiled with the overrides."""
    if not _is_plan(target):
        return _compile(target, overrides)
    if overrides:
        raise click.UsageError(
            f"config overrides ({' '.join(overrides)}) cannot be applied to the compiled plan {target!r}; "
            f"pass the pipeline instead, or recompile with `rlgraph compile PIPELINE -o DIR {' '.join(overrides)}`"
        )
    return load_plan(target)


def _console(width: int | None) -> Console:
    # Not a terminal (a pipe, a file, a test): plain text on a fixed wide page, so the output
    # is the same everywhere and no column name is folded.
    if sys.stdout.isatty():
        return Console(width=width, highlight=False, soft_wrap=False)
    return Console(width=width or 200, highlight=False, soft_wrap=False, color_system=None)


def _print(console: Console, *renderables) -> None:
    """Render through `console`, then echo without the trailing blanks rich pads lines with."""
    with console.capture() as captured:
        for r in renderables:
            console.print(r)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def _padding_line(plan: Plan) -> str:
    b = plan.batch
    line = (f"padded batch {b.padded_batch} samples: {b.batch_size} prompts x n={b.n} = {b.global_batch}, "
            f"multiple {b.multiple}, {b.pad_rows} pad rows")
    warning = show.padding_warning(plan)
    line += "".join(f"\nleft out {op}: {why.split(':')[0]} (rlgraph describe says why)"
                    for op, why in plan.reused.items())
    return f"{line}\n{warning}" if warning else line


def _draw(plan: Plan, path: Path) -> Path:
    from rlgraph.graph.viz import write_svg  # imports graphviz only when something is drawn

    return write_svg(plan, path)


_overrides_argument = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")


@click.group("rlgraph", cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="rlgraph")
def cli() -> None:
    """Compile, check, draw, describe and run rlgraph pipelines.

    PIPELINE is a Python file (examples/ppo.py) or module:attr (mypkg.pipelines:ppo).
    Exit status: 0 ok, 1 a problem with the pipeline, config or plan, 2 bad usage.
    """
    _notices_as_lines()


def _notices_as_lines() -> None:
    """verl-alias notices as one line each on stderr (not Python's warning format with a path)."""
    import warnings

    from rlgraph.graph.verl import VerlAliasNotice

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if issubclass(category, VerlAliasNotice):
            click.echo(f"rlgraph: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


@cli.command("compile", epilog=_OVERRIDES_HELP)
@click.argument("pipeline")
@_overrides_argument
@click.option("-o", "--output", "out_dir", required=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path), help="Directory for plan.json and pipeline.svg.")
def compile_command(pipeline: str, overrides: tuple[str, ...], out_dir: Path) -> None:
    """Compile PIPELINE into DIR/plan.json and draw it as DIR/pipeline.svg."""
    plan = _compile(pipeline, overrides)
    click.echo(f"compiled {plan.pipeline!r}: {len(plan.ops)} ops in {len(plan.schedule.stages)} stages, "
               f"{len(plan.groups)} worker groups")
    click.echo(_padding_line(plan))
    click.echo(f"wrote {plan.save(out_dir / 'plan.json')}")
    click.echo(f"wrote {_draw(plan, out_dir / 'pipeline.svg')}")


@cli.command(epilog=_OVERRIDES_HELP)
@click.argument("pipeline")
@_overrides_argument
def validate(pipeline: str, overrides: tuple[str, ...]) -> None:
    """Check PIPELINE with the overrides; print every problem found, or ok. The data source's own
    checks run too: the prompt files' schema and first rows, and the tokenizer against the policy."""
    plan = _compile(pipeline, overrides)
    from rlgraph.runtime.source import preflight

    notes = preflight(plan)
    click.echo(f"ok: {plan.pipeline!r} passes every check ({len(plan.ops)} ops, {len(plan.groups)} worker "
               f"groups); {_padding_line(plan)}")
    for note in notes:
        click.echo(f"note: {note}")


@cli.command(epilog=_OVERRIDES_HELP)
@click.argument("pipeline", metavar="PIPELINE|PLAN")
@_overrides_argument
@click.option("-o", "--output", required=True, metavar="FILE",
              type=click.Path(dir_okay=False, path_type=Path), help="Drawing to write; the extension picks the format.")
def viz(pipeline: str, overrides: tuple[str, ...], output: Path) -> None:
    """Draw PIPELINE (compiled with the overrides) or a plan.json to FILE, e.g. pipeline.svg."""
    plan = _plan_or_compile(pipeline, overrides)
    click.echo(f"wrote {_draw(plan, output)}")


def _config_keys(pipeline_ref: str, overrides: tuple[str, ...]):
    """The schema table. Only the config is checked, so keys can be looked up even while other
    checks (resources, columns) still fail."""
    parsed = parse_overrides(overrides)
    pipeline, _ = load_pipeline(pipeline_ref)
    g = build(pipeline, parsed)
    if g.problems:
        raise PipelineError(list(g.problems), pipeline.name)
    return show.config_schema_table(g.schema, g.config, g.overrides)


@cli.command(epilog=_OVERRIDES_HELP)
@click.argument("target", metavar="PIPELINE|PLAN")
@_overrides_argument
@click.option("--config", "list_config", is_flag=True,
              help="List every config key of PIPELINE with its type, default, current value and doc.")
@click.option("--width", type=click.IntRange(min=40), default=None,
              help="Page width in characters (default: the terminal's, or 200 when not a terminal).")
def describe(target: str, overrides: tuple[str, ...], list_config: bool, width: int | None) -> None:
    """Print the plan of PIPELINE, or of a PLAN file (a plan.json from `rlgraph compile`): ops,
    columns, worker groups, padding, schedule and resolved config."""
    console = _console(width)
    if list_config:
        if _is_plan(target):
            raise click.UsageError(
                f"--config needs a PIPELINE: a plan stores config values but not their types and docs; "
                f"run `rlgraph describe PIPELINE --config` on the pipeline that {target!r} was compiled from"
            )
        _print(console, _config_keys(target, overrides))
        return
    _print(console, *show.sections(_plan_or_compile(target, overrides)))


class _Seconds(click.ParamType):
    """A finite number of seconds, at least 1 (``nan`` and ``inf`` are refused: no wait may be endless)."""

    name = "seconds"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 1:
            self.fail(f"{value!r} is not a finite number of seconds >= 1 (every wait has a limit)", param, ctx)
        return seconds


class _Signalled(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM on its way up: everything unwinds and shuts down; the run exits
    128 + the signal's number (130, 143), as a shell reports a process the signal ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


_received: list[int] = []  # the stop signals this process received, in order


SIGNAL_DEFER_S = 5.0  # the longest a stop signal that lands inside an import waits for the import to end


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM stop a run cleanly (KeyboardInterrupt unwinds and shuts everything down),
    also when the process was started with SIGINT ignored, as background jobs and CI runners are.
    A first signal that lands while the main thread imports a module is raised once the import is
    done (`_after_import`): raised inside it, a module that catches every exception around its own
    imports swallowed it, the run went on to its end, and the module was left half imported."""

    def interrupt(signum, frame):
        _received.append(int(signum))  # a library may re-raise it as a plain KeyboardInterrupt (Ray's get does)
        if len(_received) == 1 and _importing(frame):
            import threading

            threading.Thread(target=_after_import, args=(int(signum),), name="rlgraph_signal", daemon=True).start()
            return
        raise _Signalled(signum)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _importing(frame: Any) -> bool:
    """Whether `frame` (the main thread's) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _after_import(signum: int) -> None:
    """Send `signum` to the main thread again once it imports nothing (at most `SIGNAL_DEFER_S` later):
    its handler, called a second time, raises it."""
    import _thread
    import threading

    main, end = threading.main_thread().ident, time.monotonic() + SIGNAL_DEFER_S
    while time.monotonic() < end and _importing(sys._current_frames().get(main)):
        time.sleep(0.01)
    _thread.interrupt_main(signum)


def _stopped_by(e: BaseException) -> int | None:
    """The signal that `e` stands for: a `_Signalled`, a plain KeyboardInterrupt (SIGINT), or the
    ``SystemExit(15)`` of the SIGTERM handler Ray installs while ``ray.init`` runs; else None."""
    if isinstance(e, _Signalled):
        return e.signum
    if isinstance(e, KeyboardInterrupt):
        return _received[-1] if _received else int(signal.SIGINT)
    if isinstance(e, SystemExit) and e.code == int(signal.SIGTERM):
        return int(signal.SIGTERM)
    return None


@cli.command(epilog=_OVERRIDES_HELP)
@click.argument("target", metavar="PLAN|PIPELINE")
@_overrides_argument
@click.option("-o", "--output", "out_dir", default=None, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path),
              help="Run directory for metrics.jsonl, trace.json, timeline.svg, checkpoints [default: runs/<pipeline>].")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Steps to run [default: trainer.steps].")
@click.option("--schedule", type=click.Choice(["stream", "sync"]), default=None,
              help="stream: ops start on partial data; sync: a barrier after each stage [default: trainer.schedule].")
@click.option("--address", default=None, metavar="ADDR",
              help="Join this Ray cluster instead of starting Ray locally on 127.0.0.1.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in DIR (needs trainer.save_every).")
@click.option("--overwrite", is_flag=True,
              help="Replace the earlier run in DIR (its metrics, checkpoints, traces and charts are deleted).")
@click.option("--fallback", is_flag=True,
              help="With --resume: if the latest checkpoint fails its checksums, resume from the newest good one "
                   "(the damaged one is moved aside, never deleted).")
@click.option("--dataplane", type=click.Choice(["transferqueue", "ray"]), default=None,
              help="Where columns live between ops [default: dataplane.backend].")
@click.option("--timeout", "timeout_s", type=_Seconds(), default=600.0, show_default=True,
              help="Longest wait, in seconds, for any single op call or start-up step.")
@click.option("--verbose", is_flag=True,
              help="Show the actors' own output (Ray's notices, vLLM's logs, worker-death dumps) and log long waits.")
@click.option("--trace-steps", type=click.IntRange(min=0), default=200, show_default=True,
              help="trace.json and timeline.svg show the op calls of this many latest steps (0: all; the driver "
                   "keeps them in memory).")
def run(target: str, overrides: tuple[str, ...], out_dir: Path | None, steps: int | None, schedule: str | None,
        address: str | None, resume: bool, overwrite: bool, fallback: bool, dataplane: str | None, timeout_s: float,
        verbose: bool, trace_steps: int) -> None:
    """Run a plan (or compile and run a pipeline) on Ray.

    Writes DIR/metrics.jsonl (one JSON object per step), DIR/reward_curve.svg, DIR/trace.json
    (open in Perfetto) and DIR/timeline.svg (op calls per worker against time), plus plan.json
    and pipeline.svg.
    """
    import threading

    _interrupt_on_signals()  # from the first moment: a signal during start-up is one line and 128 + its number
    handles: dict[str, Any] = {}
    try:
        runner = _run(target, overrides, out_dir, steps, schedule, address, resume, overwrite, fallback, dataplane,
                      timeout_s, verbose, trace_steps, handles)
    except (KeyboardInterrupt, SystemExit) as e:
        signum = _stopped_by(e)
        if signum is None:
            raise
        for sig in (signal.SIGINT, signal.SIGTERM):  # shutting down: a second signal must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        _shutdown_ray(handles.get("ray"))
        click.echo(f"interrupted by {signal.Signals(signum).name}: everything this run had started was shut down",
                   err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # everything is shut down: no interpreter finalisation after it, which a loader thread still
        # importing, or a Ray core worker a signal cut short in ray.init, can turn into an abort
        os._exit(128 + signum)
    out = Path(runner.opts.out_dir)
    click.echo(f"ran {runner.written} step(s) of {runner.plan.pipeline!r}; wrote {out / 'metrics.jsonl'}, "
               f"{out / 'reward_curve.svg'}, {out / 'trace.json'}, {out / 'timeline.svg'}")


def _shutdown_ray(handle: Any) -> None:
    """Stop a Ray this run started, also one whose start a signal cut short (no handle yet)."""
    try:
        if handle is not None:
            handle.shutdown()
        else:
            import ray

            if ray.is_initialized():
                ray.shutdown()
    except Exception:  # shutting down after a signal: the message above is what matters
        pass


def _run(target: str, overrides: tuple[str, ...], out_dir: Path | None, steps: int | None, schedule: str | None,
         address: str | None, resume: bool, overwrite: bool, fallback: bool, dataplane: str | None, timeout_s: float,
         verbose: bool, trace_steps: int, handles: dict[str, Any]) -> Any:
    """The body of `rlgraph run`; `handles` gets the loader thread and Ray's handle as they exist, for
    the shutdown after a signal."""
    import threading

    if fallback and not resume:
        raise click.UsageError("--fallback chooses which checkpoint --resume continues from; give it with --resume")
    plan = _plan_or_compile(target, overrides)
    out = out_dir or Path("runs") / plan.pipeline
    from rlgraph.runtime.rundir import RunDirError, check_run_dir

    try:  # before anything starts or is written: an earlier run in DIR is never overwritten by accident
        check_run_dir(out, resume=resume, overwrite=overwrite)
    except RunDirError as e:
        raise _Refused(str(e)) from None
    what = "loaded" if _is_plan(target) else "compiled"
    click.echo(f"{what} {plan.pipeline!r}: {len(plan.ops)} ops in {len(plan.schedule.stages)} stages, "
               f"{len(plan.groups)} worker groups; {_padding_line(plan)}", err=True)
    if not _is_plan(target):
        plan.save(out / "plan.json")
        _draw(plan, out / "pipeline.svg")
    if verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("rlgraph").setLevel(logging.INFO)
    # Ray starts (its own processes) while this process imports the runtime (torch, TransferQueue)
    # and runs the pipeline's prepare hook on a thread: start-up pays for the longer of the two.
    # Ray's own module first, before that thread starts: imported beside it, both crawl (one GIL)
    # and Ray's start waits for its import
    import ray  # noqa: F401

    from rlgraph.runtime.cluster import start_ray

    loaded: dict[str, BaseException] = {}

    def load() -> None:
        try:
            from rlgraph.runtime.runner import prepare
            prepare(plan, check=False)  # the prepare hook: the assets the workers load
        except BaseException as e:  # raised on the main thread below
            loaded["error"] = e

    def checks() -> None:
        """The data's head and the tokenizer, checked by the fleet once the workers' actors are
        created: while their processes import, before it waits for them."""
        from rlgraph.runtime.source import preflight

        preflight(plan)

    loader = handles["loader"] = threading.Thread(target=load, name="rlgraph_import", daemon=True)
    loader.start()
    ray_handle = None
    try:
        from dataclasses import replace

        t0 = time.time()
        ray_handle = handles["ray"] = start_ray(plan, address, verbose)
        ray_handle = handles["ray"] = replace(ray_handle, seconds=time.time() - t0)
        _interrupt_on_signals()  # ray.init replaces the SIGTERM handler
        loader.join()
        if "error" in loaded:
            raise loaded["error"]
        from rlgraph.runtime.reporting import make_reporter
        from rlgraph.runtime.runner import RunOptions, Runner

        options = RunOptions(out_dir=out, steps=steps, schedule=schedule, address=address, resume=resume,
                             overwrite=overwrite, fallback=fallback,
                             timeout_s=timeout_s, dataplane=dataplane, reporter=make_reporter(out, plan),
                             on_ray_started=_interrupt_on_signals, verbose=verbose, trace_steps=trace_steps,
                             keep_records=False, ray=ray_handle, checks=checks)  # metrics.jsonl has every record
        runner = Runner(plan, options)
        with runner:  # stops everything it started, Ray included, also on Ctrl-C
            runner.run()
    finally:
        if ray_handle is not None:  # stopped already when the runner started; not when it never did
            ray_handle.shutdown()
    return runner


@cli.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", "out_dir", required=True, metavar="HF_DIR",
              type=click.Path(file_okay=False, path_type=Path), help="Directory to write the model to.")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="Checkpoint step to export [default: the latest checkpoint].")
@click.option("--what", type=click.Choice(["actor", "critic"]), default="actor", show_default=True,
              help="The policy (a causal LM) or the critic (a token-classification model, one label).")
@click.option("--base", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The model directory the run started from, if it moved [default: the run's actor.model_path, "
                   "or critic.model_path].")
@click.option("--overwrite", is_flag=True, help="Replace HF_DIR if it is not empty.")
@click.option("--merge", is_flag=True, help="A LoRA run: write the base model with the adapters merged into its "
                                            "weights [default: the adapter alone, in peft's layout].")
def export_command(run_dir: Path, out_dir: Path, step: int | None, what: str, base: Path | None,
                   overwrite: bool, merge: bool) -> None:
    """Write the trained model of RUN_DIR (an `rlgraph run -o` directory with checkpoints) to HF_DIR
    as a Hugging Face save_pretrained directory: config, safetensors weights, tokenizer, generation
    config. transformers' from_pretrained and vLLM load it. A LoRA run exports its adapter (peft's
    layout), or with --merge the base model with the adapters merged in."""
    from rlgraph.runtime.export import export_model

    done = export_model(run_dir, out_dir, step=step, what=what, base=base, overwrite=overwrite,  # type: ignore[arg-type]
                        merge=merge)
    what_it_is = {"adapter": f"LoRA adapter of the {done.what}", "merged": f"{done.what} with its LoRA merged"}
    click.echo(f"exported the {what_it_is.get(done.kind, done.what)} of step {done.step} ({done.state}, "
               f"{done.parameters:,} parameters, architecture and tokenizer of {done.base}) to {done.out_dir}")


def main() -> None:
    """Entry point of the `rlgraph` console script."""
    # A console script does not put the working directory on sys.path the way `python -m`
    # does; without it `rlgraph describe mypipelines:ppo` could not import ./mypipelines.py.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cli(prog_name="rlgraph")


if __name__ == "__main__":
    main()
