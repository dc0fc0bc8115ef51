"""One poll loop for every job trigger: poll the job, report progress and new log lines, yield one event.

A backend's trigger says how to poll its job (:meth:`JobPollTrigger.poll`), how to read its log tail and what it
adds to the event; the loop, the tolerance for transient API failures, progress from verl's metrics file and the
event's common shape live here, so the operator's ``execute_complete`` does not care which backend ran the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.progress import ProgressTracker, format_progress, new_log_lines, scalar_metrics
from pipeline_steps.log_levels import LineLevels


@dataclasses.dataclass
class Poll:
    """One look at the job: ``state`` is ``running``, ``succeeded``, ``failed`` or ``gone`` (no longer exists)."""

    state: str
    fields: dict  # backend fields for the event (status, reason, dashboard URL, ...)
    label: str  # how the state reads in the task log ("jobDeploymentStatus=Running jobStatus=RUNNING")
    message: str | None = None  # why it failed or went away


class JobPollTrigger(BaseTrigger):
    """Base for the job triggers.

    :param poll_interval: seconds between polls.
    :param metrics_uri: verl's file-logger JSON lines (a local path or a store URI,
        :func:`operators.progress.read_text`).
    :param store_conn_id: the store connection the metrics are read with (a store URI on a cloud store).
    :param log_tail_lines: how many lines of the job's log to show and keep in the event.
    :param last_step: metric steps up to this one were already reported.
    :param max_api_errors: consecutive failures to reach the job's API tolerated before failing.
    """

    backend = ""

    def __init__(
        self,
        poll_interval: float = 30.0,
        metrics_uri: str | None = None,
        store_conn_id: str | None = None,
        log_tail_lines: int = 20,
        last_step: int = 0,
        max_api_errors: int = 10,
        metrics_reader: None = None,  # in triggers an earlier release serialized (always None there): ignored
    ):
        super().__init__()
        self.poll_interval, self.metrics_uri = poll_interval, metrics_uri
        self.store_conn_id = store_conn_id
        self.log_tail_lines, self.last_step, self.max_api_errors = log_tail_lines, last_step, max_api_errors

    # -- what a backend provides ----------------------------------------------------------------------------
    @property
    def job_name(self) -> str:
        raise NotImplementedError

    def job_fields(self) -> dict[str, Any]:
        """The backend's own constructor arguments (serialized with the common ones)."""
        raise NotImplementedError

    async def poll(self) -> Poll:
        """Look at the job once; raise on a transient failure to reach it (counted against ``max_api_errors``)."""
        raise NotImplementedError

    def static_fields(self) -> dict:
        """Event fields known without polling (so every event has them, an API failure's too)."""
        return {}

    async def log_tail(self, poll: Poll) -> list[str]:
        return []

    def api_failure(self, exc: Exception) -> str:
        return f"the API for job {self.job_name} kept failing: {exc}"

    def failure_message(self, poll: Poll, tail: list[str]) -> str:
        return poll.message or f"job {self.job_name} failed"

    # -- the loop ----------------------------------------------------------------------------------------------
    def serialize(self) -> tuple[str, dict[str, Any]]:
        common = {
            "poll_interval": self.poll_interval,
            "metrics_uri": self.metrics_uri,
            "store_conn_id": self.store_conn_id,
            "log_tail_lines": self.log_tail_lines,
            "last_step": self.last_step,
            "max_api_errors": self.max_api_errors,
        }
        return f"{type(self).__module__}.{type(self).__qualname__}", {**self.job_fields(), **common}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        progress = ProgressTracker(self.metrics_uri, self.last_step, self.store_conn_id)
        shown: list[str] = []
        seen, errors = None, 0
        levels = LineLevels()  # the job's lines at the levels the job gave them
        while True:
            try:
                poll = await self.poll()
                errors = 0
            except Exception as exc:  # the API did not answer: tolerate a few misses
                errors += 1
                if errors > self.max_api_errors:
                    yield TriggerEvent(self._event("error", {}, progress, shown, self.api_failure(exc)))
                    return
                self.log.warning("%s: API error (%s), %d/%d", self.job_name, exc, errors, self.max_api_errors)
                await asyncio.sleep(self.poll_interval)
                continue
            if poll.state == "gone":
                yield TriggerEvent(self._event("error", poll.fields, progress, shown, poll.message))
                return
            if poll.label != seen:
                self.log.info("%s: %s", self.job_name, poll.label)
                seen = poll.label
            await progress.poll(self.log)
            tail = await self.log_tail(poll)
            for line in new_log_lines(shown, tail):
                self.log.log(levels.level(line), "job log | %s", line)
            shown = tail or shown
            if poll.state != "running":
                ok = poll.state == "succeeded"
                message = None if ok else self.failure_message(poll, shown)
                yield TriggerEvent(self._event("success" if ok else "error", poll.fields, progress, shown, message))
                return
            await asyncio.sleep(self.poll_interval)

    def _event(self, kind: str, fields: dict, progress: ProgressTracker, tail: list[str], message: str | None) -> dict:
        return {
            "status": kind,
            "backend": self.backend,
            "name": self.job_name,
            "message": message,
            **self.static_fields(),
            **fields,
            "last_step": progress.last_row["step"] if progress.last_row else None,
            "last_progress": format_progress(progress.last_row) if progress.last_row else None,
            "metrics": scalar_metrics(progress.last_row),
            "log_tail": list(tail),
        }
