"""envd's ``process.Process`` Connect-RPC service, foreground commands only (``sandbox.commands.run``): the command
is started by the sandbox's interpreter (``kernel.run_command``), so it runs in the same jail, uid, cgroup and
limits as ``run_code``, one call at a time with it. Its output is capped like ``run_code``'s; at the deadline (the
server's ``--exec-timeout``, or the client's own if shorter) the command's processes are killed and the
interpreter keeps its state.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Callable

import anyio
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_connect
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from pipeline_steps.sandbox.envd import rpc_sandbox
from pipeline_steps.sandbox.jailfs import HOME
from pipeline_steps.sandbox.pool import RUNNING, Pool

TICK = 1.0  # a keepalive this often while the command is silent: a client that left is noticed by the next one
SETTLE = 5.0  # after the command is killed, this long for the interpreter to report its end


def _event(field: str, value) -> pb.StartResponse:
    return pb.StartResponse(event=pb.ProcessEvent(event=Oneof(field, value)))


def _end(code: int, error: str | None) -> pb.StartResponse:
    status = f"exit status {code}" if code >= 0 else f"signal: {-code}"
    return _event("end", pb.ProcessEvent.EndEvent(exit_code=code, exited=code >= 0, status=status, error=error))


class ProcessService(process_connect.Process):
    def __init__(self, pool: Pool, sandbox_of: Callable):
        self.pool = pool
        self.sandbox_of = sandbox_of

    async def list(self, request, ctx):
        rpc_sandbox(self.sandbox_of, ctx)
        return pb.ListResponse()  # foreground commands only: none is left running between calls

    async def start(self, request, ctx):
        sb = rpc_sandbox(self.sandbox_of, ctx)
        cfg = request.process or pb.ProcessConfig()
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "PTY sessions are not served")
        if not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "no command")
        limit = self.pool.limits.exec_timeout
        if ctx.timeout_ms:
            limit = min(limit, ctx.timeout_ms / 1000)
        cwd = cfg.cwd if cfg.has_field("cwd") and cfg.cwd else HOME
        req = {"argv": [cfg.cmd, *cfg.args], "env": {**sb.env_vars, **dict(cfg.envs)}, "cwd": cwd}
        async with sb.lock:  # one call at a time, with run_code
            if sb.state != RUNNING:
                raise ConnectError(Code.UNAVAILABLE, f"sandbox {sb.sandbox_id} has {sb.state}")
            # aclosing: a client that leaves closes this generator at its yield; without it, _run's clean-up would
            # run later, after the lock is released, and read the events of the next call.
            async with contextlib.aclosing(self._run(sb, req, limit)) as events:
                async for event in events:
                    yield event

    async def _run(self, sb, req: dict, limit: float):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        room = self.pool.limits.max_output_bytes
        dropped, timed_out, settled, started = 0, False, False, False
        try:
            sb.cgroup.freeze(False)  # frozen between calls
            if sb.kernel is None or sb.kernel.proc.returncode is not None:
                sb.kernel = await self.pool.spawn_kernel(sb)
            await sb.kernel.send(req)
            async for ev in sb.kernel.events(tick=TICK):
                if not timed_out and loop.time() > deadline:
                    timed_out = True  # kill the command, not the interpreter: its end is reported as usual
                    await asyncio.to_thread(sb.cgroup.kill, sb.kernel.keep)
                kind = ev and ev.get("type")
                if kind == "cmd_start":
                    started = True
                    yield _event("start", pb.ProcessEvent.StartEvent(pid=int(ev["pid"])))
                elif kind == "cmd_data":
                    data = base64.b64decode(ev["data"])
                    dropped += max(0, len(data) - room)
                    data, room = data[:room], max(0, room - len(data))
                    if data:
                        output = Oneof("stdout" if ev["stream"] == "stdout" else "stderr", data)
                        yield _event("data", pb.ProcessEvent.DataEvent(output=output))
                elif kind == "cmd_end":
                    dropped += int(ev.get("dropped") or 0)
                    if dropped:
                        note = f"\n[output truncated by the server: {dropped} more bytes dropped]\n".encode()
                        yield _event("data", pb.ProcessEvent.DataEvent(output=Oneof("stderr", note)))
                    error = f"command exceeded {limit:g} s and was killed" if timed_out else None
                    yield _end(int(ev["exit_code"]), error)
                elif kind == "cmd_error":
                    raise ConnectError(Code.INVALID_ARGUMENT, f"could not start the command: {ev['message']}")
                elif started:  # E2B's client takes the stream's first event as the start: none before it
                    yield _event("keepalive", pb.ProcessEvent.KeepAlive())
            settled = True
        except (EOFError, ValueError, RuntimeError, OSError) as exc:
            raise ConnectError(Code.INTERNAL, f"the sandbox's interpreter stopped: {exc}") from None
        finally:
            # shielded: a client that disconnects cancels this generator, which must not cut the clean-up short
            with anyio.CancelScope(shield=True):
                if not settled:
                    settled = await self._settle(sb)
                if settled:
                    await self.pool.end_of_call(sb)  # what the command left in the background dies with the call
                else:
                    await self.pool.kill_processes(sb)

    async def _settle(self, sb) -> bool:
        """The client left or the stream broke mid-command: kill the command and let the interpreter finish the
        request, so that it stays usable (its variables kept); False if it does not."""
        if sb.kernel is None or sb.kernel.proc.returncode is not None:
            return False
        try:
            await asyncio.to_thread(sb.cgroup.kill, sb.kernel.keep)
            async with asyncio.timeout(SETTLE):
                async for _ in sb.kernel.events():
                    pass
            return True
        except (TimeoutError, EOFError, ValueError, OSError):
            return False


def process_app(pool: Pool, sandbox_of: Callable):
    return process_connect.ProcessASGIApplication(ProcessService(pool, sandbox_of), read_max_bytes=1 << 20)
