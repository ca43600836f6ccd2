"""The user docs run, so they cannot drift from the code.

Conventions in docs/quickstart.md, docs/dsl.md and docs/cli.md:

- a ```` ```python runnable ```` block is a complete example: it runs in a fresh namespace (from
  a scratch directory, with the repository root importable so ``examples.ppo`` works), must
  compile a pipeline and must assert something. Other ```` ```python ```` blocks are fragments
  and are only checked to parse.
- in a ```` ```bash ```` block of quickstart.md and cli.md, every line starting with ``rlgraph``
  or ``.venv/bin/rlgraph`` is run with the console script next to ``sys.executable``, in a
  scratch directory holding a copy of ``examples/``, as if one after another in document order
  (a ``compile -o build/ppo`` early in a file leaves ``build/ppo/plan.json`` for later lines;
  commands that touch no common path run in parallel). It must exit 0, or N when the line ends
  with ``# exits N``. Other lines (``bash scripts/setup.sh``) are shown, not run.
- a ```` ```bash slow ```` block holds training commands, which take minutes, so they are
  checked but not run. The convention is strict: every command in a slow block must be an
  ``rlgraph run`` or ``rlgraph export`` (which needs a run's checkpoints; nothing else may hide
  there), and every such command other than ``--help`` must be in a slow block. An export's
  options must parse. A slow command's options and overrides must
  parse (``rlgraph run``'s own parser, which starts nothing), and its target must pass
  ``rlgraph validate`` with those overrides (or, for a plan file, load with ``rlgraph
  describe``), in document order like the other commands. No ```` ```text output ```` block
  may follow a slow block: what a training run prints cannot be checked, so show it as a plain
  ```` ```text ```` block.
- a ```` ```text output ```` block is (an excerpt of) what the preceding bash block's commands
  print (stdout then stderr), or what the runnable python block right before it prints: its
  lines must appear in that output in the same order (trailing blanks ignored; a line ``...``
  marks lines left out).

Besides, every check code the compiler can report is listed in dsl.md, every option of every
command (``rlgraph run`` included) appears in cli.md, dsl.md's table of built-in stages matches
`rlgraph.ops.stages`, and operators.md lists every config key of the built-in stages.
"""

from __future__ import annotations

import os
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYTHON_DOCS = ("quickstart.md", "dsl.md", "cli.md")
SHELL_DOCS = ("quickstart.md", "cli.md")
# commands that take minutes (or need a run's output): only in ```bash slow blocks, never run here
SLOW_COMMANDS = ("run", "export")

_FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)\s*$")
_EXITS = re.compile(r"#\s*exits\s+(\d+)\s*$")
_SHELL_META = set("|<>;&$`")
_KNOWN_INFO = {"python": {"", "runnable"}, "text": {"", "output"}, "bash": {"", "slow"}, "": {""}}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # line of the first code line (1-based)
    lang: str
    info: str
    text: str


