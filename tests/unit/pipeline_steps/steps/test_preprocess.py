"""Preprocess step: verl's row schema, proven with verl's own RLHFDataset and default_compute_score.

Inputs are the shipped fixtures downloaded from an offline Hugging Face cache (same file layout and columns as
the real repositories), plus bad inputs made by the tests.
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps import cli
from tests.helpers.step_cli import assert_refused, run_step

DATASETS = ["gsm8k", "dapo_math", "geometry3k", "aime2024"]


def step(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, json.loads(out.out.strip().splitlines()[-1]), out.err


@pytest.fixture(scope="module")
def processed(hub_cache, tmp_path_factory):
    """Download and preprocess every built-in dataset once (through the CLI, as the DAG does)."""
    env = {"HF_HUB_CACHE": str(hub_cache["path"]), "HF_HUB_OFFLINE": "1"}
    root = tmp_path_factory.mktemp("processed")
    out = {}
    for name in DATASETS:
        _, dl, _ = run_step("download", "--dataset", name, "--dest", root / "snap", env=env, check=0)
        _, pp, _ = run_step(
            "preprocess", "--dataset", name, "--input", dl["path"], "--output", root / name, env=env, check=0
        )
        out[name] = {"download": dl, "preprocess": pp, "dir": root / name}
    return out


def model_answer(data_source: str, gt: str) -> str:
    """The ground truth written the way a model trained on that prompt answers."""
    if data_source == "openai/gsm8k":
        return f"Adding the two amounts gives the total.\n#### {gt}"
    if data_source == "hiyouga/geometry3k":
        return f"<think>The perimeter is three times x.</think> So x = \\boxed{{{gt}}}"
    return f"Working through the problem step by step.\nAnswer: {gt}"


def image_processor_for(tokenizer):
    """A real Qwen2-VL processor over the tiny tokenizer, without the video half.

    transformers' Qwen2-VL video processor (and qwen_vl_utils' image decoding) need torchvision, which has no build
    beside this machine's CPU torch; RLHFDataset only needs a processor present to expand ``<image>`` placeholders
    into image entries, which is what this test checks. The token-length filter (which decodes through
    qwen_vl_utils) is therefore off for geometry3k; on the cluster image it runs with the model's own processor.
    """
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]}
    )
    return ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)


@pytest.mark.slow  # about 10 s of CPU: verl's RLHFDataset over every dataset
def test_every_row_loads_in_rlhfdataset_and_scores_1(processed, tiny_model):
    from omegaconf import OmegaConf
    from PIL import Image
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.reward_score import default_compute_score

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text_cfg = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 1024,
            "filter_overlong_prompts": True,
            # the filter in this process: datasets forks a pool for it (even of one), and a fork of a pytest worker
            # that earlier tests left with threads crashed once in CI (a segfault in the child's garbage collection)
            "filter_overlong_prompts_workers": None,
            "return_raw_chat": True,
            "truncation": "error",
            "image_key": "images",
        }
    )
    for name, info in processed.items():
        vision = name == "geometry3k"
        cfg = OmegaConf.merge(text_cfg, {"filter_overlong_prompts": not vision})
        processor = image_processor_for(AutoTokenizer.from_pretrained(tiny_model)) if vision else None
        for split, path in info["preprocess"]["splits"].items():
            table = pq.read_table(path)
            assert table.num_rows > 0
            ds = RLHFDataset(data_files=[path], tokenizer=tokenizer, config=cfg, processor=processor)
            assert len(ds) == table.num_rows, (name, split)
            for i in range(len(ds)):
                item = ds[i]
                assert item["raw_prompt"] and item["raw_prompt"][-1]["role"] == "user"
                if vision:  # every <image> became an image entry, in order, decodable
                    parts = item["raw_prompt"][-1]["content"]
                    images = [p["image"] for p in parts if p["type"] == "image"]
                    assert len(images) == len(table["images"][i].as_py()) and all(
                        isinstance(im, Image.Image) for im in images
                    )
                gt = item["reward_model"]["ground_truth"]
                score = default_compute_score(item["data_source"], model_answer(item["data_source"], gt), gt)
                score = score["score"] if isinstance(score, dict) else score
                assert score == pytest.approx(1.0), (name, split, i, gt)
                wrong = default_compute_score(item["data_source"], model_answer(item["data_source"], gt + "1"), gt)
                assert (wrong["score"] if isinstance(wrong, dict) else wrong) < 1.0


def test_data_sources_route_to_the_right_scorers(processed):
    expected = {
        "gsm8k": "openai/gsm8k",
        "dapo_math": "math_dapo",
        "geometry3k": "hiyouga/geometry3k",
        "aime2024": "aime2024",
    }
    for name, ds in expected.items():
        for path in processed[name]["preprocess"]["splits"].values():
            assert set(pq.read_table(path, columns=["data_source"])["data_source"].to_pylist()) == {ds}


def test_gsm8k_ground_truth_strips_thousands_separators(processed):
    rows = pq.read_table(processed["gsm8k"]["preprocess"]["splits"]["train"]).to_pylist()
    with_commas = [r for r in rows if "," in r["extra_info"]["answer"].split("####")[-1]]
    assert with_commas, "fixture must contain a '#### 1,234' answer"
    for r in rows:
        final = r["extra_info"]["answer"].split("####")[-1].strip().replace(",", "")
        assert r["reward_model"]["ground_truth"] == final
        assert '"####"' in r["prompt"][0]["content"]


def test_dapo_dedupes_and_keeps_conflicts_out(processed):
    stats = json.loads((processed["dapo_math"]["dir"] / "stats.json").read_text())
    # fixture: 14 unique rows x 3 copies, plus one prompt with two different ground truths (2 of 44 rows: under the
    # default --max-rejected-fraction 0.05, which conflicting rows count against)
    assert stats["rows_in"] == 44 and stats["rows_out"] == 14 and stats["duplicates"] == 28
    assert stats["conflicting_prompts"] == 1 and stats["rejected_by_reason"] == {"conflicting_ground_truth": 2}
    rows = pq.read_table(processed["dapo_math"]["dir"] / "train.parquet").to_pylist()
    assert not any("divisors" in r["prompt"][0]["content"] for r in rows)
    text = (processed["dapo_math"]["dir"] / "rejected.jsonl").read_text()
    rejected = [json.loads(line) for line in text.splitlines()]
    assert sorted(r["row"]["reward_model"]["ground_truth"] for r in rejected) == ["8", "9"]


def test_geometry_has_one_placeholder_per_image(processed):
    for path in processed["geometry3k"]["preprocess"]["splits"].values():
        for r in pq.read_table(path).to_pylist():
            assert r["prompt"][0]["content"].count("<image>") == len(r["images"]) >= 1
            assert r["images"][0]["bytes"][:4] == b"\x89PNG"


def test_aime_is_30_problems_with_string_answers(processed, hub_cache, tmp_path, capsys, monkeypatch):
    rows = pq.read_table(processed["aime2024"]["preprocess"]["splits"]["test"]).to_pylist()
    assert len(rows) == 30 and all(isinstance(r["reward_model"]["ground_truth"], str) for r in rows)
    # revision v1 of the fixture repeats one problem: it is deduplicated back to 30
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["path"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, dl, _ = step(capsys, "download", "--dataset", "aime2024", "--revision", "v1", "--dest", tmp_path / "s")
    rc, pp, _ = step(capsys, "preprocess", "--dataset", "aime2024", "--input", dl["path"], "--output", tmp_path / "o")
    assert rc == 0 and pp["rows_out"] == 30 and pp["duplicates"] == 1


def test_output_is_byte_identical_on_rerun(processed, tmp_path, capsys):
    info = processed["geometry3k"]
    rc, again, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "geometry3k",
        "--input",
        info["download"]["path"],
        "--output",
        tmp_path / "again",
    )
    assert rc == 0 and again["content_hash"] == info["preprocess"]["content_hash"]
    for split in again["splits"]:
        assert (tmp_path / "again" / f"{split}.parquet").read_bytes() == (info["dir"] / f"{split}.parquet").read_bytes()


def test_tool_agent_variant(processed, tmp_path, capsys):
    rc, s, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "gsm8k",
        "--input",
        processed["gsm8k"]["download"]["path"],
        "--output",
        tmp_path / "tool",
        "--variant",
        "tool_agent",
    )
    assert rc == 0
    for r in pq.read_table(s["splits"]["train"]).to_pylist():
        assert r["agent_name"] == "tool_agent" and r["extra_info"]["need_tools_kwargs"] is True
        assert r["prompt"][0]["role"] == "system" and "`code_interpreter`" in r["prompt"][0]["content"]
        assert r["prompt"][1]["role"] == "user"
        assert (
            r["extra_info"]["tools_kwargs"]["code_interpreter"]["create_kwargs"]["ground_truth"]
            == r["reward_model"]["ground_truth"]
        )


def write_parquet(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_gsm8k_bad_answers_are_counted_rejections(tmp_path, capsys):
    good = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(40)]
    bad = [
        {"question": "Q1", "answer": ""},
        {"question": "Q2", "answer": "no marker"},
        {"question": "Q3", "answer": "#### seven"},
    ]
    write_parquet(tmp_path / "in" / "main" / "train-00000-of-00001.parquet", good + bad)
    rc, s, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "gsm8k",
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "out",
        "--max-rejected-fraction",
        "0.1",
    )
    assert rc == 0 and s["rows_out"] == 40 and s["rejected"] == 3
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rejected_by_reason"] == {"empty_answer": 1, "missing_final_answer": 1, "non_numeric_answer": 1}
    # the same input over the default 5% threshold fails and writes nothing
    rc, s, err = step(
        capsys,
        "preprocess",
        "--dataset",
        "gsm8k",
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "strict",
        "--max-rejected-fraction",
        "0.01",
    )
    assert rc == 2 and "above --max-rejected-fraction" in s["error"] and not (tmp_path / "strict").exists()


def test_renamed_columns_exit_2_naming_them(tmp_path, capsys):
    write_parquet(tmp_path / "in" / "main" / "train-00000-of-00001.parquet", [{"query": "q", "response": "#### 1"}])
    rc, s, err = step(
        capsys, "preprocess", "--dataset", "gsm8k", "--input", tmp_path / "in", "--output", tmp_path / "out"
    )
    assert rc == 2 and "missing columns ['question', 'answer']" in s["error"] and not (tmp_path / "out").exists()


def test_empty_dataset_exit_2(tmp_path, capsys):
    pq.write_table(
        pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
        (tmp_path / "in" / "main").mkdir(parents=True) or tmp_path / "in" / "main" / "train-00000-of-00001.parquet",
    )
    rc, s, _ = step(
        capsys, "preprocess", "--dataset", "gsm8k", "--input", tmp_path / "in", "--output", tmp_path / "out"
    )
    assert rc == 2 and "no rows" in s["error"] and not (tmp_path / "out").exists()


def test_geometry_rejects_bad_images_and_placeholders(processed, tmp_path, capsys):
    src = pq.read_table(
        Path(processed["geometry3k"]["download"]["path"]) / "data" / "train-00000-of-00001.parquet"
    ).to_pylist()
    img = src[0]["images"][0]
    rows = [dict(r) for r in src]
    rows[0] = dict(rows[0], problem=rows[0]["problem"].replace("<image>", ""))  # image without placeholder
    rows[1] = dict(rows[1], problem="<image><image>" + rows[1]["problem"])  # placeholders without images
    rows[2] = dict(rows[2], images=[{"bytes": b"not a png", "path": None}])  # unreadable
    rows[3] = dict(rows[3], images=[{"bytes": None, "path": "x.png"}])  # missing
    write_parquet(tmp_path / "in" / "data" / "train-00000-of-00001.parquet", rows)
    rc, s, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "geometry3k",
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "out",
        "--max-rejected-fraction",
        "1",
    )
    assert rc == 0 and s["rows_out"] == len(rows) - 4
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rejected_by_reason"] == {
        "image_without_placeholder": 1,
        "missing_image": 1,
        "placeholder_without_image": 1,
        "unreadable_image": 1,
    }
    assert img["bytes"][:4] == b"\x89PNG"


def test_jsonl_custom_rows_and_bad_lines(tmp_path, capsys, tiny_model):
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"What is {i}*2?"},
                    {"role": "assistant", "content": "reference"},
                ],
                "rollout_extra": {"solution": str(2 * i)},
            }
        ).encode()
        for i in range(30)
    ]
    lines += [
        b"\xff\xfe not utf-8",
        b'{"messages": [{"role": "user", "content": "trunc',
        json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
    ]
    f = tmp_path / "train.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    rc, s, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "jsonl",
        "--input",
        f,
        "--output",
        tmp_path / "out",
        "--max-rejected-fraction",
        "0.2",
    )
    assert rc == 0 and s["rows_out"] == 30 and s["rejected"] == 3, s
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rejected_by_reason"] == {"invalid_json": 1, "missing_solution": 1, "not_utf8": 1}
    rows = pq.read_table(s["splits"]["train"]).to_pylist()
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"] and rows[3]["reward_model"][
        "ground_truth"
    ] == "6"
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score(rows[3]["data_source"], "Answer: 6", "6")["score"] == 1.0


def test_jsonl_rollout_extra_key_with_two_types_is_one_line_naming_both_rows(tmp_path):
    """``rollout_extra`` becomes a parquet struct: a key that is a string in one row and a number in another has no
    type, and the step says which key and which two lines (JSONL lines, counted from 1) before writing anything."""
    rows = [
        {"solution": "1", "meta": {"level": "easy"}},
        {"solution": "2"},
        {"solution": "3", "meta": {"level": 3}},
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "rollout_extra": e}) + "\n"
            for i, e in enumerate(rows)
        )
    )
    code, _, err = run_step("preprocess", "--dataset", "jsonl", "--input", src, "--output", tmp_path / "out")
    assert_refused(
        code,
        err,
        "rollout_extra key 'meta.level'",
        "a string in line 1 of rows.jsonl",
        "an integer in line 3 of rows.jsonl",
    )
    assert not (tmp_path / "out").exists()


def test_limit_and_bad_flags(processed, tmp_path, capsys):
    path = processed["gsm8k"]["download"]["path"]
    rc, s, _ = step(
        capsys, "preprocess", "--dataset", "gsm8k", "--input", path, "--output", tmp_path / "o", "--limit", "3"
    )
    assert rc == 0 and pq.read_table(s["splits"]["train"]).num_rows == 3
    rc, s, _ = step(
        capsys, "preprocess", "--dataset", "gsm8k", "--input", tmp_path / "missing", "--output", tmp_path / "o2"
    )
    assert rc == 2 and "no such file" in s["error"]
    rc, s, _ = step(
        capsys,
        "preprocess",
        "--dataset",
        "gsm8k",
        "--input",
        path,
        "--output",
        tmp_path / "o3",
        "--max-rejected-fraction",
        "2",
    )
    assert rc == 2 and "between 0 and 1" in s["error"]


@pytest.mark.slow  # about 8 s of CPU: two large inputs preprocessed
@pytest.mark.timeout(300)
def test_jsonl_is_streamed_memory_does_not_grow_with_the_input(tmp_path):
    """Issue 16 item 12: a 300 MB JSONL used to peak at 2.5 GB RSS (every row, and every prompt string for the
    dedupe, held in memory). Here 15 MiB and 60 MiB inputs (generated as in ``make bench BENCH=jsonl``) are
    preprocessed in child processes: the peak RSS must stay bounded and barely grow with 4x the input."""
    from benchmarks.bench_jsonl import generate
    from benchmarks.bench_preprocess import run_child

    peaks, stats = {}, {}
    for mb in (15, 60):
        src = tmp_path / f"in{mb}" / "rows.jsonl"
        src.parent.mkdir()
        lines = generate(src, mb)
        out = tmp_path / f"out{mb}"
        _, peaks[mb] = run_child(
            [sys.executable, "-m", "pipeline_steps", "preprocess", "--dataset", "jsonl", "--input", str(src)]
            + ["--output", str(out), "--max-rejected-fraction", "0.05"]
        )
        stats[mb] = json.loads((out / "stats.json").read_text())
        assert stats[mb]["rows_in"] == lines
        assert stats[mb]["rejected_by_reason"] == {"invalid_json": lines // 100}
        assert not list(out.glob(".*part*")) and not list(out.glob(".shaped-*"))  # no spill files left behind
    assert stats[60]["rows_out"] > 3 * stats[15]["rows_out"]
    assert peaks[60] < 400, peaks
    assert peaks[60] - peaks[15] < 100, peaks
