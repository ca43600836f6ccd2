"""Running generated code safely: a separate Python process, locked down before the code runs.

`run_python(code)` writes the code to a fresh scratch directory and starts ``python -I`` on a
small bootstrap that locks its own process down and only then runs the code:

- **limits** (``setrlimit``): CPU seconds, address space (memory), file size (its output files
  too), open files, no core dumps; a wall-clock limit is kept by the parent, which kills the
  process group;
- **no new processes, no network, no signals out, no exec** (a seccomp filter, x86_64 and
  aarch64): ``fork``/``vfork``/``clone`` of a process and ``clone3`` fail, as do ``socket``,
  ``execve``, ``kill``, ``ptrace`` and the namespace and mount calls;
- **files** (Landlock, Linux 5.13+): read-only access to the Python installation and system
  libraries, read-write to the scratch directory, nothing else; where Landlock is not available,
  an audit hook refuses ``open`` outside those directories (weaker: code that reaches the C
  level could pass it), and `RunResult.isolation` says which layers held;
- **network**, twice: Landlock's TCP rules (ABI 4+) besides the seccomp filter.

Whatever the code does, the caller gets a `RunResult` (status ``ok``, ``error``, ``timeout``,
``cpu_limit``, ``memory``, ``output_limit``), never an exception from the code. The same
function backs the built-in code tool (`python`) and the code reward (`code_score`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunResult", "SandboxLimits", "code_score", "python", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 8192
    """stdout and stderr kept each (the rest is cut; the file limit stops a flood)"""
    file_mb: int = 16
    """largest file the code may write (its output files included)"""
    open_files: int = 64
    landlock: bool = True
    """False: leave Landlock out (the audit-hook fallback alone), for a kernel where it misbehaves"""


@dataclass(frozen=True)
class RunResult:
    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    truncated: bool = False
    isolation: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The bootstrap runs in the child before the code. It takes its settings as JSON in argv[1].
_BOOT = r'''
import ctypes, json, os, resource, signal, struct, sys
cfg = json.loads(sys.argv[1])
iso = {"seccomp": False, "landlock": False, "network": False}
def lim(r, v):
    try: resource.setrlimit(r, (v, v))
    except (ValueError, OSError): pass
cpu = int(cfg["cpu_s"]) or 1
try: resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
except (ValueError, OSError): pass
lim(resource.RLIMIT_AS, cfg["memory"]); lim(resource.RLIMIT_FSIZE, cfg["file"])
lim(resource.RLIMIT_NOFILE, cfg["open_files"]); lim(resource.RLIMIT_CORE, 0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails, not the process
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: needed by both filters below, unprivileged
# ---- Landlock: files (and TCP on ABI >= 4, signals on ABI >= 6)
abi = libc.syscall(444, None, 0, 1) if cfg["landlock"] else -1
if abi >= 1:
    fs = (1 << 13) - 1
    if abi >= 2: fs |= 1 << 13
    if abi >= 3: fs |= 1 << 14
    if abi >= 5: fs |= 1 << 15
    net = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0
    attr = struct.pack("<QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    rs = libc.syscall(444, buf, len(attr), 0)
    if rs >= 0:
        read = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
        ok = True
        for path, access in [(p, read) for p in cfg["read"]] + [(cfg["scratch"], fs)]:
            try: fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError: continue
            isdir = os.path.isdir(path)
            pb = ctypes.create_string_buffer(struct.pack("<Qi", access if isdir else access & ((1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)), fd), 12)
            if libc.syscall(445, rs, 1, pb, 0) != 0: ok = False
            os.close(fd)
        if ok and libc.syscall(446, rs, 0) == 0:
            iso["landlock"] = True
            iso["network"] = net != 0
        os.close(rs)
if not iso["landlock"]:  # the weaker fallback: refuse opens outside the allowed directories
    allowed = [os.path.realpath(p) for p in cfg["read"]] + [os.path.realpath(cfg["scratch"])]
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            p = os.path.realpath(os.fsdecode(args[0]))
            if not any(p == a or p.startswith(a + os.sep) for a in allowed):
                raise PermissionError(f"sandbox: {p} is outside the code's directory")
        elif event in ("socket.__new__", "os.fork", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "ctypes.dlopen"):
            raise PermissionError(f"sandbox: {event} is not allowed")
    sys.addaudithook(hook)
# ---- seccomp: no processes, sockets, exec, signals, tracing, namespaces
arch = os.uname().machine
NR = {"x86_64": dict(fork=57, vfork=58, clone=56, clone3=435, socket=41, socketpair=53, execve=59, execveat=322, kill=62,
                     tkill=200, tgkill=234, ptrace=101, unshare=272, setns=308, mount=165, chroot=161, bpf=321,
                     process_vm_writev=311, pidfd_send_signal=424, perf_event_open=298),
      "aarch64": dict(clone=220, clone3=435, socket=198, socketpair=199, execve=221, execveat=281, kill=129, tkill=130,
                      tgkill=131, ptrace=117, unshare=97, setns=268, mount=40, chroot=51, bpf=280,
                      process_vm_writev=271, pidfd_send_signal=424, perf_event_open=241)}.get(arch)
AUDIT = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(arch)
if NR:
    def ins(code, k, jt=0, jf=0): return struct.pack("<HBBI", code, jt, jf, k)
    LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
    ALLOW, EPERM, ENOSYS, KILL = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    prog = [ins(LD, 4), ins(JEQ, AUDIT, 1, 0), ins(RET, KILL), ins(LD, 0)]
    plain = [n for k, n in NR.items() if k not in ("clone", "clone3")]
    for n in plain:
        prog += [ins(JEQ, n, 0, 1), ins(RET, EPERM)]
    prog += [ins(JEQ, NR["clone3"], 0, 1), ins(RET, ENOSYS)]  # glibc then falls back to clone
    # clone: threads (CLONE_THREAD, 0x10000, in the first argument) are allowed; new processes are not
    prog += [ins(JEQ, NR["clone"], 0, 3), ins(LD, 16), ins(JSET, 0x10000, 1, 0), ins(RET, EPERM), ins(RET, ALLOW)]
    code = b"".join(prog)
    filt = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) == 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        iso["seccomp"] = True
        iso["network"] = True
with open(cfg["isolation"], "w") as f:
    f.write(json.dumps(iso))
del ctypes, libc, json, struct, resource
sys.argv = ["main.py"]
__file__ = "main.py"
code = compile(open("main.py").read(), "main.py", "exec")
g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
exec(code, g)
'''


def _readable() -> list[str]:
    """Where the child may read: the Python installation and the system's libraries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache",
             str(Path(sys.executable).resolve().parent), str(Path(sys.executable).resolve().parents[1])}
    paths |= {p for p in sys.path if p and Path(p).is_dir() and "site-packages" in p}
    return sorted(p for p in paths if Path(p).exists())


