"""Legal but unusual bytes in a dataset, through the real preprocess step (CLI subprocess, as a user runs it).

* a UTF-8 byte-order mark before a JSONL file's first line: the first row is kept;
* one bad line among many (a lone surrogate escape, nesting 100 000 deep, invalid JSON, NaN, an over-long line): each
  is rejected with its reason and counted; no traceback; the rest of the file is kept;
* bad lines over --max-rejected-fraction: exit 2, one line;
* a NUL (or 0x1e/0x1f) byte inside a question: distinct rows stay distinct (the baseline: a separator-joined key
  made them one prompt with "conflicting" answers);
* rows dropped as conflicting ground truths count against --max-rejected-fraction.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from pipeline_steps.data.preprocessors import jsonl
from tests.helpers.step_cli import assert_refused, run_step


def row(i: int, question: str | None = None, answer: str | None = None) -> str:
    q = question if question is not None else f"What is {i} + 1? Reply with Answer: N."
    return json.dumps(
        {"messages": [{"role": "user", "content": q}], "rollout_extra": {"solution": answer or str(i + 1)}}
    )


def preprocess(src, out, *extra):
    return run_step("preprocess", "--dataset", "jsonl", "--input", src, "--output", out, *extra)


def test_bom_keeps_the_first_row(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(row(i) for i in range(5)).encode() + b"\n")
    code, summary, err = preprocess(src, tmp_path / "out")
    assert code == 0, err[-2000:]
    assert summary["rows_out"] == 5 and summary["rejected"] == 0


def test_each_bad_line_is_rejected_and_counted_without_a_traceback(tmp_path):
    good = [row(i) for i in range(200)]
    bad = {
        "lone_surrogate": row(0, "x\\ud800y").replace("\\\\ud800", "\\ud800"),
        "too_deep": '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "invalid_json": '{"messages": [',
        "nan": '{"messages": [{"role": "user", "content": "q"}], "rollout_extra": {"solution": NaN}}',
        "deep_but_parseable": '{"rollout_extra": {"solution": "1", "x": ' + "[" * 200 + "]" * 200 + "}}",
    }
    lines = good[:100] + list(bad.values()) + good[100:]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, summary, err = preprocess(src, tmp_path / "out")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert summary["rows_out"] == 200 and summary["rejected"] == len(bad)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rejected_by_reason"] == {"lone_surrogate": 1, "too_deep": 2, "invalid_json": 2}
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows == 200
    # the same bad lines over the limit: one line, exit 2, no output
    code, _, err = preprocess(src, tmp_path / "strict", "--max-rejected-fraction", "0.01")
    assert_refused(code, err, "above --max-rejected-fraction", "too_deep")
    assert not (tmp_path / "strict").exists()


def test_an_over_long_line_is_rejected_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 1000)
    src = tmp_path / "long.jsonl"
    long_q = "x" * 5000
    src.write_text("\n".join([row(0), row(1, long_q), row(2)]) + "\n")
    rows = list(jsonl._lines(src))
    assert [(n, reason) for n, _, reason in rows] == [(1, None), (2, "line_too_long"), (3, None)]


def test_nul_and_separator_bytes_do_not_merge_distinct_rows(tmp_path):
    # pairs that a separator-joined key ("prompt\x00answer", messages joined by \x1e/\x1f) made equal or conflicting
    questions = [
        ("a\x00b", "1"),
        ("a", "b\x00" + "1"),  # old key: "user\x1fa" + "\x00" + "b\x001" == "user\x1fa\x00b" + "\x00" + "1"
        ("p\x1eq", "2"),
        ("p\x1fq", "2"),
        ("x\x00y", "3"),
        ("x\x00z", "3"),
    ]
    lines = [row(i) for i in range(60)] + [row(0, q, a) for q, a in questions]
    src = tmp_path / "nul.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, summary, err = preprocess(src, tmp_path / "out")
    assert code == 0, err[-2000:]
    assert summary["rows_out"] == 60 + len(questions) and summary["duplicates"] == 0 and summary["rejected"] == 0
    kept = {r["prompt"][0]["content"] for r in pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()}
    assert {q for q, _ in questions} <= kept


def test_conflicting_rows_count_against_the_rejected_fraction(tmp_path):
    # 10 prompts each with two different answers: 20 of 40 rows dropped as conflicting
    lines = [row(i) for i in range(20)] + [row(100 + i, f"Q{i}", "1") for i in range(10)]
    lines += [row(100 + i, f"Q{i}", "2") for i in range(10)]
    src = tmp_path / "conflicts.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, _, err = preprocess(src, tmp_path / "out")
    assert_refused(code, err, "20 of 40 rows rejected", "conflicting_ground_truth")
    code, summary, err = preprocess(src, tmp_path / "out", "--max-rejected-fraction", "0.5")
    assert code == 0 and summary["rows_out"] == 20, err[-2000:]
