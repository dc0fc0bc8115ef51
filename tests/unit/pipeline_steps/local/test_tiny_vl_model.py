"""The tiny vision-language model (pipeline_steps/local/tiny_vl_model.py) and proof that images reach it on the path
the cluster uses: verl's RLHFDataset with the staged processor, verl's multimodal processor inputs, the model's
forward pass. An image-blind model would give the same log-probability with the real figure and with a blank one."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.vl_rows import PRESET_MM, geo3k_rows, with_blank_images, write_parquet

pytestmark = pytest.mark.slow  # builds a model and runs verl's dataset: over 5 s of CPU


def test_build_is_deterministic_and_loads_through_the_auto_classes(tiny_vl_model, tmp_path):
    from pipeline_steps.local import tiny_vl_model as builder

    again = builder.build(tmp_path / "again", warmup_steps=0)
    for name in ("model.safetensors", "tokenizer.json", "processor_config.json", "config.json"):
        assert (
            hashlib.sha256((tiny_vl_model / name).read_bytes()).digest()
            == hashlib.sha256((again / name).read_bytes()).digest()
        ), name
    config = json.loads((tiny_vl_model / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["vision_config"]["depth"] == 2
    assert config["text_config"]["num_hidden_layers"] == 2 and config["text_config"]["hidden_size"] == 64
    # a fresh process, as a user loads the exported model
    code = (
        "import sys; from transformers import AutoProcessor, AutoModelForImageTextToText as M; "
        "p = AutoProcessor.from_pretrained(sys.argv[1]); m = M.from_pretrained(sys.argv[1]); "
        "print(type(p).__name__, type(m).__name__, type(p.image_processor).__name__, "
        "sum(x.numel() for x in m.parameters()))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_vl_model)], capture_output=True, text=True, check=True)
    proc, model, image_proc, params = out.stdout.split()
    assert (proc, model) == ("Qwen2_5_VLProcessor", "Qwen2_5_VLForConditionalGeneration")
    assert image_proc.startswith("Qwen2VLImageProcessor") and 50_000 < int(params) < 1_000_000


def test_digest_follows_the_code_and_the_libraries(monkeypatch):
    from pipeline_steps.local import tiny_vl_model as builder

    first = builder._build_inputs()
    assert first == builder._build_inputs()
    monkeypatch.setattr("importlib.metadata.version", lambda d: "0" if d == "torchvision" else "1")
    assert builder._build_inputs() != first


def _verl_inputs(model_dir: Path, rows: list[dict], tmp: Path, mm: dict):
    """Each row as verl's cluster path makes it: RLHFDataset (the staged processor from verl's hf_processor), then
    the rollout's processor call (verl's build_multimodal_processor_inputs with data.mm_processor_kwargs)."""
    from omegaconf import OmegaConf
    from verl.utils import hf_processor, hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer import build_multimodal_processor_inputs

    tmp.mkdir(parents=True, exist_ok=True)
    processor = hf_processor(str(model_dir))
    assert processor is not None
    cfg = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "image_key": "images",
            "max_prompt_length": 512,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": None,
            "mm_processor_kwargs": mm,
            "cache_dir": str(tmp / "cache"),
        }
    )
    ds = RLHFDataset([str(write_parquet(rows, tmp / "rows.parquet"))], hf_tokenizer(str(model_dir)), cfg, processor)
    assert len(ds) == len(rows)  # none lost to the length filter
    out = []
    for i in range(len(ds)):
        messages = ds[i]["raw_prompt"]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images, videos, audios = ds._process_multi_modal_info(messages, ds.image_patch_size, cfg)
        out.append(
            build_multimodal_processor_inputs(
                processor, text=[text], images=images, videos=videos, audio=audios, mm_processor_kwargs=mm
            )
        )
    return processor, out


def test_image_tokens_per_row_match_the_processors_count_under_the_presets_pixel_limits(tiny_vl_model, tmp_path):
    """The fixture's figures are 112x112: 16 image tokens (28x28 pixels each) under local_tiny_vl's limits; with a
    max_pixels of 56x56 the processor scales them to 2x2 tokens, so the limits do reach it."""
    from omegaconf import OmegaConf

    from pipeline_steps.training import experiment

    preset = experiment.read("local_tiny_vl")
    assert experiment.mm_processor_kwargs(preset.verl) == PRESET_MM  # the test uses the preset's own limits
    rows = geo3k_rows("test", 4)
    for mm, expected in ((PRESET_MM, 16), ({"min_pixels": 784, "max_pixels": 3136}, 4)):
        processor, inputs = _verl_inputs(tiny_vl_model, rows, tmp_path, OmegaConf.create(mm))
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        merge = processor.image_processor.merge_size
        for enc in inputs:
            in_text = int((enc["input_ids"][0] == pad).sum())
            from_grid = int(enc["image_grid_thw"].prod(-1).sum()) // merge**2
            assert in_text == from_grid == expected, (mm, in_text, from_grid)


def _verl_positions(verl_processor, ids, attention, mm):
    """The rotary positions verl's agent loop hands the actor (``AgentLoopWorker._compute_position_ids``: a text row
    and 3 multimodal rows, an image's tokens on its grid), transposed as verl's actor passes them to the model."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # the method reads only the processor
    worker.processor = verl_processor
    return worker._compute_position_ids(ids, attention, {**mm, "mm_token_type_ids": True})


