"""Trigger that waits for a job on the local Ray cluster (the embedded backend).

It polls the job through :mod:`pipeline_steps.local.ray_cluster` (Ray's ``JobSubmissionClient``,
run in a thread: the client is synchronous), reports progress the same way as the
KubeRay trigger (verl file-logger metrics and the job's log tail), and yields one
:class:`TriggerEvent` with the same shape, so the operator's ``execute_complete`` does not
care which backend trained.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.rayjob import ProgressTracker, format_progress, new_log_lines, scalar_metrics


class LocalRayJobTrigger(BaseTrigger):
    """Polls one Ray job on the local cluster until it ends.

    :param address: the Ray dashboard address (``http://127.0.0.1:8265``).
    :param submission_id: the job's submission id.
    :param poll_interval: seconds between polls.
    :param metrics_uri: verl's file-logger JSON lines written by the job.
    :param metrics_reader: ``module.function`` reading a URI to text (default: local path or store URI).
    :param log_tail_lines: how many lines of the job's log to keep in the event.
    :param last_step: metric steps up to this one were already reported.
    :param max_api_errors: consecutive failures to reach the cluster tolerated before failing.
    """

    def __init__(
        self,
        address: str,
        submission_id: str,
        poll_interval: float = 5.0,
        metrics_uri: str | None = None,
        metrics_reader: str | None = None,
        log_tail_lines: int = 20,
        last_step: int = 0,
        max_api_errors: int = 10,
    ):
        super().__init__()
        self.address, self.submission_id = address, submission_id
        self.poll_interval, self.metrics_uri, self.metrics_reader = poll_interval, metrics_uri, metrics_reader
        self.log_tail_lines, self.last_step, self.max_api_errors = log_tail_lines, last_step, max_api_errors

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "address": self.address,
                "submission_id": self.submission_id,
                "poll_interval": self.poll_interval,
                "metrics_uri": self.metrics_uri,
                "metrics_reader": self.metrics_reader,
                "log_tail_lines": self.log_tail_lines,
                "last_step": self.last_step,
                "max_api_errors": self.max_api_errors,
            },
        )

    async def _tail(self) -> list[str]:
        from pipeline_steps.local import ray_cluster as local_ray

        try:
            text = await asyncio.to_thread(local_ray.logs, self.address, self.submission_id)
        except Exception as exc:  # logs are best effort
            self.log.debug("no log for Ray job %s: %s", self.submission_id, exc)
            return []
        return str(text or "").splitlines()[-self.log_tail_lines :]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from pipeline_steps.local import ray_cluster as local_ray

        progress = ProgressTracker(self.metrics_uri, self.metrics_reader, self.last_step)
        shown: list[str] = []
        seen, errors = None, 0
        while True:
            try:
                details = await asyncio.to_thread(local_ray.info, self.address, self.submission_id)
                errors = 0
            except local_ray.JobNotFoundError:
                yield TriggerEvent(
                    self._event(
                        "error",
                        None,
                        None,
                        progress,
                        shown,
                        f"Ray job {self.submission_id} is not on the cluster at {self.address} "
                        "any more (was the local Ray cluster restarted?)",
                    )
                )
                return
            except Exception as exc:  # the cluster did not answer: tolerate a few misses
                errors += 1
                if errors > self.max_api_errors:
                    yield TriggerEvent(
                        self._event(
                            "error",
                            None,
                            None,
                            progress,
                            shown,
                            f"the local Ray cluster at {self.address} kept failing: {exc}",
                        )
                    )
                    return
                self.log.warning(
                    "Ray job %s: cluster did not answer (%s), %d/%d",
                    self.submission_id,
                    exc,
                    errors,
                    self.max_api_errors,
                )
                await asyncio.sleep(self.poll_interval)
                continue
            status = details["status"]
            if status != seen:
                self.log.info("Ray job %s: %s", self.submission_id, status)
                seen = status
            await progress.poll(self.log)
            tail = await self._tail()
            for line in new_log_lines(shown, tail):
                self.log.info("job log | %s", line)
            shown = tail or shown
            if status in local_ray.TERMINAL:
                ok = status == "SUCCEEDED"
                message = (
                    None
                    if ok
                    else (
                        f"Ray job {self.submission_id} ended {status}: "
                        f"{' '.join(str(details.get('message') or '').split())[:300]}"
                        + (f"; last log line: {shown[-1][:300]}" if shown else "")
                    )
                )
                yield TriggerEvent(self._event("success" if ok else "error", status, details, progress, shown, message))
                return
            await asyncio.sleep(self.poll_interval)

    def _event(
        self,
        kind: str,
        status: str | None,
        details: dict | None,
        progress: ProgressTracker,
        tail: list[str],
        message: str | None,
    ) -> dict:
        return {
            "status": kind,
            "backend": "local",
            "name": self.submission_id,
            "message": message,
            "job_status": status,
            "reason": None,
            "dashboard_url": self.address,
            "last_step": progress.last_row["step"] if progress.last_row else None,
            "last_progress": format_progress(progress.last_row) if progress.last_row else None,
            "metrics": scalar_metrics(progress.last_row),
            "log_tail": list(tail),
        }

    async def on_kill(self) -> None:
        """A user killed the deferred task: stop the Ray job."""
        from pipeline_steps.local import ray_cluster as local_ray

        try:
            await asyncio.to_thread(local_ray.stop, self.address, self.submission_id)
            self.log.info("stopped Ray job %s", self.submission_id)
        except local_ray.JobNotFoundError:
            pass
