"""Custom JSONL in the shape hosted RL services take: ``{"messages": [...], "rollout_extra": {"solution": ...}}``.

Lines are read one by one, each parsed on its own, so that a bad line is a counted rejection (against
``--max-rejected-fraction``), never a failed file or a traceback: not UTF-8, not JSON (``NaN`` included), longer than
``MAX_LINE_BYTES``, nested deeper than ``MAX_DEPTH``, or holding a lone surrogate (``"\\ud800"``: legal JSON text that
is no Unicode string and cannot be written to parquet). A UTF-8 byte-order mark before the first line is skipped.
Trailing assistant messages (reference answers) are dropped from the prompt.

``rollout_extra`` is kept as what it is, a JSON object: a parquet struct in ``extra_info.rollout_extra``, so verl's
dataset hands it to a reward function as a dict on the cluster as well as locally (verl passes ``extra_info`` to
``compute_score`` unchanged). Rows need not have the same keys: the struct holds the union of every row's keys (a
key a row lacks is None there). Its type is fixed before any row is written, by a first pass over the input
(:func:`row_schema`): the preprocess step streams rows in batches, and a type inferred batch by batch would differ
between batches. A key whose type differs between rows (a string in one, a number in another) is refused in one line
naming the key and both rows; integers and decimals mix as decimals (JSON has one number type).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_steps.data.preprocessors import register_preprocessor
from pipeline_steps.data.preprocessors.common import Reject
from pipeline_steps.errors import UserError

DATA_SOURCE = "math_dapo"  # rule-based "Answer:" matching; set data_source in the registry entry for another scorer
REQUIRED_COLUMNS = ()
TOOL_NAME = "code_interpreter"


MAX_LINE_BYTES = 16 << 20  # one row; a longer line is rejected without being held whole in memory
MAX_DEPTH = 64  # nesting of objects and lists; the rows verl reads are 4 deep
BOM = b"\xef\xbb\xbf"


def _reject_const(name):
    raise ValueError(f"{name} is not JSON")


def _problem(value) -> str | None:
    """Why a parsed line is unusable (too deep, a lone surrogate), else None; iterative, so depth costs no stack."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items = list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            items = v
        else:
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return "lone_surrogate"
            continue
        if depth > MAX_DEPTH:
            return "too_deep"
        stack.extend((item, depth + 1) for item in items)
    return None


def _raw_lines(f):
    """(line number, bytes | None when longer than MAX_LINE_BYTES) per line."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # skip the rest of the line, a chunk at a time
                raw = f.readline(1 << 20)
            yield lineno, None
            continue
        yield lineno, raw[len(BOM) :] if lineno == 1 and raw.startswith(BOM) else raw


def _lines(path):
    """(line number, row | None, reject reason | None) per non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in _raw_lines(f):
            if raw is None:
                yield lineno, {"raw": f"<line {lineno}: over {MAX_LINE_BYTES} bytes>"}, "line_too_long"
                continue
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, {"raw": raw[:200].decode("utf-8", "replace")}, "not_utf8"
                continue
            shown = {"raw": text[:200].encode("utf-8", "replace").decode("utf-8")}
            try:
                row = json.loads(text, parse_constant=_reject_const)
            except RecursionError:
                yield lineno, shown, "too_deep"
                continue
            except ValueError:  # JSONDecodeError, NaN/Infinity
                yield lineno, shown, "invalid_json"
                continue
            if not isinstance(row, dict):
                yield lineno, shown, "not_an_object"
                continue
            problem = _problem(row)
            if problem:
                yield lineno, shown, problem
                continue
            yield lineno, row, None


def read_rows(path):
    for _, row, reason in _lines(path):
        yield row, reason


# -- the rollout_extra struct's type ---------------------------------------------------------------------------------

_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}


class _Type:
    """The type of one ``rollout_extra`` key over every row seen so far, and the first row that gave it."""

    __slots__ = ("kind", "where", "fields", "item")

    def __init__(self):
        self.kind: str | None = None  # None while only nulls were seen
        self.where = ""
        self.fields: dict[str, _Type] = {}
        self.item: _Type | None = None

    def add(self, value, key: str, where: str) -> None:
        if value is None:
            return
        kind = _KINDS.get(type(value), "string")
        if self.kind is None:
            self.kind, self.where = kind, where
        elif self.kind != kind:
            if {self.kind, kind} == {"integer", "number"}:
                self.kind = "number"
            else:
                raise UserError(
                    f"rollout_extra key {key!r} is {_a(self.kind)} in {self.where} and {_a(kind)} in {where}; give "
                    "the key one type in every row (or leave it out, or null, where it does not apply)"
                )
        if kind == "object":
            for k, v in value.items():
                self.fields.setdefault(str(k), _Type()).add(v, f"{key}.{k}" if key else str(k), where)
        elif kind == "list":
            for v in value:
                if self.item is None:
                    self.item = _Type()
                self.item.add(v, f"{key}[]", where)
        elif kind == "integer" and not -(1 << 63) <= value < 1 << 63:
            raise UserError(
                f"rollout_extra key {key!r} in {where}: {value} does not fit a 64-bit integer; store it as a string"
            )

    def arrow(self, key: str):
        import pyarrow as pa

        if self.kind is None:
            return pa.null()
        if self.kind == "object":
            if not self.fields:
                raise UserError(
                    f"rollout_extra key {key!r} is an empty object in every row ({self.where}); parquet cannot store "
                    "an object without keys: drop it or give it a key"
                )
            return pa.struct([pa.field(k, t.arrow(f"{key}.{k}" if key else k)) for k, t in sorted(self.fields.items())])
        if self.kind == "list":
            return pa.list_(self.item.arrow(f"{key}[]") if self.item else pa.null())
        return {"boolean": pa.bool_(), "integer": pa.int64(), "number": pa.float64(), "string": pa.string()}[self.kind]


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def rollout_extra_type(paths):
    """First pass: the struct type of ``rollout_extra`` over every row that converts (rejected rows do not count)."""
    root = _Type()
    for path in paths:
        name = Path(path).name
        for lineno, row, reason in _lines(path):
            if reason:
                continue
            try:
                converted = convert_row(row, "", 0, "")
            except Reject:
                continue
            root.add(converted["extra_info"]["rollout_extra"], "", f"line {lineno} of {name}")
    return root.arrow("")


def row_schema(paths):
    """The schema of every converted row (preprocess writes all batches and splits in it)."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("split", pa.string()), ("index", pa.int64()), ("rollout_extra", rollout_extra_type(paths))]
                ),
            ),
        ]
    )


# -- the row --------------------------------------------------------------------------------------------------------


@register_preprocessor(
    "jsonl", data_source=DATA_SOURCE, tool_name=TOOL_NAME, read_rows=read_rows, row_schema=row_schema
)
def convert_row(row: dict, split: str, index: int, data_source: str) -> dict:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Reject("missing_messages")
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise Reject("malformed_message")
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not any(m["role"] == "user" for m in messages):
        raise Reject("no_user_message")
    extra = row.get("rollout_extra")
    solution = extra.get("solution") if isinstance(extra, dict) else None
    if solution is None or str(solution).strip() == "":
        raise Reject("missing_solution")
    return {
        "data_source": data_source,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in messages],
        "ability": "custom",
        "reward_model": {"style": "rule", "ground_truth": str(solution).strip()},
        "extra_info": {"split": split, "index": index, "rollout_extra": extra},
    }
