"""Issue 25 item 6: start-up of `rlgraph run examples/grpo.py`, phase by phase.

Each run is `rlgraph run examples/grpo.py --steps 2` in a process of its own (the policy prepared
beforehand, as a user's second run finds it). Runs alternate between rlgraph as it is, rlgraph
with TransferQueue's storage unit and the data source in processes of their own
(``dataplane.host_unit=false dataplane.host_source=false``; by default both run in TransferQueue's
controller's process), rlgraph with ``RLGRAPH_LEAN_TENSORDICT=0`` (tensordict imported as it
is, with `torch._dynamo`: what every data-plane process paid before
`rlgraph.runtime.dataplane.lean`), rlgraph with ``RLGRAPH_IMPORT_CACHE=0`` (transformers reads its
`models` sources to build its import table in every process that loads a tokenizer or a model:
what they paid before `rlgraph.imports`) and rlgraph with ``RLGRAPH_RAY_HEAD=full`` (Ray started as
it is: its dashboard API server, autoscaler monitor, log monitor and full dashboard agent, and
its own one-second wait for the node; `rlgraph.runtime.cluster.lean_head`), so the machine's noise
falls on all alike. The caches of a user's second run (the tokenizer's class, transformers' import
table) are written beforehand. The table gives
medians over the runs of: start-up (process start to the first step's start, as in the TRL
comparison), each phase line the run prints, and the CPU time the whole machine spent until the
first step's end (all processes: Ray's, the workers', TQ's; from /proc/stat), which shows whether
start-up is bound by the CPU. The second table splits that CPU time by process (each process's
user and system time at step 0's end, from /proc, sampled every 0.1 s until then; the processes a
run starts, by kind).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

PHASES = {  # phase -> the pattern of its line (seconds in the first group)
    "Ray": r"Ray: .*\(([\d.]+)s\)",
    "workers started": r"workers: .*\(([\d.]+)s\)",
    "data plane (beside the workers)": r"data plane: .*\(([\d.]+)s, beside",
    "models loaded, after the workers": r"model load: .*\(([\d.]+)s\)",
}
OWN = "unit and source on their own"
SCANNED = "transformers' table scanned"
FULL_RAY = "Ray as it is"
VARIANTS = {  # name -> (environment, config overrides)
    "rlgraph": ({"RLGRAPH_LEAN_TENSORDICT": "1"}, []),
    OWN: ({"RLGRAPH_LEAN_TENSORDICT": "1"}, ["dataplane.host_unit=false", "dataplane.host_source=false"]),
    "tensordict as it is": ({"RLGRAPH_LEAN_TENSORDICT": "0"}, []),
    SCANNED: ({"RLGRAPH_LEAN_TENSORDICT": "1", "RLGRAPH_IMPORT_CACHE": "0"}, []),
    FULL_RAY: ({"RLGRAPH_LEAN_TENSORDICT": "1", "RLGRAPH_RAY_HEAD": "full"}, []),
}
TIMEOUT_S = 300  # one run, start-up and two steps


def _busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all cores (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


# what each process of a run is, from its command line (first match): the per-process CPU table
KINDS = (("policy worker", ("ray::GroupWorker",)), ("data source", ("ray::SourceWorker",)),
         ("TransferQueue controller (and the unit and the source it hosts)", ("ray::TransferQueueController",)),
         ("TransferQueue storage unit", ("ray::SimpleStorageUnit",)),
         ("Ray: dashboard and runtime-env agents (and the API server if started)",
          ("dashboard.py", "ray::DashboardAgent", "ray::RuntimeEnvAgent")),
         ("Ray: log monitor and autoscaler monitor", ("log_monitor.py", "autoscaler/_private/monitor.py")),
         ("Ray: GCS and raylet", ("gcs_server", "raylet/raylet")))


OTHER = "other (the reaper, graphviz, short helpers)"


class _ProcessCPU:
    """CPU seconds of every process started after it was made, by kind (`KINDS`; the driver by pid),
    read from /proc: each process's latest user + system time seen, so one that exited keeps its last."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.before = set(self._pids())
        self.seen: dict[int, tuple[str, float]] = {}

    @staticmethod
    def _pids() -> list[int]:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]

    def sample(self) -> None:
        for pid in self._pids():
            if pid in self.before:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            self.seen[pid] = (cmd or self.seen.get(pid, ("", 0.0))[0], (int(fields[11]) + int(fields[12])) / self.tick)

    def by_kind(self, driver: int) -> dict[str, tuple[int, float]]:
        """Kind -> (processes, CPU seconds)."""
        out: dict[str, list[float]] = {}
        for pid, (cmd, cpu) in self.seen.items():
            kind = "driver (rlgraph run)" if pid == driver else next(
                (name for name, marks in KINDS if any(m in cmd for m in marks)), OTHER)
            out.setdefault(kind, []).append(cpu)
        return {k: (len(v), sum(v)) for k, v in out.items()}


