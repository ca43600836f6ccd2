"""The code sandbox: generated code that loops, allocates, forks, reads outside its directory,
opens sockets, signals other processes or floods its output is stopped and reported, and the
process that ran it (the trainer) goes on."""

import os

import pytest

from rlgraph.ops.agents.sandbox import SandboxLimits, code_score, python, run_python

LIMITS = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=1024, file_mb=1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("code, status, says", [
    ("while True: pass", "cpu_limit", ""),
    ("import time; time.sleep(60)", "timeout", ""),
    ("x = []\nwhile True: x.append(bytearray(10**7))", "memory", "MemoryError"),
    ("import os; os.fork()", "error", "Operation not permitted"),
    ("import subprocess; subprocess.run(['true'])", "error", "Operation not permitted"),
    ("import ctypes; assert ctypes.CDLL(None).fork() == -1; raise SystemExit(3)", "error", ""),
    ("open('/etc/passwd').read()", "error", "Permission denied"),
    (f"open({os.path.join(ROOT, 'README.md')!r}).read()", "error", "Permission denied"),
    ("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)", "error", "not permitted"),
    (f"import os; os.kill({os.getpid()}, 9)", "error", "Operation not permitted"),
    ("while True: print('x' * 1000)", "output_limit", ""),
])
def test_what_the_code_may_not_do_is_stopped_and_reported(code, status, says):
    r = run_python(code, LIMITS)
    assert r.status == status, (r.status, r.stderr[-300:])
    assert says in r.stderr
    assert len(r.stdout) <= LIMITS.output_bytes
    assert r.seconds < LIMITS.wall_s + 2


def test_what_the_code_may_do_works_and_every_layer_held():
    r = run_python("import json, threading\nopen('a.txt', 'w').write('hi')\n"
                   "t = threading.Thread(target=lambda: print(open('a.txt').read())); t.start(); t.join()\n"
                   "print(json.dumps({'n': sum(range(10))}))", LIMITS, stdin="")
    assert r.ok and r.stdout == 'hi\n{"n": 45}\n'
    assert r.isolation == {"seccomp": True, "landlock": True, "network": True}
    assert run_python("print(input())", LIMITS, stdin="from stdin\n").stdout == "from stdin\n"


def test_without_landlock_the_audit_hook_still_refuses_files_outside():
    limits = SandboxLimits(cpu_s=1, wall_s=3, landlock=False)
    r = run_python("open('/etc/hostname').read()", limits)
    assert r.status == "error" and "outside the code's directory" in r.stderr and not r.isolation["landlock"]
    assert run_python("print(1)", limits).ok


def test_the_code_tool_and_the_code_reward():
    assert python("print(6 * 7)") == "42\n"
    assert python("1/0").startswith("error: ZeroDivisionError")
    solution = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert code_score("code", solution, "", {"tests": "assert add(2, 3) == 5"})["score"] == 1.0
    assert code_score("code", solution, "", {"tests": "assert add(2, 3) == 6"})["score"] == 0.0
    assert code_score("code", "print(5)", "5", None) == {"score": 1.0, "sandbox_status": "ok"}
    assert code_score("code", "import os; os.fork()", "", None)["score"] == 0.0
