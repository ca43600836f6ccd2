"""Shared pieces of the benchmarks: tables, the docs/performance.md sections, Ray and the data plane.

Every benchmark returns a `Section` (a title, a few lines of text, tables); `write_section`
replaces the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->`` in the
doc, so re-running one benchmark keeps the others' tables.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
RAY_CPUS = 64  # logical CPUs of the benchmarks' local Ray: sleeping ops hold them, not real cores


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    title: str = ""

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"row of {len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))

    def cells(self) -> list[list[str]]:
        return [[fmt(v) for v in r] for r in self.rows]

    def markdown(self) -> str:
        out = []
        if self.title:
            out.append(f"**{self.title}**\n")
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "|".join("---" for _ in self.columns) + "|")
        out += ["| " + " | ".join(r) + " |" for r in self.cells()]
        return "\n".join(out)

    def print(self) -> None:
        try:
            from rich.console import Console
            from rich.table import Table as RichTable

            t = RichTable(title=self.title or None)
            for c in self.columns:
                t.add_column(c, justify="right")
            for r in self.cells():
                t.add_row(*r)
            Console(width=max(100, min(200, 14 * len(self.columns)))).print(t)
        except ImportError:  # pragma: no cover
            print(self.markdown())


@dataclass
class Section:
    name: str  # marker name: overlap, real, traffic, dataplane, padding, scale
    title: str
    intro: str  # markdown, before the tables
    tables: list[Table]
    notes: str = ""  # markdown, after the tables
    command: str = ""

    def markdown(self) -> str:
        parts = [f"## {self.title}", "", self.intro.strip(), "",
                 f"Reproduce: `{self.command}`  ", f"Measured: {time.strftime('%Y-%m-%d %H:%M')}, "
                 f"{machine()}.", ""]
        for t in self.tables:
            parts += [t.markdown(), ""]
        if self.notes.strip():
            parts += [self.notes.strip(), ""]
        return "\n".join(parts)


def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "-"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 100:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.3g}" if a < 1 else f"{v:.2f}"
        return f"{v:.2e}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def machine() -> str:
    cores = os.cpu_count() or 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem = float("nan")
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} GPU ({torch.cuda.get_device_name(0)})"
    except Exception:  # pragma: no cover
        pass
    return (f"{cores} CPU cores, {mem:.0f} GiB RAM, {gpu}, shared with other work (noisy); "
            f"Python {platform.python_version()}, {platform.machine()}")


def command_line(argv: Sequence[str] | None = None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in args if not a.startswith("--doc")]
    return ".venv/bin/python -m benchmarks.run " + " ".join(shlex.quote(a) for a in args)


MARK = "<!-- bench:{}:{} -->"
ORDER = ["overlap", "real", "traffic", "dataplane", "padding", "scale", "rollout", "staleness", "leaks", "locality", "trl",
         "findings"]
HEADER = """# Performance

Every speed claim of rlgraph has a benchmark under `benchmarks/` that measures its comparison in
one run and writes its table here. The machine is shared and noisy, so read the ratios (measured
side by side, interleaved where possible), not the absolute times. One runner regenerates
everything or one section (the other sections are kept):

```bash
.venv/bin/python -m benchmarks.run all            # every section (about 15 minutes on 2 cores)
.venv/bin/python -m benchmarks.run overlap        # or: real, traffic, dataplane, padding, scale, rollout, staleness, leaks, locality, trl_peer, overhead, rowloops, logprob_memory, packing, real_shape, startup
.venv/bin/python -m benchmarks.run all --quick    # tiny sizes, a smoke test (what the tests run)
```

"""


def write_section(section: Section, doc: Path = DOC) -> Path:
    """Replace (or add) `section` between its markers in `doc`, keeping the sections' order."""
    doc = Path(doc)
    text = doc.read_text() if doc.exists() else HEADER
    start, end = MARK.format(section.name, "start"), MARK.format(section.name, "end")
    block = f"{start}\n{section.markdown()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        # insert before the first later section that exists, else append
        later = [n for n in ORDER[ORDER.index(section.name) + 1:] if MARK.format(n, "start") in text] \
            if section.name in ORDER else []
        if later:
            at = text.index(MARK.format(later[0], "start"))
            text = text[:at] + block + "\n\n" + text[at:]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


# --------------------------------------------------------------------------- Ray and planes
_planes: dict[str, Any] = {}
_started_ray = False


def ensure_ray(num_cpus: int = RAY_CPUS) -> None:
    """A local Ray on 127.0.0.1 with `num_cpus` logical CPUs (reuses one already running)."""
    global _started_ray
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("TQ_NUM_THREADS", "2")
    import ray

    if ray.is_initialized():
        return
    from rlgraph.runtime.cluster import force_loopback

    force_loopback()
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    _started_ray = True


def plane(kind: str) -> Any:
    """A data plane shared by every benchmark of this process ('transferqueue' or 'ray')."""
    if kind not in _planes:
        ensure_ray()
        from rlgraph.runtime.dataplane import (RayObjectStoreDataPlane, TransferQueueConfig,
                                               TransferQueueDataPlane)

        if kind == "transferqueue":
            _planes[kind] = TransferQueueDataPlane.start(TransferQueueConfig(num_storage_units=1, op_timeout_s=120))
        elif kind == "ray":
            _planes[kind] = RayObjectStoreDataPlane.start(op_timeout_s=120)
        else:
            raise ValueError(kind)
    return _planes[kind]


def set_planes(**planes: Any) -> None:
    """Use already started planes (a test session's) instead of starting new ones."""
    _planes.update({k: v for k, v in planes.items() if v is not None})


def shutdown() -> None:
    global _started_ray
    for p in _planes.values():
        try:
            p.close()
        except Exception:
            pass
    _planes.clear()
    if _started_ray:
        import ray

        ray.shutdown()
        _started_ray = False


def quiet_runner_options(out_dir: Path, **kw: Any) -> Any:
    from rlgraph.runtime.runner import RunOptions

    # a benchmark run replaces the last one in its directory
    return RunOptions(out_dir=Path(out_dir), timeout_s=kw.pop("timeout_s", 300.0), overwrite=kw.pop("overwrite", True),
                      **kw)


FINDINGS = ROOT / "benchmarks" / "findings.md"


def write_findings(doc: Path = DOC) -> None:
    """The hand-written analysis (benchmarks/findings.md) as the last section of the doc."""
    if FINDINGS.exists():
        write_section(Section("findings", "Findings", FINDINGS.read_text(), [], command="(analysis of the tables above)"),
                      doc)


# ---------------------------------------------------------------------------- memory of one process
def qwen25_05b() -> dict[str, Any]:
    """Qwen2.5-0.5B's architecture (rlgraph.ops.models.REAL_SHAPES), for random-initialised models."""
    from rlgraph.ops.models import REAL_SHAPES

    return dict(REAL_SHAPES["qwen2.5-0.5b"])


def reset_peak_rss() -> int:
    """Reset this process's peak resident memory (VmHWM) to its current size; returns that size in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def peak_rss(pid: int | str = "self") -> int:
    """The peak resident memory (VmHWM) of a process since it started or since `reset_peak_rss`, in bytes."""
    return _status_kb("VmHWM", pid) * 1024


def _status_kb(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def run_child(module: str, args: Sequence[str], timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``python -m <module> --child ARGS`` (one measurement in a fresh process, so nothing another one
    allocated is counted) and return the JSON object it prints last."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, "--child", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
