"""The preprocess engine (pipeline_steps/data/preprocessing.py and its parts) called as a library, without the step:

* the preprocessor registry: every built-in dataset's preprocessor is registered by name, with what the engine reads;
  an unknown name is one line naming the known ones; a second function under a taken name is refused;
* ``process``: exact duplicates removed, conflicting ground truths kept out and written to ``rejected.jsonl``, the
  stats counted per split, batch by batch (a batch of one row gives the same output as one batch);
* ``write_output``: the rejected fraction over its bound is one line and no output; an earlier output is reused only
  for the same settings (``existing``).
The step's own tests (flags, summary, the store) are tests/unit/pipeline_steps/steps/test_preprocess.py.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline_steps.data import preprocessing, registry, row_batches
from pipeline_steps.data.preprocessors import (
    Preprocessor,
    get_preprocessor,
    preprocessor_names,
    register_preprocessor,
)
from pipeline_steps.data.snapshot_splits import input_fingerprint
from pipeline_steps.errors import UserError

JSONL = registry.BUILTIN["jsonl"]


def line(question: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": question}], "rollout_extra": {"solution": answer}})


def write(path, lines):
    path.write_text("".join(x + "\n" for x in lines))
    return path


def test_every_builtin_dataset_names_a_registered_preprocessor():
    assert set(preprocessor_names()) == {"aime", "dapo_math", "geometry3k", "gsm8k", "jsonl"}
    for spec in registry.BUILTIN.values():
        pre = get_preprocessor(spec.preprocessor)
        assert isinstance(pre, Preprocessor) and pre.name == spec.preprocessor
        assert (pre.convert_row is None) != (pre.convert_batch is None), pre.name
        assert pre.data_source and pre.tool_name
    assert get_preprocessor("dapo_math").convert_batch is not None
    assert get_preprocessor("jsonl").read_rows is not None and get_preprocessor("jsonl").row_schema is not None
    assert get_preprocessor("aime").split_names == {"train": "test"}
    assert get_preprocessor("geometry3k").tool_system_prompt


def test_an_unknown_preprocessor_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError) as e:
        get_preprocessor("gsm9k")
    assert "\n" not in str(e.value)
    assert "'gsm9k' is not registered" in str(e.value) and "aime, dapo_math, geometry3k, gsm8k, jsonl" in str(e.value)


def test_a_user_registry_entry_with_an_unknown_preprocessor_is_refused(tmp_path):
    path = tmp_path / "datasets.json"
    path.write_text(json.dumps({"mine": {"repo_id": "org/mine", "preprocessor": "gsm9k"}}))
    with pytest.raises(UserError, match=r"preprocessor 'gsm9k' unknown; choose one of \('aime', 'dapo_math'"):
        registry.load(str(path))


def test_a_second_function_under_a_taken_name_is_refused():
    get_preprocessor("gsm8k")

    def convert_row(row, split, index, data_source):
        return row

    with pytest.raises(ValueError, match="preprocessor 'gsm8k' is already registered by"):
        register_preprocessor("gsm8k", data_source="x", tool_name="y")(convert_row)
    assert get_preprocessor("gsm8k").data_source == "openai/gsm8k"


def test_process_dedupes_keeps_conflicts_out_and_counts(tmp_path, monkeypatch):
    src = write(
        tmp_path / "rows.jsonl",
        [
            line("1+1?", "2"),
            line("1+1?", "2"),  # an exact duplicate
            line("2+2?", "4"),
            line("2+2?", "5"),  # the same prompt, another ground truth: both rows are kept out
            line("3+3?", "6"),
            '{"messages": [',  # not JSON
        ],
    )
    outputs = {}
    for batch_rows in (4096, 1):  # one batch, then a batch per row: the same output
        monkeypatch.setattr(row_batches, "LINE_BATCH_ROWS", batch_rows)
        out = tmp_path / f"out-{batch_rows}"
        out.mkdir()
        stats = preprocessing.process(JSONL, src, out)
        assert stats["rows_in"] == 6 and stats["rows_out"] == 2 and stats["duplicates"] == 1
        assert stats["conflicting_prompts"] == 1 and stats["splits"]["train"]["conflicting_rows"] == 2
        assert stats["rejected_by_reason"] == {"conflicting_ground_truth": 2, "invalid_json": 1}
        rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert sorted(r["reason"] for r in rejected) == ["conflicting_ground_truth"] * 2 + ["invalid_json"]
        outputs[batch_rows] = pq.read_table(out / "train.parquet").to_pylist()
    assert outputs[1] == outputs[4096]
    assert [r["reward_model"]["ground_truth"] for r in outputs[1]] == ["2", "6"]


def test_write_output_refuses_too_many_rejections_and_reuses_only_the_same_settings(tmp_path):
    src = write(tmp_path / "rows.jsonl", [line(f"{i}+1?", str(i + 1)) for i in range(9)] + ["not json"])
    settings = preprocessing.settings_of(JSONL, "default", None, 0.05, input_fingerprint(src))
    with pytest.raises(UserError, match=r"1 of 10 rows rejected \(10.0%: invalid_json=1\), above"):
        preprocessing.write_output(JSONL, src, tmp_path / "strict", settings, str(src))
    assert not (tmp_path / "strict").exists()

    settings = preprocessing.settings_of(JSONL, "default", None, 0.2, input_fingerprint(src))
    out = tmp_path / "out"
    stats = preprocessing.write_output(JSONL, src, out, settings, str(src), max_rejected_fraction=0.2)
    assert stats["rows_out"] == 9 and len(stats["content_hash"]) == 64 and stats["source"]["input"] == str(src)
    assert preprocessing.existing(out, settings) == json.loads((out / "stats.json").read_text())
    assert preprocessing.existing(out, {**settings, "variant": "tool_agent"}) is None
