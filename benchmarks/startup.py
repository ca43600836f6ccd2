"""Issue 25 item 6: start-up of `rlgraph run examples/grpo.py`, phase by phase.

Each run is `rlgraph run examples/grpo.py --steps 2` in a process of its own (the policy prepared
beforehand, as a user's second run finds it). Runs alternate between rlgraph as it is, rlgraph
with ``RLGRAPH_LEAN_TENSORDICT=0`` (tensordict imported as it is, with `torch._dynamo`: what every
data-plane process paid before `rlgraph.runtime.dataplane.lean`) and rlgraph with
``RLGRAPH_TQ_EARLY_UNITS=0`` (TransferQueue's storage units started once its controller is up, as
``tq.init`` orders them, not beside it), so the machine's noise falls on all alike. The table gives medians over the runs of: start-up (process start to the first
step's start, as in the TRL comparison), each phase line the run prints, and the CPU time the
whole machine spent until the first step's end (all processes: Ray's, the workers', TQ's; from
/proc/stat), which shows whether start-up is bound by the CPU.
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
VARIANTS = {"rlgraph": {"RLGRAPH_LEAN_TENSORDICT": "1"}, "tensordict as it is": {"RLGRAPH_LEAN_TENSORDICT": "0"},
            "TQ's units after its controller": {"RLGRAPH_TQ_EARLY_UNITS": "0"}}
TIMEOUT_S = 300  # one run, start-up and two steps


def _busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all cores (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


def _prepare() -> None:
    from benchmarks.trl_peer import _model

    _model()


def _one(env: dict[str, str], out: Path, steps: int) -> dict[str, Any]:
    cmd = [str(common.ROOT / ".venv" / "bin" / "rlgraph"), "run", str(common.ROOT / "examples" / "grpo.py"), "-o",
           str(out), "--overwrite", "--steps", str(steps)]
    metrics = out / "metrics.jsonl"
    t0, busy0 = time.time(), _busy_s()
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})
        first_end = busy_at_first = None
        while proc.poll() is None:
            if time.time() - t0 > TIMEOUT_S:
                proc.kill()
                raise RuntimeError(f"rlgraph run did not end within {TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            if first_end is None and metrics.is_file() and metrics.read_bytes().count(b"\n") >= 1:
                first_end, busy_at_first = time.time(), _busy_s()
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"rlgraph run failed:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if first_end is None:
        first_end, busy_at_first = time.time(), _busy_s()
    got = {"start-up": first_end - t0 - records[0]["timing/step_s"], "cpu": busy_at_first - busy0,
           "wall to step 0's end": first_end - t0}
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
            for name, env in VARIANTS.items():
                got[name].append(_one(env, Path(tmp) / f"{name.replace(' ', '_')}-{r}", steps=2))
                print(f"  {name} run {r}: start-up {got[name][-1]['start-up']:.1f} s", flush=True)
    keys = ["start-up", *PHASES, "wall to step 0's end", "cpu"]
    table = common.Table(["", *VARIANTS], title=f"`rlgraph run examples/grpo.py`, median of {runs} alternating runs")
    for k in keys:
        label = {"cpu": "CPU seconds, all processes, to step 0's end", "start-up": "start-up to the first step (s)"}.get(
            k, f"{k} (s)")
        table.add(label, *[statistics.median(x[k] for x in got[name]) for name in VARIANTS])
    table.print()
    lean, full, late = (statistics.median(x["start-up"] for x in got[n]) for n in VARIANTS)
    cores = os.cpu_count() or 1
    cpu = statistics.median(x["cpu"] for x in got["rlgraph"])
    wall = statistics.median(x["wall to step 0's end"] for x in got["rlgraph"])
    notes = (f"Start-up {lean:.1f} s against {full:.1f} s with tensordict imported as it is, and {late:.1f} s with "
             f"TransferQueue's storage units started after its controller (TQ's own order). The machine was busy "
             f"{cpu:.0f} CPU seconds until step 0 ended, {cpu / (wall * cores):.0%} of its {cores} cores over those "
             f"{wall:.1f} s: start-up is bound by the CPU (seven Python processes each import torch; the actor "
             f"imports transformers' model code, the driver, data source and reward worker only its tokenizers), so it "
             f"shortens by what the processes stop doing, not by starting them in another order. "
             f"Target (issue 25): 8 s.")
    return common.Section("startup", "17. Start-up, phase by phase", __doc__.split("\n\n", 1)[1], [table], notes,
                          common.command_line(argv or ["startup"]))


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv, argv=sys.argv[1:])
