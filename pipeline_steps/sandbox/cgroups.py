"""One cgroup per sandbox: memory (all its processes together, no swap), process count and CPU, set and enforced
by the kernel from outside the sandbox, and a way to kill every process in it.

Both cgroup versions: v1 (one hierarchy per controller, ``/sys/fs/cgroup/{memory,pids,cpu,freezer}``, as on these
machines) and v2 (one unified hierarchy, as on current Kubernetes nodes). Sandbox cgroups live in
``<the server's own cgroup>/pipeline-sandboxes/uid-<uid>``: inside the server's own limits, and named by the
sandbox's machine-wide uid so that a server started after a SIGKILLed one finds and removes what it left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "pipeline-sandboxes"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


class CgroupError(RuntimeError):
    pass


def cgroup_paths(pid: int | str = "self") -> dict[str, str]:
    """controller name (``""`` for v2) -> the cgroup path of process ``pid`` (this one by default), from
    ``/proc/PID/cgroup``."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _write(path: Path, value: str):
    with open(path, "w") as f:
        f.write(value)


class Cgroups:
    """The server's cgroup setup: where sandbox cgroups go and which version the machine runs."""

    def __init__(self, root: Path = ROOT, own: dict[str, str] | None = None):
        own = own if own is not None else cgroup_paths()
        self.version = 2 if (root / "cgroup.controllers").exists() else 1
        try:
            if self.version == 2:
                self.bases = {"": self._setup_v2(root / own.get("", "/").lstrip("/"))}
            else:
                self.bases = {}
                for c in V1_CONTROLLERS:
                    if not (root / c).is_dir() or c not in own:
                        if c == "freezer":  # optional: kills then loop until the cgroup is empty
                            continue
                        raise CgroupError(f"no cgroup v1 {c} controller mounted at {root / c}")
                    base = root / c / own[c].lstrip("/") / PARENT
                    base.mkdir(exist_ok=True)
                    self.bases[c] = base
        except OSError as exc:
            raise CgroupError(f"cannot create sandbox cgroups (cgroup v{self.version}): {exc}") from exc

    @staticmethod
    def _setup_v2(own: Path) -> Path:
        want = set(V2_CONTROLLERS)
        missing = want - set((own / "cgroup.controllers").read_text().split())
        if missing:
            raise CgroupError(f"cgroup v2 controllers {sorted(missing)} not available in {own}")
        if not want <= set((own / "cgroup.subtree_control").read_text().split()):
            # "No internal processes": a cgroup that hands controllers to children may hold no process itself,
            # so the processes of our own cgroup (the server, in a container its siblings) move to a leaf.
            leaf = own / "server"
            leaf.mkdir(exist_ok=True)
            for pid in (own / "cgroup.procs").read_text().split():
                try:
                    _write(leaf / "cgroup.procs", pid)
                except OSError:
                    pass  # exited meanwhile
            _write(own / "cgroup.subtree_control", " ".join("+" + c for c in V2_CONTROLLERS))
        base = own / PARENT
        base.mkdir(exist_ok=True)
        _write(base / "cgroup.subtree_control", " ".join("+" + c for c in V2_CONTROLLERS))
        return base

    def sandbox(self, uid: int) -> "SandboxCgroup":
        return SandboxCgroup(self, f"uid-{uid}")

    def leftovers(self) -> list[int]:
        """Uids that have a sandbox cgroup here (this server's, or one left by a server that was killed)."""
        uids = set()
        for base in self.bases.values():
            for d in base.glob("uid-*"):
                if d.name[4:].isdigit():
                    uids.add(int(d.name[4:]))
        return sorted(uids)


class SandboxCgroup:
    def __init__(self, cgroups: Cgroups, name: str):
        self.v2 = cgroups.version == 2
        self.dirs = {c: base / name for c, base in cgroups.bases.items()}
        self.main = self.dirs[""] if self.v2 else self.dirs["pids"]  # lists every process of the sandbox

    def create(self, memory_mb: int, max_processes: int, cpus: float):
        mem = str(memory_mb * 1024 * 1024)
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        if self.v2:
            d = self.main
            _write(d / "memory.max", mem)
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(max_processes))
            _write(d / "cpu.max", f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        else:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", mem)
            if (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping out
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", mem)
            _write(self.dirs["pids"] / "pids.max", str(max_processes))
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(int(cpus * CPU_PERIOD_US)))

    def procs_files(self) -> list[str]:
        """The files a new process writes its pid to, to join this cgroup in every hierarchy."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> set[int]:
        try:
            return {int(p) for p in (self.main / "cgroup.procs").read_text().split()}
        except FileNotFoundError:
            return set()

    def freeze(self, on: bool) -> bool:
        """Stop (or resume) every process and thread of the sandbox; False where no freezer is mounted."""
        if self.v2:
            path, value = self.main / "cgroup.freeze", "1" if on else "0"
        elif "freezer" in self.dirs:
            path, value = self.dirs["freezer"] / "freezer.state", "FROZEN" if on else "THAWED"
        else:
            return False
        try:
            _write(path, value)
        except OSError:
            return False
        return True

    def kill(self, keep: set[int] = frozenset(), timeout: float = 10.0) -> bool:
        """SIGKILL every process of the cgroup except ``keep``; True once none other is left. Frozen first, so
        nothing forks while the kill goes round."""
        deadline = time.monotonic() + timeout
        if not keep and self.v2 and (self.main / "cgroup.kill").exists():
            _write(self.main / "cgroup.kill", "1")
        while True:
            victims = self.pids() - keep
            if not victims:
                return True
            if time.monotonic() > deadline:
                return False
            frozen = self.freeze(True)
            for pid in self.pids() - keep:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            if frozen:
                self.freeze(False)  # SIGKILLed frozen tasks die when thawed
            time.sleep(0.005)

    def remove(self) -> bool:
        """Kill what is left and remove the cgroup; False if something would not die."""
        ok = self.kill()
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last killed tasks are still exiting
                    time.sleep(0.01)
            else:
                ok = False
        return ok
