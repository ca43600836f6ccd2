"""One runner for every benchmark; each rewrites its own section of docs/performance.md.

    .venv/bin/python -m benchmarks.run all              # everything (about 15 minutes on 2 cores)
    .venv/bin/python -m benchmarks.run overlap scale    # some of them
    .venv/bin/python -m benchmarks.run all --quick      # tiny sizes (what tests/test_benchmarks.py runs)
    .venv/bin/python -m benchmarks.run padding --doc /tmp/perf.md   # write elsewhere
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TQ_NUM_THREADS", "2")

NAMES = ["overlap", "real", "traffic", "dataplane", "padding", "scale", "rollout", "staleness", "leaks", "locality",
         "trl_peer", "overhead", "rowloops", "logprob_memory", "packing", "real_shape", "startup"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", choices=NAMES + ["all"], help="benchmarks to run")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--doc", type=Path, default=None, help="markdown file to update (default docs/performance.md)")
    p.add_argument("--steps", type=int, default=None, help="steps per schedule (overlap, real) or per k (staleness: the real example)")
    args = p.parse_args(argv)
    from benchmarks import common

    doc = args.doc or common.DOC
    names = NAMES if "all" in args.names else [n for n in NAMES if n in args.names]
    if "all" in args.names and importlib.util.find_spec("trl") is None:
        print("== trl_peer: skipped (TRL is not installed: pip install 'rlgraph[bench]')", flush=True)
        names.remove("trl_peer")
    svg = None if args.doc else common.ROOT / "docs" / "img" / "overlap.svg"
    try:
        for name in names:
            t0 = time.time()
            print(f"== {name}", flush=True)
            mod = importlib.import_module(f"benchmarks.{name}")
            sub_argv = [name] + (["--quick"] if args.quick else []) + (
                [f"--steps={args.steps}"] if args.steps and name in ("overlap", "real", "staleness", "leaks", "locality", "overhead")
                else [])
            kw = {"quick": args.quick, "argv": sub_argv}
            if name in ("overlap", "real", "staleness", "leaks", "locality", "overhead") and args.steps:
                kw["steps"] = args.steps
            if name == "overlap":
                kw["svg"] = svg if svg is not None else Path(doc).with_name("overlap.svg")
            if name == "trl_peer":
                kw["svg"] = (common.ROOT / "docs" / "img" / "trl_peer.svg") if not args.doc \
                    else Path(doc).with_name("trl_peer.svg")
            section = mod.run(**kw)
            common.write_section(section, doc)
            print(f"== {name}: {time.time() - t0:.0f}s, written to {doc}", flush=True)
        common.write_findings(doc)
    finally:
        common.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