def _head(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> RunResult:
    """Run `code` in a locked-down child process (see the module doc); never raises for the code."""
    limits = limits or SandboxLimits()
    scratch = Path(tempfile.mkdtemp(prefix="rlgraph_sandbox_"))
    t0 = time.monotonic()
    try:
        (scratch / "main.py").write_text(code)
        (scratch / "stdin.txt").write_text(stdin)
        iso_file = scratch / ".isolation.json"
        cfg = {"cpu_s": limits.cpu_s, "memory": limits.memory_mb << 20, "file": limits.file_mb << 20,
               "open_files": limits.open_files, "landlock": limits.landlock, "read": _readable(), "scratch": str(scratch), "isolation": str(iso_file)}
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "PYTHONIOENCODING": "utf-8",
               "OMP_NUM_THREADS": "1"}
        with open(scratch / "stdout.txt", "wb") as out, open(scratch / "stderr.txt", "wb") as err, \
                open(scratch / "stdin.txt", "rb") as inp:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, json.dumps(cfg)], cwd=scratch, env=env,
                                    stdin=inp, stdout=out, stderr=err, start_new_session=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                rc = proc.wait()
        seconds = time.monotonic() - t0
        stdout, cut_out = _head(scratch / "stdout.txt", limits.output_bytes)
        stderr, cut_err = _head(scratch / "stderr.txt", limits.output_bytes)
        try:
            isolation = json.loads(iso_file.read_text())
        except (OSError, ValueError):
            isolation = {}
        full = (scratch / "stdout.txt").stat().st_size >= (limits.file_mb << 20) or \
            (scratch / "stderr.txt").stat().st_size >= (limits.file_mb << 20)
        status = _status(rc, timed_out, stderr, full or cut_out or cut_err)
        return RunResult(status, stdout, stderr, None if timed_out else rc, seconds, cut_out or cut_err, isolation)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started (if anything)
    except ProcessLookupError:
        pass


def _status(rc: int | None, timed_out: bool, stderr: str, flooded: bool) -> str:
    if timed_out:
        return "timeout"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"
    if "MemoryError" in stderr:
        return "memory"
    if rc == 0:
        return "output_limit" if flooded else "ok"
    return "output_limit" if flooded and "File too large" in stderr else "error"


def python(code: str) -> str:
    """Run Python code and return what it prints (a sandboxed process: 5 s of CPU, 512 MB, no network)."""
    r = run_python(code)
    if r.ok:
        return r.stdout if not r.truncated else r.stdout + "\n[output cut]"
    tail = r.stderr.strip().splitlines()[-1:] or [""]
    return f"{r.status}: {tail[0]}"[:2000] if r.status == "error" else f"{r.status} (limits: 5 s CPU, 512 MB, 10 s wall)"


def _code_of(text: str) -> str:
    if "```" in text:
        blocks = text.split("```")
        for b in blocks[1::2]:
            return b.split("\n", 1)[1] if b.startswith(("python", "py\n")) else b
    return text


def code_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict[str, Any]:
    """A code reward with verl's signature: the response's first code block (or all of it), followed
    by ``extra_info["tests"]`` when given, runs in the sandbox; score 1 when it exits cleanly and,
    if `ground_truth` is given, prints exactly it (stripped)."""
    tests = (extra_info or {}).get("tests", "") if isinstance(extra_info, dict) else ""
    r = run_python(_code_of(solution_str) + ("\n" + tests if tests else ""))
    passed = r.ok and (not ground_truth or r.stdout.strip() == str(ground_truth).strip())
    return {"score": 1.0 if passed else 0.0, "sandbox_status": r.status}
