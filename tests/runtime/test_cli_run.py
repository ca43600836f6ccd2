"""`rlgraph run` as a user runs it: its own local Ray and TransferQueue, in a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.ray

PIPELINE = str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py")
RLGRAPH = str(Path(sys.executable).with_name("rlgraph"))


def _env():
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never join the test session's Ray
    return env


def _ignore_sigint():
    # as a background job or a CI runner starts it: Python then installs no Ctrl-C handler itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("after_s", [1.0, 4.0])
def test_sigterm_during_start_up_exits_143_with_one_line(tmp_path, after_s):
    """Stopped while it compiles (1 s) or while Ray starts (4 s): exit 143, one line, no traceback,
    and nothing it started is left running."""
    proc = subprocess.Popen([RLGRAPH, "run", PIPELINE, "-o", str(tmp_path / "run"), "--steps", "500"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(after_s)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert lines[-1] == "interrupted by SIGTERM: everything this run had started was shut down", output
    assert "Traceback" not in output and "Aborted" not in output, output
    assert "SIGTERM received" not in output, output  # Ray's C++ failure handler's dump is held back
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_sigterm_inside_an_import_that_swallows_exceptions_still_stops_the_run(tmp_path):
    """A signal that lands while a module imports (here the pipeline's own, which catches every
    exception around a wait, as some libraries do around their imports) is raised once the import is
    done: exit 143 with one line, not a run that goes on to its end with the signal swallowed."""
    pipeline = tmp_path / "swallowing_pipeline.py"
    pipeline.write_text(
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(Path(PIPELINE).parent)!r})\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(1.0)\n"
        "except BaseException:\n"
        "    pass\n"
        "from tensor_pipeline import pipeline  # noqa: E402\n")
    proc = subprocess.run([RLGRAPH, "run", str(pipeline), "-o", str(tmp_path / "run"), "--steps", "2"], env=_env(),
                          capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output
    assert output.strip().splitlines()[-1] == "interrupted by SIGTERM: everything this run had started was shut down"
    assert "ran 2 step(s)" not in output and "Traceback" not in output, output


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_run_then_ctrl_c_stops_everything_it_started(tmp_path, sig):
    out = tmp_path / "run"
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen([RLGRAPH, "run", PIPELINE, "-o", str(out), "--steps", "500"], env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, text=True, preexec_fn=_ignore_sigint)
    try:
        deadline = time.time() + 180
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()
            time.sleep(0.5)
        assert metrics.exists(), "no step finished within 180 s"
        started = psutil.Process(proc.pid).children(recursive=True)
        assert started, "the run started no processes"
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "log.txt").read_text()
    assert proc.returncode == 128 + sig, output  # 130 for SIGINT, 143 for SIGTERM
    assert f"interrupted by {sig.name}: everything this run had started was shut down" in output
    # what a user sees before the first step: the compile summary, then one line per start-up phase
    lines = [ln for ln in output.splitlines() if ln.startswith(("compiled ", "rlgraph: "))]
    # the data plane starts beside the workers, so its line may come before or after theirs
    assert lines[0].startswith("compiled ") and lines[1].startswith("rlgraph: Ray: started on 127.0.0.1"), output
    assert lines[-1].startswith("rlgraph: running steps 0..499"), output
    phases = ["rlgraph: workers: ", "rlgraph: data plane: TransferQueue", "rlgraph: model load: ",
              "rlgraph: connected 4 actor(s) to the data plane"]  # the workers; the source is the controller's guest
    assert sorted(next(p for p in phases if ln.startswith(p)) for ln in lines[2:-1]) == sorted(phases), output
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running: {[p.info if hasattr(p, 'info') else p.pid for p in alive]}"
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["step"] == 0 and first["driver/payload_bytes"] == 0
    assert (out / "plan.json").is_file() and (out / "pipeline.svg").is_file()
    assert (out / "trace.json").is_file() and (out / "timeline.svg").is_file()


def test_run_reports_a_failing_op_and_exits_1(tmp_path):
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(tmp_path), "--steps", "2", "gen.fail_step=0",
                          "--dataplane", "ray"], env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "op 'gen' failed on worker actor[0] at step 0" in res.stderr
    assert "Traceback (most recent call last)" not in res.stderr.split("Error:")[0]


def test_run_reports_a_missing_prompt_file_before_it_waits_for_the_workers(tmp_path):
    """The source's preflight runs on a thread beside the workers' start (`Fleet._start_workers`): its
    error still stops the run, with exit 1, before the workers count as started."""
    missing = tmp_path / "nope.parquet"
    res = subprocess.run([RLGRAPH, "run", str(Path(__file__).parents[2] / "examples" / "grpo.py"), "-o",
                          str(tmp_path / "run"), "--steps", "2", f"data.path={missing}"], env=_env(),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"Error: prompt file {str(missing)!r} does not exist" in res.stderr
    assert "rlgraph: workers:" not in res.stderr and "model load" not in res.stderr, res.stderr


@pytest.mark.slow
def test_run_joins_an_existing_cluster_with_address(ray_cluster, tmp_path):
    # the test session's Ray stands in for a cluster; its TransferQueue (if a test started one)
    # allows no second controller, so this run keeps its columns in Ray's object store
    address = ray_cluster.get_runtime_context().gcs_address
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(tmp_path), "--steps", "1", "--address", address,
                          "dataplane.backend=ray"], env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["driver/payload_bytes"] == 0
    # the run left the cluster it joined running, with none of its actors
    assert ray_cluster.is_initialized()


@pytest.mark.slow
def test_killed_run_resumes_with_the_metrics_of_an_uninterrupted_one(tmp_path):
    """SIGKILL the whole run (driver, Ray, TransferQueue: everything in its process group) after
    step 1's checkpoint; `rlgraph run --resume` continues, and the later steps match an uninterrupted run
    (`steps` of them: a loaded machine may let the killed run go a few steps past step 1 before the kill lands)."""
    over = ["gen.n=3", "groups.actor.dp=2", "trainer.save_every=1"]
    steps = 8
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(full), "--steps", str(steps), *over], env=_env(), check=True,
                   capture_output=True, timeout=300)
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen([RLGRAPH, "run", PIPELINE, "-o", str(cut), "--steps", "500", *over], env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (cut / "checkpoints" / "step_1" / "meta.json").exists():
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()
            time.sleep(0.2)
        assert (cut / "checkpoints" / "step_1").is_dir(), "no checkpoint within 180 s"
        group = [proc] + psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started, and only it
        proc.wait(timeout=30)
        psutil.wait_procs([p for p in group if p.pid != proc.pid], timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    done = [json.loads(ln)["step"] for ln in (cut / "metrics.jsonl").read_text().splitlines()]
    assert done[:2] == [0, 1]  # maybe more: it was killed at some point after step 1's checkpoint
    assert done[-1] < steps - 1, f"the killed run had done steps {done} before the kill: nothing left to resume"
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(cut), "--steps", str(steps), "--resume", *over],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr

    def stable(path):
        recs = [json.loads(ln) for ln in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "load/", "driver/result"))}
                for r in recs]

    resumed, uninterrupted = stable(cut / "metrics.jsonl"), stable(full / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(steps))
    assert resumed == uninterrupted
