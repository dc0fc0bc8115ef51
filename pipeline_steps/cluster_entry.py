"""Run one pipeline step inside a Ray job and leave its JSON summary in a file on the shared mount.

``python3 -m pipeline_steps.cluster_entry --summary-file PATH -- <step> [step args ...]``

On the cluster the Airflow worker cannot read the step's stdout (it is only in the Ray job's log), so the
step's last stdout line (the one-line JSON summary every step prints, see :mod:`pipeline_steps.cli`) is
also written, with the exit code, to ``PATH``: ``{"exit_code": N, "summary": {...}}``. The write is atomic
(temporary sibling + rename), so a reader sees no file or a complete one. The process exits with the step's
own exit code, so KubeRay reports the job FAILED exactly when the step failed.
"""

from __future__ import annotations

import io
import json
import sys

from pipeline_steps import atomic, cli
from pipeline_steps.errors import UserError

USAGE = "usage: python3 -m pipeline_steps.cluster_entry --summary-file PATH -- <step> [args ...]"


class _Tee(io.TextIOBase):
    """Writes go to the real stream (the Ray job log) and are kept, so the last line can be read back."""

    KEEP = 1 << 20  # the summary is one line; keep only the tail of whatever else a step prints

    def __init__(self, stream):
        self.stream, self.tail = stream, ""

    def write(self, s: str) -> int:
        self.tail = (self.tail + s)[-self.KEEP :]
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:  # libraries that hand stdout to a child process get the real one
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self):
        return self.stream.encoding

    def last_line(self) -> str:
        lines = self.tail.strip().splitlines()
        return lines[-1] if lines else ""


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(summary file, step argv) from ``--summary-file PATH -- STEP ARGS``; argv after ``--`` is never parsed here."""
    if "--" not in argv:
        raise UserError(f"cluster_entry: missing '--' before the step; {USAGE}")
    head, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    if len(head) != 2 or head[0] != "--summary-file" or not head[1] or not rest:
        raise UserError(f"cluster_entry: expected --summary-file PATH, then '--' and the step; {USAGE}")
    return head[1], rest


def main(argv: list[str] | None = None) -> int:
    try:
        summary_file, step_argv = split_argv(list(sys.argv[1:] if argv is None else argv))
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    tee, real = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        rc = cli.main(step_argv)
    finally:
        sys.stdout = real
    try:
        summary = json.loads(tee.last_line())
    except ValueError:
        summary = {}
    if not isinstance(summary, dict):
        summary = {}
    atomic.write_json(summary_file, {"exit_code": rc, "summary": summary})
    return rc


if __name__ == "__main__":
    sys.exit(main())