def _response_logprob(model, processor, enc, response: str) -> float:
    import torch

    resp = processor.tokenizer(response, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = torch.cat([enc["input_ids"], resp], dim=1)
    attention = torch.ones_like(ids)
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    positions = _verl_positions(processor, ids, attention, mm).transpose(0, 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, **mm).logits
    logp = torch.log_softmax(logits[0, -resp.shape[1] - 1 : -1].float(), -1)
    return float(logp.gather(-1, resp[0][:, None]).sum())


def test_log_probability_differs_between_the_figure_and_a_blank_image_on_verls_path(tiny_vl_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    rows = geo3k_rows("test", 2)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model).eval()
    response = "<think>The figure has five sides.</think> \\boxed{5}"
    processor, real = _verl_inputs(tiny_vl_model, rows, tmp_path / "real", PRESET_MM)
    _, again = _verl_inputs(tiny_vl_model, rows, tmp_path / "again", PRESET_MM)
    _, blank = _verl_inputs(tiny_vl_model, [with_blank_images(r) for r in rows], tmp_path / "blank", PRESET_MM)
    for r, a, b in zip(real, again, blank):
        lp_real, lp_again, lp_blank = (_response_logprob(model, processor, e, response) for e in (r, a, b))
        assert lp_real == lp_again  # deterministic: a difference below comes from the image alone
        assert r["input_ids"].tolist() == b["input_ids"].tolist()  # same prompt tokens, only the pixels differ
        print(f"verl path: log p(response | figure) {lp_real:.4f}, | blank {lp_blank:.4f}")
        assert abs(lp_real - lp_blank) > 1e-3


def test_log_probability_differs_between_the_figure_and_a_blank_image_on_the_cpu_trainers_path(tiny_vl_model, tmp_path):
    """The CPU trainer's own prompt loading (load_prompts through the staged processor) and log-probabilities
    (GRPOTrainer.log_probs, what its policy loss and old/ref log-probs use). Without the image inputs, the same
    batch is image-blind: real figure and blank tie exactly, so the difference is the images reaching the policy."""
    import types

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipeline_steps.local import grpo_cpu

    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model).eval()
    data_cfg = OmegaConf.create({"max_prompt_length": 512, "image_key": "images", "mm_processor_kwargs": PRESET_MM})
    rows = geo3k_rows("test", 2)
    real = grpo_cpu.load_prompts(
        [write_parquet(rows, tmp_path / "r.parquet")], processor.tokenizer, data_cfg, processor
    )
    blank = grpo_cpu.load_prompts(
        [write_parquet([with_blank_images(r) for r in rows], tmp_path / "b.parquet")],
        processor.tokenizer,
        data_cfg,
        processor,
    )
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [p.input_ids.count(pad) for p in real] == [16, 16]  # the preset's limits: 112x112 -> 4x4 tokens
    response = processor.tokenizer("<think>five sides</think> \\boxed{5}", add_special_tokens=False)["input_ids"]

    def batch(prompts, with_images=True):
        ids = torch.tensor([p.input_ids + response for p in prompts])
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "responses": torch.tensor([response] * len(prompts)),
            "mm": [p.mm for p in prompts] if with_images else None,
        }

    trainer = types.SimpleNamespace(temperature=1.0)
    rows_idx = torch.arange(2)
    with torch.no_grad():
        lp = {
            (kind, seen): grpo_cpu.GRPOTrainer.log_probs(trainer, model, batch(p, seen), rows_idx)[0].sum(-1)
            for kind, p in (("figure", real), ("blank", blank))
            for seen in (True, False)
        }
    print(
        "CPU trainer path: log p(response | figure)", lp["figure", True].tolist(), "| blank", lp["blank", True].tolist()
    )
    assert torch.equal(lp["figure", False], lp["blank", False])  # image-blind: a tie
    assert ((lp["figure", True] - lp["blank", True]).abs() > 1e-3).all()
    # one row alone gets the same as in the batch: each row's patches go with it
    alone = grpo_cpu.GRPOTrainer.log_probs(trainer, model, batch(real), torch.tensor([1]))[0].sum(-1)
    assert torch.allclose(alone, lp["figure", True][1:], atol=1e-4)