def blocks(doc: str) -> list[Block]:
    """Every top-level fenced block of `doc`, in order."""
    out: list[Block] = []
    lines = (DOCS / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        j = start
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{doc}:{i + 1}: code block is never closed"
        out.append(Block(doc, start + 1, m.group(1), m.group(2), "\n".join(lines[start:j])))
        i = j + 1
    return out


def _where(b: Block) -> str:
    return f"docs/{b.doc}:{b.line}"


# Python blocks -----------------------------------------------------------------------------------

def _python_blocks(runnable: bool) -> list[Block]:
    return [b for doc in PYTHON_DOCS for b in blocks(doc)
            if b.lang == "python" and (b.info == "runnable") == runnable]


def test_block_markers_are_known():
    """A typo such as ```python runable would silently skip a block."""
    for doc in PYTHON_DOCS:
        for b in blocks(doc):
            allowed = _KNOWN_INFO.get(b.lang)
            assert allowed is not None and b.info in allowed, (
                f"{_where(b)}: unknown code block marker ```{b.lang} {b.info}; use one of "
                f"{sorted(f'{k} {v}'.strip() for k, vs in _KNOWN_INFO.items() for v in vs)}")


def test_enough_runnable_examples():
    assert len([b for b in _python_blocks(True) if b.doc == "dsl.md"]) >= 8


def _shown_output(block: Block) -> Block | None:
    """The ```text output block right after `block`, if there is one."""
    later = [b for b in blocks(block.doc) if b.line > block.line]
    return later[0] if later and later[0].lang == "text" and later[0].info == "output" else None


@pytest.mark.parametrize("block", _python_blocks(True), ids=_where)
def test_runnable_python_block(block: Block, tmp_path, monkeypatch, capsys):
    assert "compile(" in block.text and "assert " in block.text, (
        f"{_where(block)}: a runnable example must compile a pipeline and assert something about it")
    monkeypatch.chdir(tmp_path)  # anything a block writes lands here
    monkeypatch.syspath_prepend(str(ROOT))  # `from examples.ppo import pipeline`
    # pad so that tracebacks give the line in the Markdown file
    code = compile("\n" * (block.line - 1) + block.text, str(DOCS / block.doc), "exec")
    exec(code, {"__name__": f"docs_{Path(block.doc).stem}_{block.line}"})
    shown = _shown_output(block)
    if shown is not None:
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
        missing = _follows(shown.text, printed)
        assert missing is None, f"{_where(shown)}: line {missing!r} is not in what the example printed:\n" + \
            "\n".join(printed)


@pytest.mark.parametrize("block", _python_blocks(False), ids=_where)
def test_python_fragment_parses(block: Block):
    compile("\n" * (block.line - 1) + block.text, str(DOCS / block.doc), "exec")


# Shell blocks ------------------------------------------------------------------------------------

def _rlgraph() -> str:
    script = Path(sys.executable).with_name("rlgraph")
    assert script.exists(), f"no console script at {script}; run `bash scripts/setup.sh`"
    return str(script)


@dataclass
class _Command:
    where: str
    text: str
    argv: list[str]
    expected: int  # exit status
    writes: str | None  # the -o/--output argument
    status: int | None = None
    output: tuple[str, ...] = ()


def _command(where: str, line: str, slow: bool = False) -> _Command | None:
    """The documented command on `line`, or None if it is not an rlgraph command. In a slow
    block, the command that checks it instead of running it (see the module docstring)."""
    text = line.strip()
    if not (text.startswith("rlgraph ") or text.startswith(".venv/bin/rlgraph ")):
        return None
    argv = shlex.split(text, comments=True)
    meta = [a for a in argv if _SHELL_META & set(a)]
    assert not meta, f"{where}: shell syntax {meta} is not supported in a documented command"
    m = _EXITS.search(text)
    is_slow = len(argv) > 1 and argv[1] in SLOW_COMMANDS and not {"-h", "--help"} & set(argv)
    if is_slow != slow:
        raise AssertionError(
            f"{where}: `{text}` takes minutes: put it in a ```bash slow block, which the doc tests check "
            f"but do not run" if is_slow else
            f"{where}: only `rlgraph {'/'.join(SLOW_COMMANDS)}` commands may be in a ```bash slow block; "
            f"move `{text}` to a ```bash block, where it is run")
    if slow:
        assert not m, f"{where}: a slow command is not run, so `# exits N` cannot be checked"
        return _slow_check(where, text, argv)
    writes = next((b for a, b in zip(argv, argv[1:]) if a in ("-o", "--output")), None)
    return _Command(where, text, [_rlgraph(), *argv[1:]], int(m.group(1)) if m else 0, writes)


def _slow_check(where: str, text: str, argv: list[str]) -> _Command:
    """`rlgraph run TARGET ... KEY=VALUE...`, checked without running: its options must parse
    (click's parser starts nothing), then `validate TARGET KEY=VALUE...` (or `describe PLAN`)
    must exit 0."""
    import click

    from rlgraph.cli import cli

    command = cli.commands[argv[1]]
    try:
        params = command.make_context(argv[1], argv[2:]).params
    except click.exceptions.Exit:
        raise AssertionError(f"{where}: `{text}` only prints help; put it in a ```bash block") from None
    except click.ClickException as e:
        raise AssertionError(f"{where}: `{text}` does not parse: {e.format_message()}") from None
    if argv[1] == "export":  # its RUN_DIR comes from a run the doc tests do not run: the options parse
        return _Command(where, f"{text}  (options parsed)", [_rlgraph(), "export", "--help"], 0, None)
    target, overrides = params["target"], list(params["overrides"])
    check = ["describe" if target.endswith(".json") else "validate", target, *overrides]
    return _Command(where, f"{text}  (checked as `rlgraph {' '.join(check)}`)", [_rlgraph(), *check], 0, None)


def _conflict(c: _Command, wave: list[_Command]) -> bool:
    """Whether `c` reads or writes a path that a command of `wave` writes, or the reverse."""
    def under(path: str, written: str | None) -> bool:
        return written is not None and (path == written or path.startswith(written.rstrip("/") + "/"))

    return any(under(a, d.writes) for d in wave for a in c.argv[1:]) or \
        any(under(a, c.writes) for d in wave for a in d.argv[1:])


def _run_all(commands: list[_Command], cwd: Path) -> None:
    """Run `commands` as if one after another, but in parallel where no path conflicts: a
    `describe build/ppo/plan.json` waits for the `compile ... -o build/ppo` before it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    waves: list[list[_Command]] = [[]]
    for c in commands:
        if _conflict(c, waves[-1]):
            waves.append([])
        waves[-1].append(c)
    for wave in waves:
        procs = [subprocess.Popen(c.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for c in wave]
        for c, p in zip(wave, procs):
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err += "\n(killed after 60 s)"
            c.status = p.returncode
            c.output = tuple(x.rstrip() for x in (out + err).splitlines())


def _follows(expected: str, output: list[str]) -> str | None:
    """None if the lines of `expected` occur in `output` in order, else the first one missing."""
    pos = 0
    for want in (w.rstrip() for w in expected.splitlines()):
        if not want.strip() or want.strip() == "...":
            continue
        while pos < len(output) and output[pos] != want:
            pos += 1
        if pos == len(output):
            return want
        pos += 1
    return None


@pytest.mark.parametrize("doc", SHELL_DOCS)
def test_shell_commands(doc: str, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    # each bash block's commands, and the output block after it (if any)
    steps: list[tuple[list[_Command], Block | None]] = []
    previous: Block | None = None
    for b in blocks(doc):
        if b.lang == "bash":
            slow = b.info == "slow"
            cmds = [_command(f"docs/{doc}:{b.line + k}", line, slow) for k, line in enumerate(b.text.splitlines())]
            cmds = [c for c in cmds if c is not None]
            assert cmds or not slow, f"{_where(b)}: a ```bash slow block without an rlgraph command"
            steps.append((cmds, None))
        elif b.lang == "text" and b.info == "output" and not (previous and previous.lang == "python"):
            assert previous is not None and previous.lang == "bash", (
                f"{_where(b)}: an output block must follow a bash block or a runnable python block")
            assert previous.info != "slow", (
                f"{_where(b)}: the commands of a ```bash slow block are not run, so their output cannot be "
                f"checked; show it in a plain ```text block")
            steps[-1] = (steps[-1][0], b)
        previous = b
    commands = [c for cmds, _ in steps for c in cmds]
    assert commands, f"docs/{doc} runs no rlgraph command"
    _run_all(commands, tmp_path)

    failures: list[str] = []
    for cmds, shown in steps:
        for c in cmds:
            if c.status != c.expected:
                failures.append(f"{c.where}: `{c.text}` exited {c.status}, the doc says {c.expected}\n"
                                + "\n".join(c.output))
            if any("Traceback" in line for line in c.output):
                failures.append(f"{c.where}: `{c.text}` printed a traceback\n" + "\n".join(c.output))
        if shown is not None:
            output = [line for c in cmds for line in c.output]
            missing = _follows(shown.text, output)
            if missing is not None:
                failures.append(f"{_where(shown)}: line {missing!r} is not in the output (in this order):\n"
                                + "\n".join(output))
    assert not failures, "\n\n".join(failures)


# Tables that must list everything ----------------------------------------------------------------

def test_every_check_code_is_documented():
    codes: set[str] = set()
    for pkg in ("graph", "ops"):
        for path in (ROOT / "rlgraph" / pkg).rglob("*.py"):
            codes |= set(re.findall(r'Problem\(\s*"([a-z][a-z-]*)"', path.read_text()))
    checks = (DOCS / "dsl.md").read_text().partition("\n## Checks\n")[2]
    documented = set(re.findall(r"^\| `([a-z][a-z-]*)` \|", checks, re.M))
    assert codes, "found no Problem codes in rlgraph/graph and rlgraph/ops"
    assert documented == codes, (f"undocumented in dsl.md: {sorted(codes - documented)}; "
                                 f"documented but never raised: {sorted(documented - codes)}")


def test_every_cli_option_is_documented():
    from rlgraph.cli import cli

    text = (DOCS / "cli.md").read_text()
    assert cli.commands, "rlgraph has no commands"
    for name in sorted(cli.commands):
        assert f"## `rlgraph {name}`" in text, f"docs/cli.md has no section for rlgraph {name}"
        for param in cli.commands[name].params:
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("-"):
                    assert f"`{opt}" in text, f"docs/cli.md does not mention `rlgraph {name} {opt}`"


def test_stage_table_matches_the_code():
    """Rows of dsl.md's table of built-in stages: | `name()` | granularity | group | inputs |
    outputs | namespace |; column names in backticks."""
    from rlgraph.ops import stages

    rows = re.findall(r"^\| `(\w+)\((?:\{[^)]*\})?\)` \|(.*)$", (DOCS / "dsl.md").read_text(), re.M)
    documented = {name for name, _ in rows}
    expected = {n for n in stages.__all__ if n not in ("COLUMNS", "SUMMARIES", "VALIDATION", "prompt_source")}
    assert documented == expected, f"stage table rows {sorted(documented)} vs rlgraph.ops.stages {sorted(expected)}"
    for name, rest in rows:
        cells = [c.strip() for c in rest.strip().strip("|").split("|")]
        granularity, group, inputs, outputs, namespace = cells[:5]
        # combine_rewards takes its score columns as an argument: the row documents the example's
        spec = (stages.combine_rewards({"rule_scores": 1.0, "rm_scores": 0.5}) if name == "combine_rewards"
                else getattr(stages, name)())
        names = lambda cell: set(re.findall(r"`(\w+)`", cell))  # noqa: E731
        assert granularity.split()[0] == spec.granularity, (name, granularity, spec.granularity)
        assert group.strip("`") == spec.group, (name, group, spec.group)
        assert names(inputs) == set(spec.inputs), (name, sorted(names(inputs) ^ set(spec.inputs)))
        assert names(outputs) == set(spec.outputs), (name, sorted(names(outputs) ^ set(spec.outputs)))
        assert namespace.strip("`") == spec.namespace, (name, namespace, spec.namespace)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_docs_resolve():
    """Relative links of the user docs point at files that exist, and at headings that exist."""
    for doc in PYTHON_DOCS:
        text = (DOCS / doc).read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = (DOCS / target).resolve() if target else DOCS / doc
            assert path.exists(), f"docs/{doc} links to {target!r}, which does not exist"
            if anchor and path.suffix == ".md":
                prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
                headings = re.findall(r"^#+ (.+)$", prose, re.M)
                assert anchor in {_anchor(h) for h in headings}, f"docs/{doc} links to {target}#{anchor}: no such heading"


def test_operators_doc_lists_every_builtin_config_key():
    from rlgraph.ops import stages

    text = (DOCS / "operators.md").read_text()
    specs = [stages.generate(), stages.reward(), stages.old_logprob(), stages.ref(), stages.values(),
             stages.advantage("gae"), stages.update_critic(), stages.update_actor(), stages.reward_model(),
             stages.combine_rewards({"rule_scores": 1.0, "rm_scores": 0.5}), stages.overlong_penalty(),
             stages.filter_groups()]
    keys = [f"data.{k}" for k in stages.prompt_source().params]
    keys += [f"{s.namespace}.{k}" for s in specs for k in s.params]
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"docs/operators.md does not list {missing}"


def test_quickstart_and_examples_match_the_measured_runs():
    """The step counts, sample output and rewards the quick start and docs/examples.md quote are
    those of the examples today: their trainer.steps defaults and the seed-0 runs recorded by
    benchmarks/learning.py (benchmarks/results/learning.json; rerun it after changing an example)."""
    from benchmarks.common import fmt
    from benchmarks.learning import EXAMPLES, RESULTS, SEEDS, default_steps

    steps = {ex: default_steps(ex) for ex in EXAMPLES}
    runs = {(r["example"], r["seed"]): r for r in json.loads(RESULTS.read_text())}
    assert set(runs) == {(ex, s) for ex in EXAMPLES for s in SEEDS}, "learning.json lacks runs: rerun the benchmark"
    for (ex, seed), r in runs.items():
        assert r["steps"] == steps[ex], f"learning.json ran {ex} for {r['steps']} steps; it has {steps[ex]} now"
        assert r["passed"], f"{ex} seed {seed}: {r['gain']:+.3f} in {r['wall_s'] / 60:.1f} min misses +0.2 in 10 min"

    quick = (DOCS / "quickstart.md").read_text()
    assert f"The `trainer.steps` steps run: {steps['grpo']} for GRPO, {steps['ppo']} for PPO" in quick
    grpo, ppo = runs[("grpo", 0)], runs[("ppo", 0)]
    last = steps["grpo"] - 1
    assert f"rlgraph: running steps 0..{last}" in quick
    for k, v in grpo["shown"].items():
        line = (f"step {k}/{last} score/mean={v['score/mean']:.4g} reward/mean={v['reward/mean']:.4g} "
                f"response_length/mean={v['response_length/mean']:.4g} ")
        assert line in quick, f"quickstart.md's sample output lacks {line!r} (the seed-0 GRPO run's step {k})"
    claim = (f"it goes from about {grpo['first10']:.2f} over the\nfirst 10 steps to about {grpo['last10']:.2f} over "
             f"the last 10 (PPO: {ppo['first10']:.2f} to {ppo['last10']:.2f})")
    assert claim in quick, f"quickstart.md should say: {claim!r}"

    examples = (DOCS / "examples.md").read_text()
    for ex, n in steps.items():
        for m in re.finditer(rf"`{ex}\.py`[^|\n]*\| (\d+) \|", examples):
            assert int(m.group(1)) == n, f"examples.md gives {ex}.py {m.group(1)} steps; it has {n}"
    for (ex, seed), r in runs.items():
        assert f"| `{ex}.py` | {steps[ex]} | {seed} | {fmt(r['first3'])} | {fmt(r['last3'])} |" in examples, (ex, seed)
