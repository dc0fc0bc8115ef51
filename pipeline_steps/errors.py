"""The two kinds of failure a step reports (README, "Failure classes"):

* :class:`UserError`: bad input or usage; the CLI prints one line and exits 2; the operators fail the task without
  retries (the same input fails the same way);
* :class:`TransientError`: a passing fault of the environment (network errors, HTTP 5xx, throttling, timeouts, a
  transfer whose checksum does not match, a full disk); the CLI prints one line and exits 1; Airflow retries the task
  with back-off. Any other exception is also exit 1 (unexpected, retried).
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input or usage. The message says which input, what is wrong and what to do."""


class TransientError(Exception):
    """A fault that a later attempt may not meet. The message names what failed and that it will be retried."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException | None) -> OSError | None:
    """The full-disk OSError behind ``exc`` (itself, its cause or its context, also when re-raised ``from None``)."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None