def test_the_cpu_path_places_image_tokens_where_verls_agent_loop_does(tiny_vl_model, tmp_path):
    """Rotary positions: verl's agent loop hands the actor 3-D multimodal positions (an image's tokens on its grid,
    ``AgentLoopWorker._compute_position_ids`` with the processor verl binds ``get_rope_index`` to); transformers
    computes the same only when handed ``mm_token_type_ids``, and a user's ``model(**processor(...))`` hands them. The
    CPU trainer's log-probabilities (``vision_inputs``) must equal the forward pass with verl's positions, and the
    forward without ``mm_token_type_ids`` (1-D positions, what the CPU path did before) must not: it is the fault this
    test guards against (found when the warmed-up model wrote garbage for a user's processor call)."""
    import types

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipeline_steps.local import grpo_cpu

    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model).eval()
    verl_processor, encoded = _verl_inputs(tiny_vl_model, geo3k_rows("test", 1), tmp_path, PRESET_MM)
    enc = encoded[0]
    response = processor.tokenizer("<think> </think> \\boxed{5}", add_special_tokens=False)["input_ids"]
    ids = torch.cat([enc["input_ids"], torch.tensor([response])], dim=1)
    attention = torch.ones_like(ids)
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}

    verl_positions = _verl_positions(verl_processor, ids, attention, mm)
    assert verl_positions.shape == (1, 4, ids.shape[1])  # text row + 3 multimodal rows
    assert not torch.equal(verl_positions[0, 1], verl_positions[0, 2])  # the image spans a grid: height != width

    def response_logprob(**kwargs):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention, **mm, **kwargs).logits
        logp = torch.log_softmax(logits[0, -len(response) - 1 : -1], -1)
        return logp.gather(-1, torch.tensor(response)[:, None]).sum()

    verl = response_logprob(position_ids=verl_positions.transpose(0, 1))  # as verl's actor hands them
    one_d = response_logprob()  # no mm_token_type_ids: transformers falls back to 1-D positions
    trainer = types.SimpleNamespace(temperature=1.0)
    batch = {"input_ids": ids, "attention_mask": attention, "responses": torch.tensor([response]), "mm": [mm]}
    with torch.no_grad():
        cpu = grpo_cpu.GRPOTrainer.log_probs(trainer, model, batch, torch.arange(1))[0].sum()
    print(f"log p(response): verl positions {verl:.5f}, CPU trainer {cpu:.5f}, 1-D positions {one_d:.5f}")
    # the random model barely weighs positions (1-D vs 3-D measured 5.4e-4 apart), so the tie is held 50x tighter
    assert torch.allclose(cpu, verl, atol=1e-5)
    assert abs(float(one_d - verl)) > 1e-4


