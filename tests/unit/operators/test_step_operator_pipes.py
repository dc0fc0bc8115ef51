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


@pytest.mark.slow  # about 20 s of CPU: a real Airflow task runner
@pytest.mark.budget(60)
def test_a_step_s_lines_reach_the_task_log_at_the_levels_the_step_gave_them():
    """Airflow files whatever a task writes to stderr as ERROR; the operator relays the step's stderr line by line at
    the level each line carries. Real step (``preflight``: verl's own ``validate_config``): verl's "All configuration
    checks passed successfully!" is not an error; the step's own ``error:`` line on a rejected config is."""
    from airflow.sdk.exceptions import AirflowFailException
    from structlog.testing import capture_logs

    def run(*extra: str) -> list[dict]:
        args = ["--experiment", "local_tiny", "--skip-store-check", *extra]
        op = PipelineStepOperator(
            task_id="preflight", step="preflight", request={"args": args}, hf_conn_id=None, store_conn_id=None
        )
        with capture_logs() as records:
            try:
                op.execute({"ti": None})
            except AirflowFailException:
                pass
        return records

    ok = run()
    passed = [r for r in ok if "All configuration checks passed successfully" in r["event"]]
    assert passed and all(r["log_level"] == "info" for r in passed), ok
    assert not [r for r in ok if r["log_level"] in ("error", "critical")], ok
    bad = run("--override=algorithm.adv_estimator=no_such_estimator")
    errors = [r for r in bad if r["event"].startswith("error:")]
    assert errors and all(r["log_level"] == "error" for r in errors), bad
