"""The E2B surface beyond run_code on the local sandbox server, through the pinned real SDKs: envd's files and
commands, ``Sandbox.list`` / ``Sandbox.connect``, rich results; and that none of it reaches outside the sandbox."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pipeline_steps.sandbox.pool import live_processes
from tests.helpers.budget import scaled

pytestmark = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")

SECRET = "s3cr3t-api-7d1e"
# the server's cap on one execution: a cold matplotlib import and figure render exceeded 3 s in make test (four
# workers on two cores), and 10 s (it builds its font cache in each new sandbox) with two suites on the machine; the
# timeout test waits for it
EXEC_TIMEOUT = round(scaled(10))
DISK_MB = 16


@pytest.fixture(scope="module")
def root():
    # Beside the checkout (not under /tmp, /root or /home, which a sandbox gets private or empty copies of).
    base = Path(__file__).resolve().parents[4]
    if any(base.is_relative_to(p) for p in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/root", "/home")):
        base = Path("/srv")
    d = Path(tempfile.mkdtemp(prefix=".sandbox-api-test-", dir=base))
    os.chmod(d, 0o755)
    (d / "outside.txt").write_text(SECRET)
    os.chmod(d / "outside.txt", 0o644)  # world-readable: only the jail keeps it out of reach
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    args = ["--exec-timeout", str(EXEC_TIMEOUT), "--disk-mb", str(DISK_MB), "--warm", "2"]
    with LocalSandboxServer(root / "state", args=args, extra_env={"SECRET_TOKEN": SECRET}) as srv:
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


# ---------------------------------------------------------------- files


def test_files_read_write_list(sandbox):
    from e2b.exceptions import FileNotFoundException

    info = sandbox.files.write("/home/user/data/in.txt", "from the client")
    assert (info.path, info.name) == ("/home/user/data/in.txt", "in.txt")
    sandbox.files.write("blob.bin", b"\x00\xff" * 1000)  # relative: to the home, as envd takes it
    assert _value(sandbox.run_code("open('/home/user/data/in.txt').read()")) == "'from the client'"
    uid = int(_value(sandbox.run_code("import os; os.stat('/home/user/data/in.txt').st_uid")))
    assert uid == int(_value(sandbox.run_code("os.getuid()")))  # the sandbox's own file, not root's
    _value(sandbox.run_code("open('out.txt', 'w').write('from the code')"))
    assert sandbox.files.read("/home/user/out.txt") == "from the code"
    assert sandbox.files.read("blob.bin", format="bytes") == bytearray(b"\x00\xff" * 1000)
    entries = {e.name: e for e in sandbox.files.list("/home/user")}
    assert set(entries) == {"data", "blob.bin", "out.txt"}
    assert entries["blob.bin"].size == 2000 and entries["data"].type.value == "dir"
    assert [e.path for e in sandbox.files.list("/home/user", depth=2) if e.name == "in.txt"] == [info.path]
    assert sandbox.files.make_dir("/home/user/new/sub") is True and sandbox.files.make_dir("new/sub") is False
    assert sandbox.files.exists("new/sub") and not sandbox.files.exists("nothing-here")
    sandbox.files.rename("out.txt", "new/moved.txt")
    assert sandbox.files.read("new/moved.txt") == "from the code"
    sandbox.files.remove("new")
    assert not sandbox.files.exists("new")
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("new/moved.txt")


TRAP = """
import os
os.symlink('/etc/passwd', 'abs')
os.symlink('../../', 'up')
os.symlink({other!r}, 'other')
os.symlink({outside!r}, 'outside')
os.mkfifo('fifo')
sorted(os.listdir('.'))"""


def test_files_api_confined_to_the_sandbox(server, root, sandbox):
    """Paths outside /home/user, and symlinks the code plants to lead out (absolute, relative, to another
    sandbox's directory on the host), are refused for reading, writing, listing and removal."""
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    other = Sandbox.create(**server.sdk_options())
    try:
        other.files.write("mine.txt", SECRET)
        [other_file] = [p for p in (root / "state").glob("slot-*/mine.txt")]
        _value(sandbox.run_code(TRAP.format(other=str(other_file), outside=str(root / "outside.txt"))))
        refused = ["/etc/passwd", "/home/user/../../etc/passwd", "../outside.txt", "/proc/self/environ"]
        refused += ["abs", "up/etc/passwd", "other", "outside", str(other_file), str(root / "outside.txt")]
        for path in refused:
            with pytest.raises(SandboxException) as caught:
                sandbox.files.read(path)
            assert SECRET not in str(caught.value)
        for path in ["up/planted.txt", "abs", "/tmp/planted.txt", "outside", "../planted.txt"]:
            with pytest.raises(SandboxException):
                sandbox.files.write(path, "planted")
        for path in ["/", "/home", "up", "/home/user/.."]:
            with pytest.raises(SandboxException):
                sandbox.files.list(path)
        with pytest.raises(SandboxException):
            sandbox.files.remove("/home/user/..")
        with pytest.raises(SandboxException):
            sandbox.files.read("fifo")  # a FIFO is refused at once, not waited on
        sandbox.files.remove("abs")  # the link itself, never its target
        assert Path("/etc/passwd").exists() and (root / "outside.txt").read_text() == SECRET
        assert not list(Path("/").glob("planted.txt")) and not (root / "planted.txt").exists()
        assert other.files.read("mine.txt") == SECRET and other_file.read_text() == SECRET
        kinds = {e.name: e.type.value for e in sandbox.files.list("/home/user")}
        assert kinds["up"] == "symlink" and kinds["other"] == "symlink"
    finally:
        other.kill()


def test_file_sizes_bounded_by_the_disk(sandbox):
    from e2b.exceptions import NotEnoughSpaceException

    with pytest.raises(NotEnoughSpaceException):  # refused while it arrives: larger than the disk
        sandbox.files.write("big.bin", b"x" * ((DISK_MB + 2) << 20))
    sandbox.files.write("first.bin", b"x" * (10 << 20))
    with pytest.raises(NotEnoughSpaceException):  # fits the disk alone, not beside the first: the disk is full
        sandbox.files.write("second.bin", b"x" * (10 << 20))
    sizes = {e.name: e.size for e in sandbox.files.list("/home/user")}
    assert sizes == {"first.bin": 10 << 20, "second.bin": 0}  # the failed write gives its space back
    assert _value(sandbox.run_code("open('after.txt', 'w').write('room')")) == "4"


# ---------------------------------------------------------------- commands


def test_commands_run_in_the_jail(sandbox, server):
    from e2b.sandbox.commands.command_handle import CommandExitException

    _value(sandbox.run_code("kept = 'interpreter state'"))
    uid = _value(sandbox.run_code("import os; os.getuid()"))
    r = sandbox.commands.run("echo out; echo err >&2; id -u; pwd; echo $A", envs={"A": "from-envs"})
    assert (r.exit_code, r.stderr) == (0, "err\n")
    assert r.stdout.splitlines() == ["out", uid, "/home/user", "from-envs"]
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("echo partial; exit 3")
    assert caught.value.exit_code == 3 and caught.value.stdout == "partial\n"
    sandbox.commands.run("mkdir -p made && echo by-command > made/f.txt")
    assert sandbox.files.read("made/f.txt") == "by-command\n"
    assert _value(sandbox.run_code("open('made/f.txt').read()")) == "'by-command\\n'"
    code = (
        "python3 -c \"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)\""
    ).format(port=server.port)
    assert "connected" not in sandbox.commands.run(code).stdout
    env = sandbox.commands.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; env").stdout
    assert SECRET not in env and server.api_key not in env
    assert _value(sandbox.run_code("kept")) == "'interpreter state'"  # commands leave the interpreter alone


def test_command_timeout_kills_the_command_only(sandbox):
    from e2b.sandbox.commands.command_handle import CommandExitException

    _value(sandbox.run_code("kept = 1"))
    uid = int(_value(sandbox.run_code("import os; os.getuid()")))
    start = time.monotonic()
    with pytest.raises(CommandExitException) as caught:
        # the server's EXEC_TIMEOUT holds, not the client's timeout
        sandbox.commands.run("echo started; sleep 60 & sleep 60", timeout=3 * EXEC_TIMEOUT)
    assert time.monotonic() - start < EXEC_TIMEOUT + 5
    assert "exceeded" in caught.value.error and caught.value.stdout == "started\n"
    assert len(live_processes(uid)) == 1  # the command and its background child are gone
    assert _value(sandbox.run_code("kept")) == "1"  # the interpreter kept its variables
    assert sandbox.commands.run("echo next").stdout == "next\n"


def test_command_client_leaving_or_flooding(sandbox):
    """A client that drops the stream gets its command killed (the interpreter stays); output is capped."""
    _value(sandbox.run_code("kept = 2"))
    uid = int(_value(sandbox.run_code("import os; os.getuid()")))
    handle = sandbox.commands.run("sleep 60", background=True)
    assert len(live_processes(uid)) == 2  # the interpreter and sleep (bash -c execs a lone command)
    handle.disconnect()
    # At once, not after the command is seen dead: this call waits for the server's clean-up of the one the
    # client left, and must not read that command's end as its own (an empty result, once only under load).
    assert _value(sandbox.run_code("kept")) == "2"
    assert len(live_processes(uid)) == 1
    r = sandbox.commands.run("head -c 3000000 /dev/zero | tr '\\0' x")  # 3 MB against the 1 MiB cap
    assert len(r.stdout) == 1 << 20 and "output truncated" in r.stderr
    # output that reaches the cap exactly, then more: the note must still say some was dropped
    r = sandbox.commands.run("head -c 1048576 /dev/zero | tr '\\0' y; sleep 0.3; echo more")
    assert r.stdout == "y" * (1 << 20) and "5 more bytes dropped" in r.stderr  # "more\n"


def test_command_cannot_read_another_sandbox(server, root):
    from e2b_code_interpreter import Sandbox

    a, b = Sandbox.create(**server.sdk_options()), Sandbox.create(**server.sdk_options())
    try:
        a.files.write("private.txt", SECRET)
        [host_path] = [p for p in (root / "state").glob("slot-*/private.txt")]
        uid_a = a.commands.run("id -u").stdout.strip()
        cmd = f"cat {host_path} {root / 'outside.txt'} /proc/*/root/home/user/private.txt; ls /home /srv {root}; true"
        r = b.commands.run(cmd)
        assert SECRET not in r.stdout + r.stderr
        assert "No such file" in r.stderr
        assert b.commands.run("id -u").stdout.strip() != uid_a
        assert b.commands.run(f"ps -eo uid 2>/dev/null | grep -c {uid_a}; true").stdout.strip() in ("", "0")
    finally:
        a.kill()
        b.kill()


# ---------------------------------------------------------------- list and connect


def test_list_and_connect(server, root):
    from e2b import SandboxQuery
    from e2b.exceptions import AuthenticationException, SandboxException
    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    tag = {"run": f"list-{os.getpid()}"}
    sb = Sandbox.create(**server.sdk_options(), metadata=tag, timeout=60)
    other = Sandbox.create(**server.sdk_options())
    try:
        listed = Sandbox.list(**server.sdk_options(), query=SandboxQuery(metadata=tag))
        items = listed.next_items()
        assert [s.sandbox_id for s in items] == [sb.sandbox_id] and items[0].metadata == tag
        assert not listed.has_next
        everything = Sandbox.list(**server.sdk_options(), limit=1)
        ids = everything.next_items() + everything.next_items()
        assert {s.sandbox_id for s in ids} >= {sb.sandbox_id, other.sandbox_id}  # paged one at a time
        _value(sb.run_code("x = 'state across clients'"))
        again = Sandbox.connect(sb.sandbox_id, **server.sdk_options(), timeout=600)
        assert _value(again.run_code("x")) == "'state across clients'"
        assert again.commands.run("echo reconnected").stdout == "reconnected\n"
        assert again.get_info().end_at.timestamp() > time.time() + 500  # extended, as E2B does
        with pytest.raises(AuthenticationException):
            Sandbox.connect(sb.sandbox_id, **{**server.sdk_options(), "api_key": "not-the-key"})
        with pytest.raises(AuthenticationException):
            Sandbox.list(**{**server.sdk_options(), "api_key": "not-the-key"}).next_items()
        # another server, with a key of its own: neither key opens the other's sandboxes
        with LocalSandboxServer(root / "state-other", args=["--warm", "0"]) as second:
            theirs = Sandbox.create(**second.sdk_options())
            with pytest.raises(SandboxException):
                Sandbox.connect(theirs.sandbox_id, **server.sdk_options())
            with pytest.raises(AuthenticationException):
                Sandbox.connect(theirs.sandbox_id, **{**second.sdk_options(), "api_key": server.api_key})
            assert theirs.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**server.sdk_options()).next_items()}
        sb.kill()
        with pytest.raises(SandboxException, match="not found"):
            Sandbox.connect(sb.sandbox_id, **server.sdk_options())  # deleted: gone, as on E2B
        assert sb.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**server.sdk_options()).next_items()}
    finally:
        other.kill()


