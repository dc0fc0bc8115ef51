"""The order of a command's events on the envd ``Process.Start`` stream: E2B's client takes the first event as the
start (``Failed to start process: expected start event, got ...keepalive`` otherwise). Two suites on one machine made
the interpreter take over a second to report the start, and the server's keepalive tick went out first.

The interpreter is a stand-in here (the real one runs under bubblewrap, root only, and its start cannot be delayed
on purpose): it reports nothing for two ticks, then the start, some output and the end, as the real one does.
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace


class _SlowToStart:
    proc = SimpleNamespace(returncode=None)
    keep = ()

    async def send(self, req):
        self.req = req

    async def events(self, tick):
        for ev in (
            None,  # a tick with nothing to report: the command has not started yet
            None,
            {"type": "cmd_start", "pid": 7},
            None,  # a silent command: keepalives are fine now
            {"type": "cmd_data", "stream": "stdout", "data": base64.b64encode(b"hi\n").decode()},
            {"type": "cmd_end", "exit_code": 0},
        ):
            yield ev


def test_no_keepalive_before_the_start_event():
    from pipeline_steps.sandbox.commands import ProcessService

    async def ended(sb):
        pass

    pool = SimpleNamespace(limits=SimpleNamespace(max_output_bytes=1 << 20, exec_timeout=30.0), end_of_call=ended)
    sb = SimpleNamespace(cgroup=SimpleNamespace(freeze=lambda frozen: None), kernel=_SlowToStart())
    service = ProcessService(pool, sandbox_of=None)

    async def collect():
        return [r.event.event.field async for r in service._run(sb, {"argv": ["echo", "hi"]}, 30.0)]

    fields = asyncio.run(collect())
    assert fields == ["start", "keepalive", "data", "end"], fields
