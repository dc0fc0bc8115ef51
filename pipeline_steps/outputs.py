"""Which directory a step may write: never one of its inputs, never someone else's non-empty directory.

Every step that replaces an output directory (atomically, see :mod:`pipeline_steps.atomic`) leaves a marker file
naming the step in it. Writing again into a non-empty directory is allowed only when that marker names the same
step (a re-run or retry); a directory holding anything else is refused with one line, so a mistyped ``--output``
can no longer delete a snapshot, a run's checkpoints or an unrelated folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline_steps.errors import UserError

MARKER = ".pipeline-output.json"  # not uploaded with a version (store/local_files.py skips it)


def _resolved(p: str | os.PathLike) -> Path:
    return Path(os.path.abspath(Path(p).expanduser())).resolve(strict=False)


def refuse_overlap(
    output: str | os.PathLike,
    inputs: dict[str, str | os.PathLike | list | None],
    what: str = "--output",
    allow_inside: bool = False,
):
    """One-line UserError when ``output`` equals, contains or lies inside one of ``inputs`` (flag -> path or paths).

    :param allow_inside: the output may lie inside an input (the report's default place is inside the run dir);
        it still may not be or contain it.
    """
    out = _resolved(output)
    for flag, values in inputs.items():
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if not value or "://" in str(value):  # store URIs are not local paths
                continue
            inp = _resolved(value)
            inside = inp in out.parents
            if out == inp or out in inp.parents or (inside and not allow_inside):
                relation = "is" if out == inp else "contains" if out in inp.parents else "lies inside"
                raise UserError(
                    f"{what} {output}: {relation} the input {flag} {value}; write the output somewhere else"
                )


def check_reusable(final: str | os.PathLike, owner: str, what: str = "--output") -> None:
    """``final`` may be (re)written by ``owner``: absent, empty, or an earlier output of the same step."""
    final = Path(final)
    if not final.exists() and not final.is_symlink():
        return
    if not final.is_dir() or final.is_symlink():
        raise UserError(f"{what} {final}: exists and is not a directory; choose a directory path")
    if not any(final.iterdir()):
        return
    try:
        marker = json.loads((final / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("step") != owner:
        whose = f"an output of step {marker.get('step')!r}" if isinstance(marker, dict) else "not a pipeline output"
        raise UserError(
            f"{what} {final}: a non-empty directory that is {whose}; {owner} replaces its output directory "
            "entirely, so choose a new or empty directory"
        )


def mark(directory: str | os.PathLike, owner: str) -> None:
    Path(directory, MARKER).write_text(json.dumps({"step": owner}) + "\n", encoding="utf-8")
