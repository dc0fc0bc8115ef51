"""Pre-flight puts image rows through verl's own RLHFDataset with the staged processor
(pipeline_steps/training/preflight_checks.py ``check_multimodal_data``) and refuses, in one line naming the cause,
what verl itself lets pass silently: a processor that fails to load (verl's hf_processor returns None with a
warning) and rows its prompt-length filter drops because their processing failed."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from pipeline_steps.errors import UserError
from pipeline_steps.training.preflight_checks import check_multimodal_data
from tests.helpers.vl_rows import PRESET_MM, geo3k_rows, write_parquet

pytestmark = pytest.mark.slow  # builds the tiny VL model and runs verl's dataset: over 5 s of CPU


def _cfg(model, train, val=None, **data):
    cfg = OmegaConf.create(
        {
            "data": {
                "train_files": [str(train)],
                "val_files": [str(val)] if val else [],
                "prompt_key": "prompt",
                "image_key": "images",
                "max_prompt_length": 512,
                "filter_overlong_prompts": True,
                "mm_processor_kwargs": dict(PRESET_MM),
                **data,
            },
            "actor_rollout_ref": {"model": {"path": str(model)}},
        }
    )
    OmegaConf.set_struct(cfg, True)  # as verl's composed config is (a DAG run's pre-flight once failed on a new key)
    return cfg


@pytest.fixture
def data(tmp_path):
    return write_parquet(geo3k_rows("train", 8), tmp_path / "train.parquet")


def test_image_rows_pass_with_the_staged_processor(tiny_vl_model, data, tmp_path):
    val = write_parquet(geo3k_rows("validation"), tmp_path / "val.parquet")
    got = check_multimodal_data(_cfg(tiny_vl_model, data, val))
    assert got == {
        "multimodal_rows_checked": {"data.train_files": 8, "data.val_files": 8},
        "processor": "Qwen2_5_VLProcessor",
    }


def test_text_rows_are_not_checked(tiny_model, tmp_path):
    from tests.helpers.train_local_runs import write_gsm8k_parquet

    text = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    assert check_multimodal_data(_cfg(tiny_model, text)) == {}


def test_a_processor_that_does_not_load_is_one_line_naming_the_cause(tiny_vl_model, data, tmp_path):
    """verl's hf_processor swallows the error (a warning) and returns None: the job would stop at "processor is
    needed" on the cluster, after the GPUs were granted."""
    from verl.utils import hf_processor

    broken = tmp_path / "broken"
    shutil.copytree(tiny_vl_model, broken)
    (broken / "processor_config.json").write_text("{not json")
    assert hf_processor(str(broken)) is None  # what verl does with it: no error
    with pytest.raises(UserError) as err:
        check_multimodal_data(_cfg(broken, data))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"actor_rollout_ref.model.path={broken}: its processor did not load (")
    assert "data.train_files" in msg

    unstaged = tmp_path / "no-processor"  # a VL model staged without its processor's files
    shutil.copytree(tiny_vl_model, unstaged)
    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"):
        (unstaged / name).unlink(missing_ok=True)
    with pytest.raises(UserError, match=r"its processor did not load \(OSError: Can't load image processor"):
        check_multimodal_data(_cfg(unstaged, data))


def test_image_rows_for_a_text_only_model_are_one_line(tiny_model, data):
    """AutoProcessor gives a text model's tokenizer, which verl's hf_processor turns into None, silently."""
    with pytest.raises(
        UserError, match=r"its processor did not load \(it loads as \w+, a text tokenizer with no image"
    ):
        check_multimodal_data(_cfg(tiny_model, data))


def test_rows_lost_to_the_length_filter_are_one_line_naming_the_row_and_the_cause(tiny_vl_model, tmp_path):
    rows = geo3k_rows("train", 8)
    rows[3] = {**rows[3], "images": [{"bytes": b"\x89PNG\r\n\x1a\nnot an image", "path": None}]}
    bad = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(UserError) as err:
        check_multimodal_data(_cfg(tiny_vl_model, bad))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"data.train_files={bad}: verl's prompt-length filter (data.filter_overlong_prompts) drops 1 of"
    )
    assert "row 3: processing failed (" in msg

    good = write_parquet(geo3k_rows("train", 8), tmp_path / "good.parquet")
    with pytest.raises(UserError, match=r"drops 8 of the first 8 rows; row 0: \d+ tokens > data.max_prompt_length=20$"):
        check_multimodal_data(_cfg(tiny_vl_model, good, max_prompt_length=20))