def test_expired_sandbox_refused_on_connect(server):
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(**server.sdk_options(), timeout=60)
    sb.set_timeout(1)
    deadline = time.monotonic() + 10
    while sb.is_running() and time.monotonic() < deadline:
        time.sleep(0.3)
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.connect(sb.sandbox_id, **server.sdk_options())


# ---------------------------------------------------------------- rich results


def test_rich_results(sandbox):
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    ex = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    [frame] = ex.results
    assert frame.is_main_result and "<table" in frame.html and "a  b" in frame.text
    ex = sandbox.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nprint('drawn')")
    assert ex.error is None and "".join(ex.logs.stdout) == "drawn\n"
    [figure] = ex.results
    assert not figure.is_main_result and base64.b64decode(figure.png).startswith(b"\x89PNG\r\n\x1a\n")
    assert "Figure" in figure.text
    assert sandbox.run_code("plt.get_fignums()").results[0].text == "[]"  # shown once, then closed


DISPLAYED = """
class Shown:
    def _repr_html_(self):
        return '<b>bold</b>'
    def _repr_png_(self):
        return b'\\x89PNG fake'
    def _repr_markdown_(self):
        return None  # declined: no such format
    def __repr__(self):
        return 'Shown()'
display(Shown())
Shown()"""


def test_display_data_from_repr_methods(sandbox):
    ex = sandbox.run_code(DISPLAYED)
    assert ex.error is None, ex.error
    shown, main = ex.results
    assert (shown.is_main_result, main.is_main_result) == (False, True)
    for r in (shown, main):
        assert (r.text, r.html, r.markdown) == ("Shown()", "<b>bold</b>", None)
        assert base64.b64decode(r.png) == b"\x89PNG fake"
    ex = sandbox.run_code("class Broken:\n    def _repr_html_(self):\n        1 / 0\nBroken()")
    assert ex.error is None and ex.results[0].html is None and "ZeroDivisionError" in "".join(ex.logs.stderr)


