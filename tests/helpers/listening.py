"""Which TCP addresses a set of processes listens on, read from /proc (what ``ss -ltnp`` shows, without ``ss``).

A socket belongs to a process when one of its ``/proc/PID/fd`` links is ``socket:[INODE]``; ``/proc/net/tcp`` and
``tcp6`` list each socket's local address and state (``0A`` = LISTEN) by inode.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LISTEN = "0A"


def _addr(hex_addr: str) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(words)}:{int(port_hex, 16)}"


def _listening_inodes() -> dict[int, str]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN:
                out[int(f[9])] = _addr(f[1])
    return out


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def in_session(sid: int) -> set[int]:
    """Live processes of session ``sid`` (a local service's: pipeline_steps/local/sessions.py; Ray's workers each
    have a process group of their own inside it)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    out.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def listening(pids) -> dict[str, list[int]]:
    """``{"address:port": [pid, ...]}`` of every TCP socket in LISTEN state held by one of ``pids``."""
    inodes = _listening_inodes()
    out: dict[str, list[int]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                addr = inodes.get(int(link[8:-1]))
                if addr:
                    out.setdefault(addr, []).append(pid)
    return out


def not_loopback(addresses) -> list[str]:
    """The addresses that are not on a loopback interface (0.0.0.0 and :: are every interface)."""
    bad = []
    for a in addresses:
        host = a.rsplit(":", 1)[0]
        ip = ipaddress.ip_address(host)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            bad.append(a)
    return bad


def alive(pids) -> list[int]:
    """The pids still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def wait_listening(pids_of, want_port: int | None, timeout: float = 60) -> dict[str, list[int]]:
    """The listening sockets of ``pids_of()``, once ``want_port`` is among them (servers start one by one)."""
    deadline = time.monotonic() + timeout
    while True:
        socks = listening(pids_of())
        if want_port is None or any(a.endswith(f":{want_port}") for a in socks) or time.monotonic() > deadline:
            return socks
        time.sleep(1)


def wait_for_output(proc, out: Path, needle: str, timeout: float) -> None:
    """Until ``needle`` shows in the file ``proc`` writes its output to; fails at once if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in out.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(1)
    raise AssertionError(f"no {needle!r} within {timeout:.0f} s: {out.read_text()[-2000:]}")


def start_make(target: str, env: dict[str, str], out: Path) -> subprocess.Popen:
    """``make <target>`` as a user types it in the checkout, its output to ``out``, in a session of its own (so a test
    can signal the whole group the way a terminal would)."""
    with open(out, "w") as f:
        return subprocess.Popen(
            ["make", "-s", "--no-print-directory", target],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
