"""Sandboxes of the local E2B-compatible server: one persistent confined interpreter each, and a warm pool.

Each sandbox gets a uid of its own (from ``uid_base`` up, claimed with a lock file in ``UID_LOCK_DIR`` so that two
servers on one machine never share one), so its processes can all be killed at once (``kill -1``
run as that uid also reaches processes that left the process group with ``setsid``), its process limit is its
own, and its directory (mode 0700) is unreadable by any other sandbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

KERNEL = Path(__file__).with_name("kernel.py")
UID_LOCK_DIR = Path("/run/lock/pipeline-sandbox-uids")
UID_RANGE = 100_000  # uids tried from uid_base
DEBUG_SANDBOX_ID = "debug_sandbox_id"  # the id the E2B SDK uses in debug mode
EVENT_LINE_LIMIT = 4 * 1024 * 1024  # an event line longer than this is a protocol violation: the kernel is killed
# The only variables the interpreter sees: nothing of the server's environment (keys, tokens) crosses over.
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/user",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclasses.dataclass
class Limits:
    cpu_seconds: int = 300  # per interpreter lifetime (RLIMIT_CPU is cumulative); wall-clock limit is exec_timeout
    memory_mb: int = 1024
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


class Kernel:
    """The interpreter process of one sandbox."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def run(self, code: str, env: dict | None = None):
        """Yield the events of one execution up to (not including) ``done``; raise EOFError if the process died."""
        self.proc.stdin.write((json.dumps({"code": code, "env": env or {}}) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            line = await self.proc.stdout.readline()
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
        self.hide = [str(self.state_dir), "/root", *hide]
        self.expose = sorted({sys.base_prefix, sys.prefix})  # the interpreter the kernels run on
        self.limits = limits
        self.warm_target = warm
        self.max_sandboxes = max_sandboxes
        self.uid_base = uid_base
        self.free_slots = list(range(max_sandboxes))
        self.warm: list[Sandbox] = []
        self.running: dict[str, Sandbox] = {}
        self._refill_task: asyncio.Task | None = None
        self._reaper_task: asyncio.Task | None = None
        self._spawning = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        (self.state_dir / "stage").mkdir(exist_ok=True)  # kernels mount their staging tmpfs here
        self._refill_task = asyncio.create_task(self._refill())
        self._reaper_task = asyncio.create_task(self._reap())

    async def close(self):
        for task in (self._refill_task, self._reaper_task):
            if task:
                task.cancel()
        for sb in [*self.warm, *self.running.values()]:
            await self._destroy(sb)
        self.warm.clear()
        self.running.clear()

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
                await self.kill(sb.sandbox_id)

    # ------------------------------------------------------------------ sandboxes

    async def _new_sandbox(self) -> Sandbox:
        slot = self.free_slots.pop(0)
        uid, lock_fd = self._claim_uid()
        workdir = self.state_dir / f"slot-{slot}"
        sb = Sandbox(slot=slot, uid=uid, uid_lock=lock_fd, workdir=workdir)
        try:
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(mode=0o700)
            os.chown(workdir, uid, uid)
            sb.kernel = await self.spawn_kernel(sb)
            return sb
        except BaseException:
            self._release_slot(sb)
            raise

    def _claim_uid(self) -> tuple[int, int]:
        """A uid no other sandbox on this machine holds (a held lock), with no process left running as it."""
        UID_LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for uid in range(self.uid_base, self.uid_base + UID_RANGE):
            fd = os.open(UID_LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not live_processes(uid):  # e.g. left by a server that was SIGKILLed
                return uid, fd
            os.close(fd)
        raise RuntimeError(f"no free sandbox uid in {self.uid_base}..{self.uid_base + UID_RANGE - 1}")

    def _release_slot(self, sb: Sandbox):
        os.close(sb.uid_lock)  # releases the uid's lock
        self.free_slots.append(sb.slot)

    async def spawn_kernel(self, sb: Sandbox) -> Kernel:
        cfg = {"uid": sb.uid, "workdir": str(sb.workdir), "hide": self.hide, "expose": self.expose}
        cfg.update(state_dir=str(self.state_dir), stage=str(self.state_dir / "stage"))
        cfg.update(dataclasses.asdict(self.limits))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # no user site, no PYTHON* variables, no script directory on the path
            str(KERNEL),
            json.dumps(cfg),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=CLEAN_ENV,
            cwd="/",
            start_new_session=True,  # its own process group: killed whole on timeout
            limit=EVENT_LINE_LIMIT,
        )
        line = await proc.stdout.readline()
        event = json.loads(line) if line else {"message": f"exited with {await proc.wait()}"}
        if event.get("type") != "ready":
            await proc.wait()
            raise RuntimeError(f"sandbox interpreter failed to start: {event.get('message')}")
        return Kernel(proc)

    async def acquire(self, template: str, timeout: float, metadata: dict, env_vars: dict) -> Sandbox:
        if self.warm:
            sb = self.warm.pop(0)
        elif self.free_slots:
            sb = await self._new_sandbox()
        else:
            raise RuntimeError(f"all {self.max_sandboxes} sandboxes are in use")
        sb.sandbox_id = "i" + secrets.token_hex(10)
        sb.access_token = secrets.token_hex(16)
        sb.template, sb.metadata, sb.env_vars = template, metadata, env_vars
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

    async def kill(self, sandbox_id: str) -> bool:
        sb = self.running.pop(sandbox_id, None)
        if sb is None:
            return False
        await self._destroy(sb)
        self.kick()
        return True

    async def kill_processes(self, sb: Sandbox):
        """Stop, then kill, every process of the sandbox's uid (also those that escaped its process group)."""
        if sb.kernel is not None:
            try:
                os.killpg(sb.kernel.proc.pid, 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while live_processes(sb.uid) and time.monotonic() < deadline:  # SIGKILL is delivered asynchronously
            for sig in ("STOP", "KILL"):  # stopped processes cannot fork while the kill goes round
                await asyncio.to_thread(
                    subprocess.run,
                    ["kill", f"-{sig}", "--", "-1"],
                    user=sb.uid,
                    group=sb.uid,
                    extra_groups=[],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
            await asyncio.sleep(0.05)
        if sb.kernel is not None:
            await sb.kernel.proc.wait()
            sb.kernel = None

    async def _destroy(self, sb: Sandbox):
        await self.kill_processes(sb)
        shutil.rmtree(sb.workdir, ignore_errors=True)
        self._release_slot(sb)