def _prepare() -> None:
    from benchmarks.trl_peer import _model

    model = _model()
    # a second run's caches: the tokenizer's class and transformers' import table (`rlgraph.imports`)
    warm = f"import rlgraph; from rlgraph.ops.models import load_tokenizer; load_tokenizer({model!r})"
    subprocess.run([str(common.ROOT / ".venv" / "bin" / "python"), "-c", warm], check=True, timeout=TIMEOUT_S,
                   env={**os.environ, "RLGRAPH_IMPORT_CACHE": "1"})


def _one(env: dict[str, str], args: list[str], out: Path, steps: int) -> dict[str, Any]:
    cmd = [str(common.ROOT / ".venv" / "bin" / "rlgraph"), "run", str(common.ROOT / "examples" / "grpo.py"), "-o",
           str(out), "--overwrite", "--steps", str(steps), *args]
    metrics = out / "metrics.jsonl"
    procs = _ProcessCPU()
    t0, busy0 = time.time(), _busy_s()
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})
        first_end = busy_at_first = None
        polls = 0
        while proc.poll() is None:
            if time.time() - t0 > TIMEOUT_S:
                proc.kill()
                raise RuntimeError(f"rlgraph run did not end within {TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            if first_end is None and metrics.is_file() and metrics.read_bytes().count(b"\n") >= 1:
                first_end, busy_at_first = time.time(), _busy_s()
                procs.sample()  # each process's CPU at step 0's end
            elif first_end is None and polls % 5 == 0:  # every 0.1 s: processes that end early keep their last
                procs.sample()
            polls += 1
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"rlgraph run failed:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if first_end is None:
        first_end, busy_at_first = time.time(), _busy_s()
    got = {"start-up": first_end - t0 - records[0]["timing/step_s"], "cpu": busy_at_first - busy0,
           "wall to step 0's end": first_end - t0, "processes": procs.by_kind(proc.pid)}
    for name, pattern in PHASES.items():
        m = re.search(pattern, text)
        got[name] = float(m.group(1)) if m else float("nan")
    return got


def run(quick: bool = False, argv: list[str] | None = None, runs: int = 3, **_: Any) -> common.Section:
    _prepare()
    runs = 1 if quick else runs
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            for name, (env, args) in VARIANTS.items():
                got[name].append(_one(env, args, Path(tmp) / f"{name.replace(' ', '_')}-{r}", steps=2))
                print(f"  {name} run {r}: start-up {got[name][-1]['start-up']:.1f} s", flush=True)
    keys = ["start-up", *PHASES, "wall to step 0's end", "cpu"]
    table = common.Table(["", *VARIANTS], title=f"`rlgraph run examples/grpo.py`, median of {runs} alternating runs")
    for k in keys:
        label = {"cpu": "CPU seconds, all processes, to step 0's end", "start-up": "start-up to the first step (s)"}.get(
            k, f"{k} (s)")
        table.add(label, *[statistics.median(x[k] for x in got[name]) for name in VARIANTS])
    table.print()
    kinds = [k for k in ["driver (rlgraph run)", *(name for name, _ in KINDS), OTHER]
             if any(k in x["processes"] for x in got["rlgraph"])]
    per_process = common.Table(["process", "processes", "CPU seconds to step 0's end"],
                               title="Where the CPU goes: rlgraph's processes, median of its runs")
    cpu_of = {k: statistics.median(x["processes"].get(k, (0, 0.0))[1] for x in got["rlgraph"]) for k in kinds}
    for k in kinds:
        per_process.add(k, statistics.median(x["processes"].get(k, (0, 0.0))[0] for x in got["rlgraph"]), cpu_of[k])
    per_process.print()
    spent = ", ".join(f"{k} {cpu:.1f} s" for k, cpu in cpu_of.items())
    hosted, own, full, scanned, ray_full = (statistics.median(x["start-up"] for x in got[n]) for n in VARIANTS)
    cpu_own = statistics.median(x["cpu"] for x in got[OWN])
    cores = os.cpu_count() or 1
    cpu = statistics.median(x["cpu"] for x in got["rlgraph"])
    wall = statistics.median(x["wall to step 0's end"] for x in got["rlgraph"])
    notes = (f"Start-up {hosted:.1f} s against {own:.1f} s with TransferQueue's storage unit and the data source in "
             f"processes of their own ({cpu:.0f} against {cpu_own:.0f} CPU seconds), and {full:.1f} s with tensordict "
             f"imported as it is; {scanned:.1f} s with transformers' import table built by scanning its sources in "
             f"each process, and {ray_full:.1f} s with Ray started as it is. The machine was busy {cpu:.0f} CPU seconds until step 0 ended, "
             f"{cpu / (wall * cores):.0%} of its {cores} cores over those {wall:.1f} s: start-up is bound by the CPU "
             f"(each Python process of the run imports torch; the actor imports transformers' model code, the driver "
             f"and the controller, which hosts the data source, only their tokenizers), so it shortens "
             f"by what the processes stop doing, not by starting them in another order. "
             f"By process: {spent}. "
             f"Target (issue 25): 8 s.")
    return common.Section("startup", "17. Start-up, phase by phase", __doc__.split("\n\n", 1)[1], [table, per_process],
                          notes,
                          common.command_line(argv or ["startup"]))


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv, argv=sys.argv[1:])
