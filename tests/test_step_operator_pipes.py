"""The step operator drains the child's stdout while it streams stderr: a step that writes more than a pipe buffer
(64 KiB) to either stream must not hang the task. Real subprocess, real pipes; only the command is a stand-in
script (a real step does not print a megabyte on purpose)."""

from __future__ import annotations

import sys
import threading

import pytest

from operators.step import PipelineStepOperator

FLOOD = (
    "import json, sys\n"
    "for i in range(16384): sys.stdout.write('o' * 63 + '\\n'); sys.stderr.write('e' * 63 + '\\n')\n"
    "sys.stdout.write(json.dumps({'ok': True, 'step': 'flood', 'n': 16384}) + '\\n')\n"
)


class FloodOperator(PipelineStepOperator):
    def command(self, args):
        return [sys.executable, "-c", FLOOD]


@pytest.mark.timeout(120)
def test_a_megabyte_on_each_stream_does_not_hang_and_the_summary_is_read():
    op = FloodOperator(task_id="flood", step="flood", hf_conn_id=None, store_conn_id=None)
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("result", op.execute({"ti": None})), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the operator hung on a full pipe"
    assert done["result"]["flood"] == {"n": 16384}