ANSWER = """
import base64, io, json, sys
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
d, fixture = sys.argv[1], sys.argv[2]
p = AutoProcessor.from_pretrained(d)
m = AutoModelForImageTextToText.from_pretrained(d).eval()
row = json.loads(open(fixture).readline())
img = Image.open(io.BytesIO(base64.b64decode(row["images"][0]["bytes_b64"])))
text = row["problem"].replace("<image>", "")
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
enc = p(text=[p.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)], images=[img],
        return_tensors="pt", min_pixels=3136, max_pixels=12544)
out = m.generate(**enc, max_new_tokens=8, do_sample=False)
tokens = int(enc["image_grid_thw"].prod()) // 4
print(json.dumps({"processor": type(p).__name__, "model": type(m).__name__, "image_tokens": tokens,
                  "new_tokens": int(out.shape[1] - enc["input_ids"].shape[1])}))
"""


@pytest.mark.budget(900)
def test_train_local_trains_on_the_figures_and_the_merged_model_answers_from_an_image(tiny_vl_model, tmp_path):
    """train-local (the local backend's job) runs GRPO steps of local_tiny_vl on image rows; verl's merger turns the
    checkpoint into a model that a fresh process loads with AutoProcessor / AutoModelForImageTextToText and that
    generates from a figure."""
    from tests.helpers.step_cli import run_step
    from tests.helpers.vl_rows import FIXTURE

    train = write_parquet(geo3k_rows("train"), tmp_path / "train.parquet")
    out = tmp_path / "out"
    _, summary, _ = run_step(
        "train-local", "--experiment", "local_tiny_vl", "--train-files", train, "--val-files", train,
        "--model-path", tiny_vl_model, "--output-dir", out, "--override", "trainer.total_training_steps=2",
        "--override", "trainer.val_before_train=false", "--override", "trainer.logger=[console,file]",
    )  # fmt: skip
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "critic/score/mean" in s["data"]] == [1, 2]
    ckpt = out / "checkpoints" / "global_step_2" / "actor"
    assert (ckpt / "huggingface" / "processor_config.json").is_file()  # the checkpoint keeps the processor
    merged = tmp_path / "merged"
    subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(ckpt),
         "--target_dir", str(merged)],
        check=True, capture_output=True,
    )  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-c", ANSWER, str(merged), str(FIXTURE / "test-00000-of-00001.jsonl")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {
        "processor": "Qwen2_5_VLProcessor",
        "model": "Qwen2_5_VLForConditionalGeneration",
        "image_tokens": 16,
        "new_tokens": got["new_tokens"],
    }
    assert got["new_tokens"] > 0


def test_the_warm_up_is_deterministic_and_never_sees_the_fixture(tmp_path):
    """Two builds with a few steps of both warm-up stages give the same weights, which differ from the random model's
    (both stages ran); the warm-up's figures are drawn apart from the fixture's (no figure of the evaluation set is
    trained on)."""
    import base64

    from pipeline_steps.local import tiny_vl_model as builder

    a, b = (builder.build(tmp_path / name, warmup_steps=2, reading_steps=3, figures=8) for name in ("a", "b"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert "3 steps in which the vision tower" in (a / "README.md").read_text()
    assert "2 steps of supervised warm-up" in (a / "README.md").read_text()
    from safetensors.torch import load_file

    random_dir = builder.build(tmp_path / "random", warmup_steps=0)
    warm, random_model = (load_file(d / "model.safetensors") for d in (a, random_dir))
    changed = {k for k in warm if not (warm[k] == random_model[k]).all()}
    assert any(k.startswith("visual.") for k in changed)  # stage 1 trained the vision tower
    assert any(k.startswith("model.layers.") for k in changed)  # stage 2 trained the text model
    fixture = {
        base64.b64decode(im["bytes_b64"])
        for split in ("train", "validation", "test")
        for line in (Path(__file__).resolve().parents[4] / "pipeline_steps/local/hub/hiyouga/geometry3k/v2/data")
        .joinpath(f"{split}-00000-of-00001.jsonl")
        .read_text()
        .splitlines()
        for im in json.loads(line)["images"]
    }
    drawn = {im["bytes"] for row in builder.warmup_rows(builder.WARMUP_FIGURES, 1) for im in row["images"]}
    assert len(drawn) == builder.WARMUP_FIGURES and not drawn & fixture
