"""Sandboxes of the local E2B-compatible server: one persistent interpreter each, jailed by bubblewrap in a cgroup
of its own, and a warm pool.

Isolation is an allow-list (``jail_command``): a sandbox's root holds the Python installation read-only, its own
directory as ``/home/user``, a private ``/tmp``, ``/dev`` and ``/proc``, and nothing else, so a directory created on
the host at any time is not in it. Limits for the sandbox as a whole (memory of all its processes, process count,
CPU) are its cgroup's (``cgroups.py``), set from outside. Each sandbox also has a uid of its own (from ``uid_base``
up, claimed with a lock file in ``UID_LOCK_DIR`` so that two servers on one machine never share one): its 0700
directory is unreadable by any other sandbox.

Lifecycle: ``warm`` (started, in the pool) -> ``running`` (handed out) -> ``ending`` (killed or expired: refused
from here on, even to a request that was accepted before) -> ``ended``. A uid and a slot go back to the pool only
once nothing of the sandbox is left (no process, no cgroup, no directory). At start the server removes what a
killed predecessor left: slot directories in its state directory, cgroups (and processes) of uids no server holds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline_steps.sandbox.cgroups import Cgroups, SandboxCgroup

log = logging.getLogger(__name__)

KERNEL = Path(__file__).with_name("kernel.py")
UID_LOCK_DIR = Path("/run/lock/pipeline-sandbox-uids")
UID_RANGE = 100_000  # uids tried from uid_base
ENDED_REMEMBERED = 10_000  # ids of ended sandboxes kept to answer late requests
SPAWN_WAIT_S = 30.0  # a create with every slot taken waits this long at most for a warm sandbox being started
WARM, RUNNING, ENDING, ENDED = "warm", "running", "ending", "ended"
HOME = "/home/user"
KERNEL_IN_JAIL = "/opt/sandbox/kernel.py"
DEBUG_SANDBOX_ID = "debug_sandbox_id"  # the id the E2B SDK uses in debug mode
EVENT_LINE_LIMIT = 4 * 1024 * 1024  # an event line longer than this is a protocol violation: the kernel is killed
# The only variables the interpreter sees: nothing of the server's environment (keys, tokens) crosses over.
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": HOME,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",  # figures are shown as PNG results; no display exists
    "MPLCONFIGDIR": "/tmp/.matplotlib",  # its font cache in the private /tmp, not in the user's listing
}


@dataclasses.dataclass
class Limits:
    cpu_seconds: int = 300  # per interpreter lifetime (RLIMIT_CPU is cumulative); wall-clock limit is exec_timeout
    memory_mb: int = 1024  # the sandbox's processes together (cgroup), and each one's address space
    cpus: int = 1  # CPU time per wall-clock second, all processes together (cgroup)
    disk_mb: int = 256  # the sandbox's directory: a tmpfs of this size (its pages count as the sandbox's memory)
    max_processes: int = 64
    max_open_files: int = 128
    max_file_mb: int = 64
    tmp_mb: int = 64
    max_output_bytes: int = 1024 * 1024
    exec_timeout: float = 30.0


def live_processes(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies (killed orphans wait for PID 1 to reap them)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid and (p / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                    pids.append(int(p.name))
            except (OSError, IndexError):
                pass
    return pids


def mount_home(workdir: Path, uid: int, disk_mb: int):
    """The sandbox's directory as a tmpfs of ``disk_mb``: what it may write is bounded, whatever the file count."""
    opts = f"size={disk_mb}m,mode=0700,uid={uid},gid={uid},nosuid,nodev"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(workdir)], check=True, capture_output=True)


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory`` (this process's view, /proc/self/mountinfo), deepest first."""
    root, found = str(Path(directory).resolve()), []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # octal escapes: \040 for a space
        if point == root or point.startswith(root.rstrip("/") + "/"):
            found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def try_uid_lock(uid: int) -> int | None:
    """The machine-wide lock of a sandbox uid (an open fd), or None while a live server's sandbox holds it."""
    UID_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(UID_LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_orphans(cgroups: Cgroups) -> None:
    """Kill and remove the sandbox cgroups under ``cgroups`` of uids no live server holds: what a server killed
    before its clean-up left. Through the cgroup, not by pid: a warm sandbox is frozen, and under cgroup v1 a frozen
    process does not die of SIGKILL until it is thawed (the parent-death signal bubblewrap asks for included)."""
    for uid in cgroups.leftovers():
        fd = try_uid_lock(uid)
        if fd is None:
            continue  # a live server's sandbox
        try:
            if not cgroups.sandbox(uid).remove():
                log.error("could not remove the leftover cgroup of uid %d", uid)
            else:
                log.info("removed the leftovers of uid %d (a server that was killed)", uid)
        finally:
            os.close(fd)


def remove_home(workdir: Path):
    if os.path.ismount(workdir):
        if subprocess.run(["umount", str(workdir)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(workdir)], capture_output=True)  # busy: detached, freed when unused
    shutil.rmtree(workdir, ignore_errors=True)


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def jail_command(sb: "Sandbox", cfg: dict, expose: list[str], hide: list[str], tmp_mb: int) -> list[str]:
    """bubblewrap's command line for one sandbox: what is not named here does not exist in it."""
    cmd = ["bwrap", "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr symlinks, or the real dirs
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    cmd += ["--perms", "0755", "--dir", "/etc"]  # else bwrap makes it 0700: no ld.so.cache, and `bash -l` fails on it
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/alternatives", "/etc/localtime"):
        cmd += ["--ro-bind-try", f, f]
    # /tmp first: an exposed directory below /tmp (a venv in /tmp/...) is then bound over the fresh tmpfs, not hidden
    # under it
    cmd += ["--dev", "/dev", "--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp"]
    binds = [p for p in expose if not _under(p, "/usr")]  # the interpreter and its libraries (a venv, a pyenv...)
    made = {"/tmp"}  # the tmpfs above (a --dir would reset its 1777)
    for dest in [*binds, HOME, KERNEL_IN_JAIL]:  # parents world-searchable (bwrap would copy the host's modes)
        for parent in list(Path(dest).parents)[::-1][1:]:
            if str(parent) not in made:
                made.add(str(parent))
                cmd += ["--perms", "0755", "--dir", str(parent)]
    for path in binds:
        cmd += ["--ro-bind", path, path]
    for path in hide:  # only what an exposed directory would otherwise show
        if any(_under(path, e) for e in expose) and os.path.isdir(path):
            cmd += ["--tmpfs", path]
    cmd += ["--ro-bind", str(KERNEL), KERNEL_IN_JAIL, "--bind", str(sb.workdir), HOME]
    cmd += ["--perms", "1777", "--size", str(1 << 20), "--tmpfs", "/dev/shm", "--proc", "/proc", "--chdir", "/"]
    cmd += [sys.executable, "-I", KERNEL_IN_JAIL, json.dumps(cfg)]  # -I: no user site, PYTHON* or script dir
    # A shell puts itself (the process that becomes bwrap) into the sandbox's cgroup before anything else runs.
    join = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in sb.cgroup.procs_files())
    return ["/bin/sh", "-c", f'{join} && exec "$@"', "sh", *cmd]


class Kernel:
    """The interpreter process of one sandbox (bubblewrap's process, whose child's child is the interpreter)."""

    def __init__(self, proc: asyncio.subprocess.Process, keep: set[int]):
        self.proc = proc
        self.keep = keep  # the jail's processes (bwrap, its init, the interpreter): the rest end with each call

    async def run(self, code: str, env: dict | None = None):
        """Yield the events of one execution up to (not including) ``done``; raise EOFError if the process died."""
        await self.send({"code": code, "env": env or {}})
        async for event in self.events():
            yield event

    async def send(self, request: dict):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        await self.proc.stdin.drain()

    async def events(self, tick: float | None = None):
        """Events up to ``done``; with ``tick``, None after each ``tick`` seconds without one."""
        while True:
            if tick is None:  # run_code's path: no timer per line
                line = await self.proc.stdout.readline()
            else:
                try:  # a cancelled readline leaves a partial line in the buffer, so the next one reads it whole
                    line = await asyncio.wait_for(self.proc.stdout.readline(), tick)
                except TimeoutError:
                    yield None
                    continue
            if not line:
                raise EOFError("the interpreter exited")
            event = json.loads(line)
            if event.get("type") == "done":
                return
            yield event


@dataclasses.dataclass
class Sandbox:
    slot: int
    uid: int
    uid_lock: int  # fd holding the uid's lock file
    workdir: Path
    cgroup: SandboxCgroup
    state: str = WARM
    kernel: Kernel | None = None
    sandbox_id: str = ""
    template: str = ""
    access_token: str = ""
    started_at: float = 0.0
    end_at: float = 0.0
    metadata: dict = dataclasses.field(default_factory=dict)
    env_vars: dict = dataclasses.field(default_factory=dict)  # the create request's envVars
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class Pool:
    def __init__(self, state_dir: Path, hide: list[str], limits: Limits, warm: int, max_sandboxes: int, uid_base: int):
        self.state_dir = Path(state_dir)
        self.hide = [str(self.state_dir), *[str(h) for h in hide]]
        self.expose = sorted({sys.base_prefix, sys.prefix})  # the interpreter the kernels run on
        self.limits = limits
        self.warm_target = warm
        self.max_sandboxes = max_sandboxes
        self.uid_base = uid_base
        self.free_slots = list(range(max_sandboxes))
        self.warm: list[Sandbox] = []
        self.running: dict[str, Sandbox] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> "killed" / "timed out"
        self.cgroups: Cgroups | None = None
        self._state_lock: int | None = None
        self._refill_task: asyncio.Task | None = None
        self._reaper_task: asyncio.Task | None = None
        self._spawning = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self):
        if shutil.which("bwrap") is None:
            raise RuntimeError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self._state_lock = os.open(self.state_dir / ".server.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._state_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another sandbox server uses {self.state_dir}") from None
        self.cgroups = Cgroups()
        await asyncio.to_thread(self._reap_leftovers)
        self._refill_task = asyncio.create_task(self._refill())
        self._reaper_task = asyncio.create_task(self._reap())

    def _reap_leftovers(self):
        """Remove what a server killed before it could clean up left: its slot directories here, and the cgroups
        and processes of uids that no running server holds."""
        for d in self.state_dir.iterdir():
            if d.name.startswith("slot-") or d.name == "stage":
                remove_home(d)
        remove_orphans(self.cgroups)

    async def close(self):
        tasks = [t for t in (self._refill_task, self._reaper_task) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a refill cut short removes its half-made sandbox first
        for sb in [*self.warm, *self.running.values()]:
            await self._destroy(sb)
        self.warm.clear()
        self.running.clear()
        if self._state_lock is not None:
            os.close(self._state_lock)

    def kick(self):
        if self._refill_task is not None and not self._refill_task.done():
            return
        self._refill_task = asyncio.create_task(self._refill())

    async def _refill(self):
        while len(self.warm) + self._spawning < self.warm_target and self.free_slots:
            self._spawning += 1
            try:
                self.warm.append(await self._new_sandbox())
            except Exception:
                log.exception("warm pool: could not start a sandbox")
                return
            finally:
                self._spawning -= 1

    async def _reap(self):
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for sb in [s for s in self.running.values() if s.end_at <= now]:
                log.info("sandbox %s timed out", sb.sandbox_id)
                await self.kill(sb.sandbox_id, "timed out")

    # ------------------------------------------------------------------ sandboxes

    async def _new_sandbox(self) -> Sandbox:
        slot = self.free_slots.pop(0)
        try:
            uid, lock_fd = self._claim_uid()
        except BaseException:
            self.free_slots.append(slot)
            raise
        workdir = self.state_dir / f"slot-{slot}"
        sb = Sandbox(slot=slot, uid=uid, uid_lock=lock_fd, workdir=workdir, cgroup=self.cgroups.sandbox(uid))
        try:
            lim = self.limits
            await asyncio.to_thread(remove_home, workdir)
            workdir.mkdir(mode=0o700)
            # not in a thread: a cancelled await would leave the mount running while the clean-up below unmounts
            # first, and the tmpfs would outlive the server (a few ms of the loop's time)
            mount_home(workdir, uid, lim.disk_mb)
            if not await asyncio.to_thread(sb.cgroup.remove):  # a leftover of this uid, if any
                raise RuntimeError(f"a leftover cgroup of uid {uid} would not go")
            sb.cgroup.create(lim.memory_mb, lim.max_processes, lim.cpus)
            sb.kernel = await self.spawn_kernel(sb)
            sb.cgroup.freeze(True)  # a warm sandbox uses no CPU until its first call
            return sb
        except BaseException:
            sb.state = ENDING
            await self._destroy(sb)
            raise

    def _claim_uid(self) -> tuple[int, int]:
        """A uid no other sandbox on this machine holds (a held lock), with no process left running as it."""
        for uid in range(self.uid_base, self.uid_base + UID_RANGE):
            fd = try_uid_lock(uid)
            if fd is None:
                continue
            if not live_processes(uid):  # e.g. left by an older server that was SIGKILLed
                return uid, fd
            os.close(fd)
        raise RuntimeError(f"no free sandbox uid in {self.uid_base}..{self.uid_base + UID_RANGE - 1}")

    async def spawn_kernel(self, sb: Sandbox) -> Kernel:
        if sb.state not in (WARM, RUNNING):  # a late request must never bring an ended sandbox back
            raise RuntimeError(f"sandbox {sb.sandbox_id or sb.slot} has {sb.state}")
        cfg = {"uid": sb.uid, **dataclasses.asdict(self.limits)}
        cmd = jail_command(sb, cfg, self.expose, self.hide, self.limits.tmp_mb)
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=CLEAN_ENV,
            cwd="/",
            start_new_session=True,
            limit=EVENT_LINE_LIMIT,
        )
        line = await proc.stdout.readline()
        event = json.loads(line) if line else {"message": f"exited with {await proc.wait()}"}
        if event.get("type") != "ready":
            await asyncio.to_thread(sb.cgroup.kill)
            await proc.wait()
            raise RuntimeError(f"sandbox interpreter failed to start: {event.get('message')}")
        return Kernel(proc, keep=sb.cgroup.pids())

    async def acquire(self, template: str, timeout: float, metadata: dict, env_vars: dict) -> Sandbox:
        # A warm sandbox being started holds its slot: wait for it rather than refuse, so that max_sandboxes
        # sandboxes can be handed out at once (a refusal at 63 of 64 was seen with a warm pool refilling).
        deadline = time.monotonic() + SPAWN_WAIT_S
        while not self.warm and not self.free_slots and self._spawning and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.warm:
            sb = self.warm.pop(0)
        elif self.free_slots:
            sb = await self._new_sandbox()
        else:
            raise RuntimeError(f"all {self.max_sandboxes} sandboxes are in use")
        sb.sandbox_id = "i" + secrets.token_hex(10)
        sb.access_token = secrets.token_hex(16)
        sb.template, sb.metadata, sb.env_vars = template, metadata, env_vars
        sb.state = RUNNING
        self._start_clock(sb, timeout)
        return sb

    async def acquire_debug(self) -> Sandbox:
        """The one sandbox the SDK uses in debug mode (``E2B_DEBUG=true``): it skips the control plane, names
        ``debug_sandbox_id`` and sends no access token. It never expires; only for a trusted local run."""
        sb = await self.acquire("debug", 365 * 24 * 3600, {}, {})
        self.running.pop(sb.sandbox_id)
        sb.sandbox_id, sb.access_token = DEBUG_SANDBOX_ID, ""
        self.running[sb.sandbox_id] = sb
        return sb

    def _start_clock(self, sb: Sandbox, timeout: float):
        sb.started_at = time.time()
        sb.end_at = sb.started_at + timeout
        self.running[sb.sandbox_id] = sb
        self.kick()

    async def kill(self, sandbox_id: str, reason: str = "killed") -> bool:
        sb = self.running.pop(sandbox_id, None)
        if sb is None:
            return False
        self.ended[sandbox_id] = reason
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)
        sb.state = ENDING  # refused from now on, also by requests already past the id check
        await self._destroy(sb)
        self.kick()
        return True

    async def kill_processes(self, sb: Sandbox):
        """Kill every process of the sandbox (its cgroup: also those that left its process group or session)."""
        await asyncio.to_thread(sb.cgroup.kill)
        if sb.kernel is not None:
            await sb.kernel.proc.wait()
            sb.kernel = None

    async def end_of_call(self, sb: Sandbox):
        """What a call started does not outlive it: every process but the interpreter's jail is killed, and the
        jail is frozen until the next call (threads the code left running in the interpreter stop too)."""
        if sb.kernel is not None and sb.cgroup.pids() - sb.kernel.keep:
            await asyncio.to_thread(sb.cgroup.kill, sb.kernel.keep)
        sb.cgroup.freeze(True)

    async def _destroy(self, sb: Sandbox):
        sb.state = ENDING
        await self.kill_processes(sb)
        async with sb.lock:  # a call in flight ends (its interpreter is gone) before the slot is given back
            await self.kill_processes(sb)
        await asyncio.to_thread(remove_home, sb.workdir)  # before the cgroup: its pages are charged there
        gone = await asyncio.to_thread(sb.cgroup.remove)
        gone = gone and not live_processes(sb.uid) and not sb.workdir.exists()
        sb.state = ENDED
        if not gone:  # never hand out a uid or slot something of the old sandbox still holds
            log.error("sandbox %s: leftovers remain; uid %d and slot %d are retired", sb.sandbox_id, sb.uid, sb.slot)
            return
        os.close(sb.uid_lock)  # releases the uid's lock
        self.free_slots.append(sb.slot)
