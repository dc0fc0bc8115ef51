"""Bad input is exit 2 with one line, no traceback and nothing left behind, so Airflow does not retry it twice for
nothing. A catalogue per step through the real CLI (``python -m pipeline_steps``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.step_cli import run_step


def _registry(tmp_path, text: bytes):
    f = tmp_path / "reg.yaml"
    f.write_bytes(text)
    return f


def _export_args(tmp_path, results: dict):
    r = tmp_path / "results.json"
    r.write_text(json.dumps(results))
    lineage = tmp_path / "lineage.json"
    lineage.write_text("{}")
    ck = tmp_path / "ck"
    ck.mkdir()
    return [
        "export",
        "--checkpoint-dir",
        ck,
        "--eval-results",
        r,
        "--base-results",
        r,
        "--lineage",
        lineage,
        "--experiment",
        "e",
        "--store-root",
        f"file://{tmp_path / 'store'}",
        "--output",
        tmp_path / "out",
    ]


CASES = {
    "download empty revision": (
        lambda t: ["download", "--dataset", "gsm8k", "--revision", "", "--dest", t / "out"],
        "--revision",
    ),
    "registry value of the wrong type": (
        lambda t: [
            "download",
            "--dataset",
            "mine",
            "--dest",
            t / "out",
            "--registry",
            _registry(t, b"mine:\n  repo_id: openai/gsm8k\n  preprocessor: gsm8k\n  allow_patterns: 'main/*'\n"),
        ],
        "allow_patterns",
    ),
    "registry not UTF-8": (
        lambda t: ["download", "--dataset", "mine", "--dest", t / "out", "--registry", _registry(t, b"\xff\xfe\x00x")],
        "registry",
    ),
    "dest is a file": (
        lambda t: ["download", "--dataset", "gsm8k", "--dest", _registry(t, b"x")],
        "--dest",
    ),
    "parquet column of the wrong type": (
        lambda t: ["preprocess", "--dataset", "gsm8k", "--input", _bad_parquet(t), "--output", t / "out"],
        "question",
    ),
    "export results without problems": (
        lambda t: _export_args(t, {"overall": {"avg@k": 0.5, "k": 2, "samples_scored": 4}}),
        "problems",
    ),
    "read-only destination": (
        lambda t: ["build-tiny-model", "--output", _read_only(t) / "model"],
        "--output",
    ),
    "negative format warm-up": (
        lambda t: ["build-tiny-model", "--output", t / "model", "--format-warmup-steps", "-1"],
        "--format-warmup-steps",
    ),
}


def _bad_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "snap" / "main"
    d.mkdir(parents=True)
    pq.write_table(
        pa.table({"question": [1, 2, 3], "answer": ["#### 1", "#### 2", "#### 3"]}), d / "train-00000-of-00001.parquet"
    )
    return tmp_path / "snap"


def _read_only(tmp_path):
    """A directory nobody may create files in: as root (CI) a mode bit is not enough, /proc refuses everyone."""
    if os.geteuid() == 0:
        return Path("/proc/verl-pipeline-test")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_line_and_no_output(name, tmp_path, offline_hub):
    make, needle = CASES[name]
    code, summary, err = run_step(*make(tmp_path))
    assert code == 2, (name, code, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert summary["ok"] is False
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
