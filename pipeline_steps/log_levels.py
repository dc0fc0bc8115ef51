"""The level of a line another process wrote to its log, for relaying it into a log of our own.

A step's stderr, a Ray job's driver log and verl's prints are text: relayed at one fixed level they would be either
all ERROR (how Airflow's task runner files anything its task writes to stderr: verl's "All configuration checks
passed successfully!" read as an error) or all INFO (a real traceback read as routine). :class:`LineLevels` reads
the level the child gave the line itself:

- a logging record's own level token: ``2026-11-27 10:00:00,123 WARNING name: ...`` (the steps' format),
  ``2026-11-27 10:00:00,123\\tINFO worker.py:1 -- ...`` (Ray's Python logs), ``WARNING: ...``, ``[ERROR] ...``,
  each optionally behind Ray's ``(TaskRunner pid=1)`` prefix, and glog's ``[2026-11-27 10:00:00,123 E 1 1]``;
- the steps' failure lines (``error: ...``, ``error (transient ...``, ``unexpected error ...``) and a Python
  traceback through its final exception line: ERROR;
- a line printed by Python's ``warnings`` (``file.py:12: UserWarning: ...``): WARNING;
- an indented line continues the record above it and keeps its level; anything else is ``default`` (INFO).
"""

from __future__ import annotations

import logging
import re

_NAMES = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
}
_GLOG = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_PREFIX = r"(?:\([^)]*\)\s+)?"  # Ray's "(TaskRunner pid=123) " in front of a worker's line
_STAMP = r"(?:\[?\d{4}-\d\d-\d\d[ T][0-9:.,]+\]?\s+)?"
_LEVELED = re.compile(rf"^{_PREFIX}{_STAMP}\[?(?P<level>{'|'.join(_NAMES)})\b")
_GLOG_LINE = re.compile(rf"^{_PREFIX}\[\d{{4}}-\d\d-\d\d [0-9:.,]+ (?P<level>[IWEF]) \d+ \d+\]")
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
_FAILURE = ("error:", "error (transient", "unexpected error")
_TRACEBACK = re.compile(rf"^{_PREFIX}Traceback \(most recent call last\):")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b")


class LineLevels:
    """Levels of one stream's lines, in order (a continuation line keeps the level of the record it continues)."""

    def __init__(self, default: int = logging.INFO):
        self.default = default
        self._current = default
        self._traceback = False

    def level(self, line: str) -> int:
        if line[:1] in (" ", "\t") and line.strip():  # a record's continuation: a traceback's frames, a wrapped line
            return self._current
        if m := _LEVELED.match(line) or _GLOG_LINE.match(line):
            level = m.group("level")
            self._current, self._traceback = _NAMES.get(level) or _GLOG[level], False
            return self._current
        if _TRACEBACK.match(line):
            self._current, self._traceback = logging.ERROR, True
            return logging.ERROR
        if self._traceback and _EXCEPTION.match(line):  # the traceback's last line: the exception itself
            self._current, self._traceback = self.default, False
            return logging.ERROR
        if line.startswith(_FAILURE):
            self._current, self._traceback = self.default, False
            return logging.ERROR
        if _WARNING.match(line):
            self._current = logging.WARNING  # the next line is the source line, indented
            return logging.WARNING
        if self._traceback and line.strip():  # "During handling of the above exception ..." and chained frames
            return logging.ERROR
        self._current = self.default
        return self.default


def relay(log: logging.Logger, lines, fmt: str = "%s", default: int = logging.INFO) -> None:
    """Log each line of ``lines`` to ``log`` at its own level (``fmt`` with the line as its one argument)."""
    levels = LineLevels(default)
    for line in lines:
        line = line.rstrip("\n")
        log.log(levels.level(line), fmt, line)
