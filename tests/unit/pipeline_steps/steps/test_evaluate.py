"""Evaluate runs for real: transformers generation on CPU with the tiny model, scoring by verl's
``default_compute_score`` (AIME rows -> math_dapo), on an AIME-shaped parquet built here with pyarrow.
Also a real verl FSDP checkpoint as ``--model`` (merged by verl's merger), and geometry3k's figures read by the
tiny vision-language model. The vLLM generator is not exercised (no GPU and no vLLM here). The engine's own tests are
in tests/unit/pipeline_steps/evaluation/ (test_generation.py, test_scoring.py, test_figures.py).
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps import cli
from pipeline_steps.evaluation import generation
from tests.helpers import fsdp_checkpoint
from tests.helpers.eval_rows import aime_rows

K, TOKENS = 3, 6


@pytest.fixture
def aime(tmp_path):
    p = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist(aime_rows()), p)
    return p


def run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    if code:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-2000:]
    return code, json.loads(out.strip().splitlines()[-1]), err


def eval_args(model, data, out, *extra, k=K):
    return [
        "evaluate",
        "--model",
        model,
        "--data",
        data,
        "--output",
        out,
        "--k",
        k,
        "--temperature",
        1.0,
        "--top-p",
        0.9,
        "--max-new-tokens",
        TOKENS,
        "--seed",
        7,
        *extra,
    ]


def test_evaluate_tiny_model_for_real_with_cached_base(tiny_model, aime, tmp_path, capsys, monkeypatch):
    from verl.utils.reward_score import default_compute_score

    calls = []
    real = generation.GENERATORS["hf"]
    monkeypatch.setitem(generation.GENERATORS, "hf", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    cache = tmp_path / "base-cache"
    code, s, err = run_cli(
        eval_args(tiny_model, aime, tmp_path / "out", "--base-model", tiny_model, "--baseline-cache", cache), capsys
    )
    assert code == 0, err
    assert len(calls) == 2 and len(list(cache.glob("*.json"))) == 1
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    gens = [json.loads(line) for line in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    assert s["samples_scored"] == res["overall"]["samples_scored"] == 2 * K and s["k"] == K
    assert [g["id"] for g in gens] == ["2024-I-1", "2024-I-2"]
    for p, g in zip(res["problems"], gens):
        assert len(g["responses"]) == len(p["samples"]) == K and p["ground_truth"] in ("0", "2")
        for text, sample in zip(g["responses"], p["samples"]):  # re-score independently with verl
            ref = default_compute_score("aime2024", text, p["ground_truth"])
            assert sample["correct"] == bool(ref["acc"]) and sample["score"] == ref["score"]
        assert p["avg@k"] == sum(x["correct"] for x in p["samples"]) / K
    assert res["overall"]["avg@k"] == pytest.approx(sum(p["avg@k"] for p in res["problems"]) / 2)
    # the base is the same model with the same seed: identical generations, zero gain
    assert res["base"]["overall"] == res["overall"] and res["gain"]["avg@k"] == 0.0
    assert res["model"]["content_sha256"] == res["base"]["model"]["content_sha256"]
    assert res["sampling"] == {
        "k": K,
        "temperature": 1.0,
        "top_p": 0.9,
        "max_new_tokens": TOKENS,
        "seed": 7,
        "max_problems": 0,
        "generator": "hf",
    }
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| avg@3 |" in md and "| 2024-I-2 | `2` |" in md  # the ground truth in a code span
    assert json.loads((tmp_path / "out" / "base_results.json").read_text())["overall"] == res["base"]["overall"]

    # second run: base comes from the cache (one generation call), results are reproducible
    calls.clear()
    code, s2, err = run_cli(
        eval_args(tiny_model, aime, tmp_path / "out2", "--base-model", tiny_model, "--baseline-cache", cache), capsys
    )
    assert code == 0, err
    assert len(calls) == 1
    assert (tmp_path / "out2" / "generations.jsonl").read_text() == (tmp_path / "out" / "generations.jsonl").read_text()


def test_the_base_cache_misses_when_the_model_the_set_or_the_sampling_changes(
    tiny_model, aime, tmp_path, capsys, monkeypatch
):
    """The README's cache key (model content, eval set content, sampling): each change is a miss, i.e. the base model
    is generated again and a new cache entry is written; an unchanged run is a hit."""
    import shutil

    calls = []
    real = generation.GENERATORS["hf"]
    monkeypatch.setitem(generation.GENERATORS, "hf", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    cache = tmp_path / "cache"
    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_model, other_model)
    cfg = other_model / "generation_config.json"  # other bytes, same weights: a different model content hash
    cfg.write_text(cfg.read_text() + "\n" if cfg.is_file() else "{}\n")
    other_set = tmp_path / "aime3.parquet"
    pq.write_table(pa.Table.from_pylist(aime_rows(3)), other_set)

    def run(name, base=tiny_model, data=aime, *extra):
        calls.clear()
        args = eval_args(tiny_model, data, tmp_path / name, "--base-model", base, "--baseline-cache", cache, *extra)
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        return len(calls), len(list(cache.glob("*.json")))

    assert run("first") == (2, 1)  # model and base generated; one entry
    assert run("same") == (1, 1)  # hit: only the model is generated
    assert run("model", other_model) == (2, 2)
    assert run("set", tiny_model, other_set) == (2, 3)
    assert run("sampling", tiny_model, aime, "--temperature", 0.7) == (2, 4)


def test_greedy_gives_identical_samples(tiny_model, aime, tmp_path, capsys):
    code, s, err = run_cli(
        [
            "evaluate",
            "--model",
            tiny_model,
            "--data",
            aime,
            "--output",
            tmp_path / "g",
            "--k",
            2,
            "--temperature",
            0,
            "--max-new-tokens",
            4,
            "--max-problems",
            1,
        ],
        capsys,
    )
    assert code == 0, err
    gens = [json.loads(line) for line in (tmp_path / "g" / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 1 and gens[0]["responses"][0] == gens[0]["responses"][1]
    assert s["problems"] == 1 and s["samples_scored"] == 2


@pytest.mark.slow  # about 17 s of CPU: a checkpoint merged and evaluated
def test_checkpoint_dir_is_merged_and_evaluated(tiny_model, aime, tmp_path, tmp_path_factory, capsys):
    checkpoints = fsdp_checkpoint.cached_build(tmp_path_factory.getbasetemp(), tiny_model, steps=(1, 2))
    code, s, err = run_cli(eval_args(checkpoints, aime, tmp_path / "c", "--step", 1, k=2), capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "c" / "results.json").read_text())
    assert res["model"]["source"] == "checkpoint" and res["model"]["step"] == 1 and s["samples_scored"] == 4
    assert not list(tmp_path.glob(".tmp-*"))  # the merged copy is cleaned up
    # export accepts these results only if it merges to the same content
    from pipeline_steps.training.checkpoints import dir_sha256, merge_checkpoint, resolve_checkpoint

    _, actor = resolve_checkpoint(checkpoints, 1)
    assert res["model"]["content_sha256"] == dir_sha256(merge_checkpoint(actor, tmp_path / "m"))


@pytest.mark.parametrize(
    "mutate,argv_extra,needle",
    [
        (None, ["--k", "0"], "--k 0: must be at least 1"),
        (None, ["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (lambda r: r[1]["reward_model"].update(ground_truth=""), [], "row 1 has no reward_model.ground_truth"),
        (lambda r: r[0].update(prompt=[]), [], "row 0 prompt is not a list of chat messages"),
        (lambda r: r[0].update(data_source="nobody_knows"), [], "has no reward function in verl"),
    ],
)
def test_bad_input_is_one_clear_line_and_no_output(tiny_model, tmp_path, capsys, mutate, argv_extra, needle):
    rows = aime_rows()
    if mutate:
        mutate(rows)
    data = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    argv = [
        "evaluate",
        "--model",
        tiny_model,
        "--data",
        data,
        "--output",
        tmp_path / "o",
        "--k",
        1,
        "--max-new-tokens",
        2,
    ]
    code, s, err = run_cli(argv + argv_extra, capsys)
    assert code == 2 and needle in s["error"], s
    assert not (tmp_path / "o").exists()


def test_missing_inputs(tmp_path, capsys, aime):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    code, s, _ = run_cli(
        ["evaluate", "--model", not_a_model, "--data", aime, "--output", tmp_path / "o", "--k", 1], capsys
    )
    assert code == 2 and "neither a Hugging Face model directory" in s["error"]
    code, s, _ = run_cli(
        ["evaluate", "--model", not_a_model, "--data", tmp_path / "nope.parquet", "--output", tmp_path / "o"], capsys
    )
    assert code == 2 and "file not found" in s["error"]


def test_gain_over_the_base_is_measured_not_assumed(tiny_model, aime, tmp_path, capsys, monkeypatch):
    """Numbers that are not all zero: the tiny model answers no AIME problem, so its real evaluation above compares
    0 with 0. Here the generator is a stand-in (no model can be trained to answer here): the "trained" model writes
    the right answer in every sample, the base only in the first sample of the first problem. Scoring (verl's
    ``default_compute_score``), avg/pass/maj@k and the gain are the real code and must come out exactly."""
    import shutil

    trained = tmp_path / "trained"
    shutil.copytree(tiny_model, trained)
    (trained / "trained.txt").write_text("a different model directory (its content hash differs)\n")

    def generate(model_dir, rows, s, batch_size=0):
        out = []
        for p, row in enumerate(rows):
            i = int(row["prompt"][-1]["content"].split("Find ", 1)[1].split(" +", 1)[0])
            right = [f"Answer: {2 * i}"] * s["k"]
            wrong = [f"Answer: {2 * i + 1}"] * s["k"]
            if model_dir.name == "trained":
                out.append(right)
            else:
                out.append(right[:1] + wrong[1:] if p == 0 else wrong)
        return out

    monkeypatch.setitem(generation.GENERATORS, "hf", generate)
    code, s, err = run_cli(eval_args(trained, aime, tmp_path / "out", "--base-model", tiny_model), capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    base_avg = (1 / K + 0) / 2
    assert res["overall"]["avg@k"] == pytest.approx(1.0) and s["avg@k"] == pytest.approx(1.0)
    assert res["base"]["overall"]["avg@k"] == pytest.approx(base_avg)
    assert res["gain"]["avg@k"] == pytest.approx(1.0 - base_avg) and s["gain_avg@k"] == pytest.approx(1.0 - base_avg)
    assert res["base"]["overall"]["pass@k"][str(K)] == pytest.approx(0.5)  # one of two problems solved at all
    assert res["overall"]["maj@k"] == pytest.approx(1.0) and res["base"]["overall"]["maj@k"] == pytest.approx(0.0)


# -- geometry3k: the figures reach the CPU generator; a text model is refused ---------------------------------------


def test_pixel_limits_reach_the_sampling_settings_and_bad_json_is_one_line(tmp_path, capsys):
    import argparse

    from pipeline_steps.steps import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    args = parser.parse_args(
        ["--model", "m", "--data", "d", "--output", "o", "--mm-processor-kwargs", '{"max_pixels": 501760}']
    )
    assert evaluate.sampling_of(args)["mm_processor_kwargs"] == {"max_pixels": 501760}  # part of the cache key
    code, s, _ = run_cli(
        ["evaluate", "--model", "m", "--data", "d", "--output", tmp_path / "o", "--mm-processor-kwargs", "[1]"], capsys
    )
    assert code == 2 and "--mm-processor-kwargs" in s["error"] and "JSON object" in s["error"], s


def test_image_rows_and_a_text_model_are_refused_in_one_line_before_its_weights_load(tiny_model, tmp_path, capsys):
    from tests.helpers.vl_rows import geo3k_rows, write_parquet

    data = write_parquet(geo3k_rows("test", 2), tmp_path / "geo3k.parquet")
    code, s, _ = run_cli(["evaluate", "--model", tiny_model, "--data", data, "--output", tmp_path / "o"], capsys)
    assert code == 2 and "2 rows carry images" in s["error"] and "reads text only" in s["error"], s
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # the tiny VL model generates from 4 figures twice: about 10 s of CPU
def test_a_vision_language_model_is_evaluated_on_the_figures_with_thumbnails(tiny_vl_model, tmp_path, capsys):
    """The CLI as the pipeline calls it for local_tiny_vl: the staged processor, the preset's pixel limits, verl's
    geo3k scorer; the same rows with blank figures give other answers (the figures are read, not only the text), and a
    small thumbnail of each figure is written for the report."""
    from PIL import Image

    from tests.helpers.vl_rows import PRESET_MM, geo3k_rows, with_blank_images, write_parquet

    rows = geo3k_rows("test", 4)
    figures = write_parquet(rows, tmp_path / "geo3k.parquet")
    blank = write_parquet([with_blank_images(r) for r in rows], tmp_path / "blank.parquet")
    mm = ["--mm-processor-kwargs", json.dumps(PRESET_MM)]
    responses = {}
    for name, data in (("figures", figures), ("blank", blank)):
        code, s, err = run_cli(eval_args(tiny_vl_model, data, tmp_path / name, *mm, k=2), capsys)
        assert code == 0, err
        assert s["samples_scored"] == 8 and s["problems"] == 4
        res = json.loads((tmp_path / name / "results.json").read_text())
        assert res["sampling"]["mm_processor_kwargs"] == PRESET_MM and res["eval_set"]["name"] == "hiyouga/geometry3k"
        gens = (tmp_path / name / "generations.jsonl").read_text().splitlines()
        responses[name] = [json.loads(line)["responses"] for line in gens]
        thumbs = sorted((tmp_path / name / "figures").iterdir())
        assert [t.name for t in thumbs] == ["0000.png", "0001.png", "0002.png", "0003.png"]
        assert res["figures"] == {"dir": "figures", "count": 4}
        for t in thumbs:
            with Image.open(t) as im:
                assert im.format == "PNG" and max(im.size) <= 96 and t.stat().st_size <= 16 * 1024
    assert responses["figures"] != responses["blank"]  # same prompts and seeds: only the pixels differ
