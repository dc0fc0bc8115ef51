"""Skip-if-present reuses an output only for the same input, dataset, preprocessor and options; a committed model
version is never replaced by different content. Real CLI; file:// store.

Before: a JSONL with a line appended re-used the stale output; ``preprocess --dataset aime2024`` into gsm8k's output
reported aime2024 with gsm8k's content hash; ``stage-model`` of ``b/mymodel`` at revision v1 silently replaced
``a/mymodel`` at v1.
"""

from __future__ import annotations

import json

from tests.helpers.step_cli import run_step


def _rows(n):
    return [
        {"messages": [{"role": "user", "content": f"What is {i}+1?"}], "rollout_extra": {"solution": str(i + 1)}}
        for i in range(n)
    ]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_appended_line_is_not_served_from_the_stale_output(tmp_path):
    f, out = tmp_path / "train.jsonl", tmp_path / "out"
    _write(f, _rows(10))
    code, first, err = run_step("preprocess", "--dataset", "jsonl", "--input", f, "--output", out)
    assert code == 0 and first["rows_out"] == 10, err
    code, again, err = run_step("preprocess", "--dataset", "jsonl", "--input", f, "--output", out)
    assert code == 0 and again["skipped"] is True and again["content_hash"] == first["content_hash"]
    _write(f, _rows(11))  # one more line
    code, after, err = run_step("preprocess", "--dataset", "jsonl", "--input", f, "--output", out)
    assert code == 0 and after["skipped"] is False and after["rows_out"] == 11, after
    assert after["content_hash"] != first["content_hash"]
    code, limited, err = run_step("preprocess", "--dataset", "jsonl", "--input", f, "--output", out, "--limit", "3")
    assert code == 0 and limited["skipped"] is False and limited["rows_out"] == 3  # another option, another output


def test_another_dataset_into_the_same_output_is_processed_not_reused(offline_hub, tmp_path):
    snaps = tmp_path / "snaps"
    code, g, err = run_step("download", "--dataset", "gsm8k", "--dest", snaps)
    assert code == 0, err
    code, a, err = run_step("download", "--dataset", "aime2024", "--dest", snaps)
    assert code == 0, err
    out = tmp_path / "processed"
    code, gs, err = run_step("preprocess", "--dataset", "gsm8k", "--input", g["path"], "--output", out)
    assert code == 0, err
    code, s, err = run_step("preprocess", "--dataset", "aime2024", "--input", a["path"], "--output", out)
    assert code == 0, err
    assert s["skipped"] is False and s["dataset"] == "aime2024" and s["content_hash"] != gs["content_hash"]


def test_a_committed_model_version_is_never_replaced_by_other_weights(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    a, b = tmp_path / "a" / "mymodel", tmp_path / "b" / "mymodel"
    for d, content in ((a, b"weights of a"), (b, b"weights of b")):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(content)
    code, first, err = run_step("stage-model", "--model", a, "--revision", "v1", "--dest", store)
    assert code == 0, err
    code, _, err = run_step("stage-model", "--model", b, "--revision", "v1", "--dest", store)
    assert code == 2 and "already holds a different model" in err and err.count("\n") == 1
    staged = tmp_path / "store" / "models" / "local" / "mymodel" / "v1" / "model.safetensors"
    assert staged.read_bytes() == b"weights of a"
    code, again, err = run_step("stage-model", "--model", a, "--revision", "v1", "--dest", store)
    assert code == 0 and again["skipped"] is True  # the same content is still a no-op
