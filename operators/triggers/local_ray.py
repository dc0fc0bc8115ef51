"""Wait for a job on the local Ray cluster (the embedded backend), through Ray's job client in a thread."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from operators.triggers.job_poll import JobPollTrigger, Poll


class LocalRayJobTrigger(JobPollTrigger):
    """Polls one Ray job on the local cluster until it ends.

    :param address: the Ray dashboard address (``http://127.0.0.1:8265``).
    :param submission_id: the job's submission id.
    :param kwargs: :class:`operators.triggers.job_poll.JobPollTrigger`'s (poll interval, metrics, log tail, ...).
    """

    backend = "local"

    def __init__(self, address: str, submission_id: str, **kwargs):
        kwargs.setdefault("poll_interval", 5.0)
        super().__init__(**kwargs)
        self.address, self.submission_id = address, submission_id

    @property
    def job_name(self) -> str:
        return self.submission_id

    def job_fields(self) -> dict[str, Any]:
        return {"address": self.address, "submission_id": self.submission_id}

    def static_fields(self) -> dict:
        return {"dashboard_url": self.address, "job_status": None, "reason": None}

    async def poll(self) -> Poll:
        from pipeline_steps.local import ray_cluster

        try:
            details = await asyncio.to_thread(ray_cluster.info, self.address, self.submission_id)
        except ray_cluster.JobNotFoundError:
            return Poll(
                "gone",
                {},
                "gone",
                f"Ray job {self.submission_id} is not on the cluster at {self.address} "
                "any more (was the local Ray cluster restarted?)",
            )
        status = details["status"]
        state = "running" if status not in ray_cluster.TERMINAL else "succeeded" if status == "SUCCEEDED" else "failed"
        message = " ".join(str(details.get("message") or "").split())[:300]
        fields = {"job_status": status}
        # Ray's message for a failed entrypoint names its exit code: the step's failure class (2: bad input)
        if state == "failed" and (code := re.search(r"exit code (-?\d+)", message)):
            fields["exit_code"] = int(code.group(1))
        return Poll(state, fields, status, message)

    def failure_message(self, poll: Poll, tail: list[str]) -> str:
        last = f"; last log line: {tail[-1][:300]}" if tail else ""
        return f"Ray job {self.submission_id} ended {poll.fields['job_status']}: {poll.message}{last}"

    def api_failure(self, exc: Exception) -> str:
        return f"the local Ray cluster at {self.address} kept failing: {exc}"

    async def log_tail(self, poll: Poll) -> list[str]:
        from pipeline_steps.local import ray_cluster

        try:
            text = await asyncio.to_thread(ray_cluster.logs, self.address, self.submission_id)
        except Exception as exc:  # logs are best effort
            self.log.debug("no log for Ray job %s: %s", self.submission_id, exc)
            return []
        return str(text or "").splitlines()[-self.log_tail_lines :]

    async def on_kill(self) -> None:
        """A user killed the deferred task: stop the Ray job."""
        from pipeline_steps.local import ray_cluster

        try:
            await asyncio.to_thread(ray_cluster.stop, self.address, self.submission_id)
            self.log.info("stopped Ray job %s", self.submission_id)
        except ray_cluster.JobNotFoundError:
            pass
