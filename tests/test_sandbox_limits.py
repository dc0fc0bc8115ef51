"""The local E2B-compatible sandbox server, driven through the pinned E2B code-interpreter SDK: state, isolation
(network, secrets, files), limits (fork bomb, memory bomb, endless loop, output flood) and authentication."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from pipeline_steps.sandbox.pool import live_processes

pytestmark = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")

SECRET = "s3cr3t-token-7f0c2a"
EXEC_TIMEOUT = 3
OUTPUT_CAP = 64 * 1024


@pytest.fixture(scope="module")
def dirs():
    # Outside the directories a sandbox gets private or empty copies of (/tmp, /var/tmp, /root, /home, ...), which
    # would hide these for the wrong reason: beside the checkout, unless the checkout itself is in one (then /srv).
    base = Path(__file__).resolve().parents[1]
    if any(base.is_relative_to(p) for p in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/root", "/home")):
        base = Path("/srv")
    root = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=base))
    os.chmod(root, 0o755)
    hidden, visible = root / "store", root / "public"
    for d in (hidden, visible):
        d.mkdir(mode=0o755)
        (d / "secret.txt").write_text(SECRET)
        os.chmod(d / "secret.txt", 0o644)  # world-readable: only the mount namespace keeps it from a sandbox
    yield {"root": root, "state": root / "state", "store": hidden, "public": visible}
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(dirs):
    from pipeline_steps.sandbox.local import LocalSandboxServer

    args = ["--exec-timeout", str(EXEC_TIMEOUT), "--memory-mb", "512", "--max-processes", "32"]
    args += ["--max-output-bytes", str(OUTPUT_CAP), "--warm", "2"]
    srv = LocalSandboxServer(dirs["state"], args=args, extra_env={"SECRET_TOKEN": SECRET}, hide=[dirs["store"]])
    with srv:
        yield srv


@pytest.fixture
def sandbox(server):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(**server.sdk_options())
    yield sb
    sb.kill()


def _value(execution):
    assert execution.error is None, execution.error
    return execution.results[0].text if execution.results else None


def test_state_persists_across_calls(sandbox):
    assert _value(sandbox.run_code("x = 40\ndef f(y):\n    return y + 2\nopen('notes.txt', 'w').write('kept')")) == "4"
    assert _value(sandbox.run_code("f(x), open('notes.txt').read()")) == "(42, 'kept')"
    out = sandbox.run_code("print('to stdout'); import sys; print('to stderr', file=sys.stderr); 1 / 0")
    assert "".join(out.logs.stdout) == "to stdout\n" and "".join(out.logs.stderr) == "to stderr\n"
    assert out.error.name == "ZeroDivisionError" and "kernel.py" not in out.error.traceback
    assert sandbox.is_running()


def test_no_network(sandbox, server):
    code = (
        "import socket\nres = []\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2); res.append('connected')\n"
        "    except OSError as e:\n        res.append(type(e).__name__)\nres"
    ).format(port=server.port)
    assert "connected" not in _value(sandbox.run_code(code))


def test_server_secrets_invisible(sandbox, server):
    code = (
        "import os, glob\nhits = [k for k, v in os.environ.items() if {s!r} in v or {k!r} in v]\n"
        "for f in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n        data = open(f, 'rb').read()\n    except OSError:\n        continue\n"
        "    if {s!r}.encode() in data or {k!r}.encode() in data:\n        hits.append(f)\nhits"
    ).format(s=SECRET, k=server.api_key)
    assert _value(sandbox.run_code(code)) == "[]"
    others = (
        "import os\n[p for p in os.listdir('/proc') if p.isdigit() and os.stat('/proc/' + p).st_uid != os.getuid()]"
    )
    assert _value(sandbox.run_code(others)) == "[]"  # no other process (server, other sandboxes) is even listed
    # The server's own environment does hold them (else this test proves nothing).
    assert SECRET.encode() in Path(f"/proc/{server.proc.pid}/environ").read_bytes()


def test_files_of_others_and_the_store_unreadable(server, dirs):
    from e2b_code_interpreter import Sandbox

    a, b = Sandbox.create(**server.sdk_options()), Sandbox.create(**server.sdk_options())
    try:
        _value(a.run_code(f"open('/home/user/mine.txt', 'w').write({SECRET!r})"))
        for shared in ("/tmp", "/var/tmp", "/dev/shm"):  # world-writable on the host: private in each sandbox
            _value(a.run_code(f"open('{shared}/left-by-a', 'w').write('x')"))
            assert _value(b.run_code(f"import os; os.path.exists('{shared}/left-by-a')")) == "False"
        slots = [p for p in dirs["state"].glob("slot-*") if (p / "mine.txt").exists()]
        assert len(slots) == 1  # where a's file really is, on the host
        code = (
            "import glob\nfound = []\nfor pat in {pats!r}:\n    for f in glob.glob(pat, recursive=True):\n"
            "        try:\n            found.append((f, {s!r} in open(f).read()))\n        except OSError as e:\n"
            "            found.append((f, type(e).__name__))\nfound"
        )
        pats = [str(slots[0] / "mine.txt"), str(dirs["state"]) + "/**/*.txt", str(dirs["store"] / "secret.txt")]
        assert _value(b.run_code(code.format(pats=pats, s=SECRET))) == "[]"
        assert _value(b.run_code("import os; os.listdir('/home/user')")) == "[]"
        # Control: the same file outside the hidden store is readable, so the store is hidden by the server.
        assert "True" in _value(b.run_code(code.format(pats=[str(dirs["public"] / "secret.txt")], s=SECRET)))
    finally:
        a.kill()
        b.kill()


def _bystander_works(server):
    from e2b_code_interpreter import Sandbox

    other = Sandbox.create(**server.sdk_options())
    try:
        assert _value(other.run_code("sum(range(10))")) == "45"
    finally:
        other.kill()


def test_fork_bomb_contained(sandbox, server):
    uid = int(_value(sandbox.run_code("import os; os.getuid()")))
    results = {}
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    t = threading.Thread(target=lambda: results.setdefault("bomb", sandbox.run_code(bomb, timeout=60)))
    t.start()
    _bystander_works(server)  # served while the bomb runs
    t.join(60)
    assert results["bomb"].error.name == "TimeoutError"
    assert live_processes(uid) == []  # the bomb and the interpreter, all killed
    assert _value(sandbox.run_code("'alive'")) == "'alive'"  # a fresh interpreter
    assert len(live_processes(uid)) == 1


def test_memory_bomb_contained(sandbox, server):
    out = sandbox.run_code("x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))")
    assert out.error.name == "MemoryError"
    assert _value(sandbox.run_code("del x; 'still here'")) == "'still here'"
    _bystander_works(server)


def test_endless_loop_killed(sandbox, server):
    import time

    _value(sandbox.run_code("y = 1"))
    start = time.monotonic()
    out = sandbox.run_code("while True:\n    pass", timeout=60)
    assert out.error.name == "TimeoutError" and time.monotonic() - start < EXEC_TIMEOUT + 5
    assert sandbox.run_code("y").error.name == "NameError"  # a fresh interpreter took over
    _bystander_works(server)


def test_output_flood_capped(sandbox, server):
    out = sandbox.run_code("for i in range(200_000):\n    print('x' * 100)\n'done'")
    assert len("".join(out.logs.stdout)) <= OUTPUT_CAP
    assert "output truncated" in "".join(out.logs.stderr)
    assert _value(out) == "'done'"
    _bystander_works(server)


def test_wrong_keys_refused(server, sandbox):
    from e2b.exceptions import AuthenticationException
    from e2b_code_interpreter import Sandbox

    with pytest.raises(AuthenticationException):
        Sandbox.create(**{**server.sdk_options(), "api_key": "e2b_" + "0" * 40})
    assert not server.api_key.startswith("e2b_")  # keys of any shape work (Tencent AGS's do not start with e2b_)
    r = httpx.post(f"{server.url}/execute", json={"code": "1"}, headers={"E2b-Sandbox-Id": sandbox.sandbox_id})
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/sandboxes/{sandbox.sandbox_id}/timeout", json={"timeout": 1})
    assert r.status_code == 401


def test_kill_and_timeout(server):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(**server.sdk_options(), timeout=60)
    sb.set_timeout(1)
    import time

    deadline = time.monotonic() + 10
    while sb.is_running() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not sb.is_running()


def test_two_servers_never_share_a_uid(server, sandbox, dirs):
    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.local import LocalSandboxServer

    with LocalSandboxServer(dirs["root"] / "state2", args=["--warm", "1"]) as second:
        other = Sandbox.create(**second.sdk_options())
        uids = {_value(sb.run_code("import os; os.getuid()")) for sb in (sandbox, other)}
        other.kill()
    assert len(uids) == 2  # a kill in one server can never reach the other's sandboxes
    assert _value(sandbox.run_code("'untouched'")) == "'untouched'"


def test_server_refuses_to_start_without_a_key(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SANDBOX_SERVER_API_KEY"}
    cmd = [sys.executable, "-m", "pipeline_steps", "sandbox-server", "--state-dir", str(tmp_path / "s")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == "error: set $SANDBOX_SERVER_API_KEY to the API key clients must send"


def test_file_size_and_open_files_bounded(sandbox):
    out = sandbox.run_code("f = open('big', 'wb')\nf.write(b'x' * (65 * 2**20))\nf.flush()")  # server: --max-file-mb 64
    assert out.error.name == "OSError" and "too large" in out.error.value
    out = sandbox.run_code("fs = [open('f%d' % i, 'w') for i in range(500)]")  # server: --max-open-files 128
    assert out.error.name == "OSError" and "Too many open files" in out.error.value
    assert _value(sandbox.run_code("open('small', 'w').write('fine')")) == "4"  # the interpreter goes on


def test_cpu_seconds_bounded(dirs):
    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.local import LocalSandboxServer

    args = ["--warm", "0", "--cpu-seconds", "1", "--exec-timeout", "120"]
    with LocalSandboxServer(dirs["root"] / "state-cpu", args=args) as srv:
        sb = Sandbox.create(**srv.sdk_options())
        out = sb.run_code("while True:\n    pass", timeout=150)
        assert out.error.name == "SandboxError"  # RLIMIT_CPU ended it (the wall clock would say TimeoutError)
        assert _value(sb.run_code("'restarted'")) == "'restarted'"


def test_client_giving_up_kills_the_execution(dirs):
    import time

    from e2b.exceptions import TimeoutException
    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.local import LocalSandboxServer

    with LocalSandboxServer(dirs["root"] / "state-give-up", args=["--warm", "0", "--exec-timeout", "60"]) as srv:
        sb = Sandbox.create(**srv.sdk_options())
        uid = int(_value(sb.run_code("import os; os.getuid()")))
        start = time.monotonic()
        with pytest.raises(TimeoutException):  # the client's timeout, far below the server's 60 s
            sb.run_code("while True:\n    pass", timeout=1)
        while live_processes(uid) and time.monotonic() < start + 10:
            time.sleep(0.1)
        assert live_processes(uid) == []  # killed at the disconnect, not left spinning for 60 s
        assert _value(sb.run_code("'next call works'")) == "'next call works'"


def test_env_vars_of_create_and_run_code(server):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(**server.sdk_options(), envs={"A": "from-create"})
    try:
        code = "import os; os.environ.get('A'), os.environ.get('B')"
        assert _value(sb.run_code(code, envs={"B": "from-call"})) == "('from-create', 'from-call')"
        assert _value(sb.run_code(code)) == "('from-create', None)"  # a call's envs hold for that call only
    finally:
        sb.kill()


def test_sdk_debug_mode_reaches_the_debug_sandbox(dirs):
    import socket

    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.local import LocalSandboxServer

    with socket.socket() as s:  # the SDK's debug mode has the port fixed
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT leftovers are fine
        try:
            s.bind(("127.0.0.1", 49999))
        except OSError:
            pytest.skip("port 49999 is taken")
    with LocalSandboxServer(dirs["root"] / "state-debug", args=["--warm", "0", "--debug-sandbox"], port=49999):
        sb = Sandbox.create(debug=True)  # no control plane call, no key: straight to localhost:49999
        assert sb.sandbox_id == "debug_sandbox_id"
        assert _value(sb.run_code("import os; v = os.getuid(); v > 0")) == "True"
        assert _value(sb.run_code("v > 0")) == "True"  # the same standing interpreter
