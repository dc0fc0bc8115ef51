"""How a task fails: bad input fails once (no retry), anything else fails so that Airflow's retries apply."""

from __future__ import annotations

import contextlib

from airflow.sdk.exceptions import AirflowFailException


class JobFailed(RuntimeError):
    """A training or step job ended without success (Airflow retries it: the next attempt resumes)."""


@contextlib.contextmanager
def user_errors(prefix: str = ""):
    """Turn a step-side ``UserError`` (bad input, one line) into a non-retryable task failure.

    :param prefix: what was being done, e.g. ``"pre-flight"``; prepended as ``"<prefix>: <message>"``.
    """
    from pipeline_steps.errors import UserError

    try:
        yield
    except UserError as exc:  # retrying the same input cannot help
        message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise AirflowFailException(f"{prefix}: {message}" if prefix else message) from None
