"""Steps never delete their inputs or someone else's directory: the three reported cases and their neighbours,
through the real CLI.

Before: ``preprocess --input snaps/gsm8k/<commit> --output snaps/gsm8k`` exited 0 after deleting the input snapshot
and an unrelated file beside it; ``report --run-dir R --output R`` deleted the run's checkpoints and metrics;
``build-tiny-model --output DIR`` deleted whatever DIR held.
"""

from __future__ import annotations

import json

import pytest

from pipeline_steps.outputs import MARKER
from tests.helpers.step_cli import assert_refused, run_step


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def snapshot(offline_hub, tmp_path):
    code, s, err = run_step("download", "--dataset", "gsm8k", "--revision", "main", "--dest", tmp_path / "snaps")
    assert code == 0, err
    return tmp_path / "snaps", s


def test_preprocess_into_the_folder_holding_its_input_isassert_refused(snapshot, tmp_path):
    snaps, s = snapshot
    (snaps / "gsm8k" / "notes.txt").write_text("unrelated")
    before = _tree(snaps)
    code, _, err = run_step("preprocess", "--dataset", "gsm8k", "--input", s["path"], "--output", snaps / "gsm8k")
    assert_refused(code, err, "--output", "contains the input --input")
    assert _tree(snaps) == before
    code, _, err = run_step("preprocess", "--dataset", "gsm8k", "--input", s["path"], "--output", s["path"])
    assert_refused(code, err, "is the input --input")
    code, _, err = run_step("preprocess", "--dataset", "gsm8k", "--input", s["path"], "--output", f"{s['path']}/x")
    assert_refused(code, err, "lies inside the input --input")
    assert _tree(snaps) == before


def test_preprocess_refuses_an_unrelated_non_empty_directory_but_reruns_into_its_own(snapshot, tmp_path):
    _, s = snapshot
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    code, _, err = run_step("preprocess", "--dataset", "gsm8k", "--input", s["path"], "--output", other)
    assert_refused(code, err, "not a pipeline output", "new or empty directory")
    assert (other / "thesis.tex").read_text() == "years of work"

    out = tmp_path / "processed"
    for _ in range(2):  # a re-run (or retry) writes into its own earlier output
        code, summary, err = run_step(
            "preprocess", "--dataset", "gsm8k", "--input", s["path"], "--output", out, "--no-skip-existing"
        )
        assert code == 0, err
    assert json.loads((out / MARKER).read_text()) == {"step": "preprocess"}
    code, _, err = run_step("build-tiny-model", "--output", out)  # another step's output is not its to replace
    assert_refused(code, err, "an output of step 'preprocess'")
    assert (out / "train.parquet").is_file()


def test_report_cannot_replace_the_run_directory_or_its_checkpoints(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step_1" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    (run / "metrics.jsonl").write_text('{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    before = _tree(run)
    code, _, err = run_step("report", "--run-dir", run, "--output", run)
    assert_refused(code, err, "is the input --run-dir")
    code, _, err = run_step("report", "--run-dir", run, "--output", tmp_path)
    assert_refused(code, err, "contains the input --run-dir")
    code, _, err = run_step("report", "--run-dir", run, "--output", run / "checkpoints")
    assert_refused(code, err, "not a pipeline output")
    assert _tree(run) == before
    code, _, err = run_step("report", "--run-dir", run)  # the default place, inside the run dir, still works
    assert code == 0, err
    assert (run / "report" / "report.md").is_file() and (run / "checkpoints" / "global_step_1").is_dir()


@pytest.mark.slow  # about 6 s of CPU: the tiny model built
def test_build_tiny_model_keeps_an_existing_directory_that_is_not_its_own(tmp_path):
    target = tmp_path / "models"
    target.mkdir()
    (target / "keep.bin").write_bytes(b"\0" * 10)
    code, _, err = run_step("build-tiny-model", "--output", target)
    assert_refused(code, err, "not a pipeline output")
    assert (target / "keep.bin").is_file()
    out = tmp_path / "tiny"
    for _ in range(2):  # random weights (no format warm-up): this is about the output directory, not the model
        code, _, err = run_step("build-tiny-model", "--output", out, "--format-warmup-steps", 0)
        assert code == 0, err
    assert (out / "config.json").is_file()
    code, _, err = run_step("build-tiny-model", "--output", tmp_path / "x", "--corpus", tmp_path)
    assert_refused(code, err, "lies inside the input --corpus")


def test_a_dest_that_is_a_file_is_one_line(tmp_path, offline_hub):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = run_step("download", "--dataset", "gsm8k", "--revision", "main", "--dest", f)
    assert_refused(code, err, "--dest", "not a directory")


def test_a_concurrent_writer_of_the_same_output_keeps_its_work_in_progress(tmp_path):
    """Two backfill runs of one dataset version preprocess into the same output at the same time. Each writer's
    temporary directory carries its pid: the second writer must not delete the first one's as a crashed run's
    leftover (it did, and the first run's preprocess failed), while a dead writer's is removed."""
    import subprocess
    import sys

    from pipeline_steps import atomic

    final = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    crashed = tmp_path / f".tmp-out.{dead.pid}.abcd1234"
    crashed.mkdir()
    with atomic.atomic_dir(final) as first:
        (first / "a.parquet").write_bytes(b"first")
        with atomic.atomic_dir(final) as second:  # starts while the first is still writing
            assert first.is_dir() and (first / "a.parquet").is_file()
            assert not crashed.exists()  # a dead writer's leftovers go
            (second / "a.parquet").write_bytes(b"second")
        assert (final / "a.parquet").read_bytes() == b"second"
    assert (final / "a.parquet").read_bytes() == b"first"  # the later rename wins; nothing was lost or mixed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