def _mounted_below(directory: Path) -> list[str]:
    return [
        f.split()[1] for f in Path("/proc/mounts").read_text().splitlines() if f.split()[1].startswith(f"{directory}/")
    ]


def _frozen(proc: psutil.Process) -> bool:
    """Whether the cgroup ``proc`` is in is frozen (a warm sandbox waits frozen for its first call)."""
    from pipeline_steps.sandbox.cgroups import ROOT, cgroup_paths

    with contextlib.suppress(OSError, KeyError):
        paths = cgroup_paths(proc.pid)
        if "freezer" in paths:  # cgroup v1
            return (ROOT / "freezer" / paths["freezer"].lstrip("/") / "freezer.state").read_text().strip() == "FROZEN"
        return (ROOT / paths[""].lstrip("/") / "cgroup.freeze").read_text().strip() == "1"
    return False


@pytest.mark.parametrize("how", ["stopped-while-warming", "killed"])
def test_no_sandbox_directory_stays_mounted_once_the_server_is_stopped(root, how):
    """Each sandbox's directory is a tmpfs. One was found still mounted after make test (a server stopped while it
    filled its warm pool, or killed after its 20 s to exit): stopped at once, or killed with SIGKILL once one of its
    warm sandboxes is frozen (so it cleans nothing up itself), the server leaves nothing mounted once ``stop()``
    returns, and no process of its sandboxes: the leftover check once found a frozen warm sandbox alive after make
    test (under cgroup v1 a frozen process does not die of SIGKILL, the parent-death signal included, until thawed)."""
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    state = root / f"state-{how}"
    srv = LocalSandboxServer(state, args=["--warm", "4", "--disk-mb", str(DISK_MB)]).start()
    orphans = []
    try:
        if how == "killed":
            deadline = time.monotonic() + scaled(60)
            while time.monotonic() < deadline:
                orphans = psutil.Process(srv.proc.pid).children(recursive=True)
                if any(_frozen(p) for p in orphans):
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the server froze no warm sandbox within its deadline")
            srv.proc.kill()
            srv.proc.wait()
    finally:
        srv.stop()
    assert _mounted_below(state) == []
    # killed ones may take a moment to finish exiting under load; a frozen one never would
    _, alive = psutil.wait_procs(orphans, timeout=scaled(30))
    try:
        assert not alive, f"sandbox processes alive after stop(): {[(p.pid, p.status(), _frozen(p)) for p in alive]}"
    finally:
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
