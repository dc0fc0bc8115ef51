"""k samples per problem: the sampling settings, and two generators over the evaluation set's rows.

* ``hf`` (default; transformers ``generate`` on CPU, the local backend). A model whose ``config.json`` has a
  ``vision_config`` is loaded with ``AutoProcessor`` and ``AutoModelForImageTextToText``; an image row's inputs are
  made by verl's own code (:func:`image_inputs`, as the cluster's dataset and the CPU trainer make them) under the
  run's ``data.mm_processor_kwargs`` (``--mm-processor-kwargs``). A text model is given image rows: refused in one
  line (:func:`check_generator_reads`).
* ``vllm`` (the training image on GPU, run as a RayJob; imported only when asked for, and untested here: no GPU and
  no vLLM on this machine). Image rows go to vLLM as chat messages whose ``<image>`` placeholders are the row's
  images (:func:`chat_messages`), with the same pixel limits.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from pipeline_steps.errors import UserError
from pipeline_steps.evaluation.eval_set import IMAGE_KEY, PLACEHOLDER, row_images

log = logging.getLogger(__name__)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def check_sampling(s: dict) -> None:
    if s["k"] < 1:
        raise UserError(f"--k {s['k']}: must be at least 1 (samples per problem)")
    if s["temperature"] < 0 or not math.isfinite(s["temperature"]):
        raise UserError(f"--temperature {s['temperature']}: must be >= 0 (0 means greedy)")
    if not 0 < s["top_p"] <= 1:
        raise UserError(f"--top-p {s['top_p']}: must be in (0, 1]")
    if s["max_new_tokens"] < 1:
        raise UserError(f"--max-new-tokens {s['max_new_tokens']}: must be at least 1")
    if s.get("tensor_parallel_size", 1) < 1:
        raise UserError(f"--tensor-parallel-size {s['tensor_parallel_size']}: must be at least 1")
    if s["max_problems"] < 0:
        raise UserError(f"--max-problems {s['max_problems']}: must be >= 0")


def reads_images(model_dir) -> bool:
    """Does the Hugging Face model at ``model_dir`` read images (a ``vision_config`` in its config.json)?"""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def check_generator_reads(rows: list[dict], s: dict, eval_info: dict, model_dir) -> None:
    """Image rows need a model that reads them: refused in one line before the model's weights are loaded."""
    with_images = sum(bool(row_images(r)) for r in rows)
    if with_images and s["generator"] == "hf" and not reads_images(model_dir):
        raise UserError(
            f"--data {eval_info['file']}: {with_images} rows carry images, but the model {Path(model_dir).name} reads "
            "text only (no vision_config in its config.json); evaluate a vision-language model on this set"
        )


def chat_messages(row: dict) -> list[dict]:
    """The row's prompt as chat messages for vLLM: each ``<image>`` placeholder becomes the row's next image as an
    OpenAI-style ``image_url`` part (a data URI), the text around it ``text`` parts, as verl's dataset splits them for
    training. A row without images keeps its plain string contents."""
    images = row_images(row)
    if not images:
        return row["prompt"]
    import base64
    import io

    from PIL import Image

    out, used = [], 0
    for message in row["prompt"]:
        content = message["content"]
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(message)
            continue
        parts = []
        for piece in [x for x in re.split(f"({re.escape(PLACEHOLDER)})", content) if x]:
            if piece != PLACEHOLDER:
                parts.append({"type": "text", "text": piece})
                continue
            if used >= len(images):
                raise UserError(
                    f"evaluation row {row.get('extra_info', {}).get('index')}: more {PLACEHOLDER} than images"
                )
            data = images[used]
            with Image.open(io.BytesIO(data)) as im:
                mime = Image.MIME.get(im.format or "", "image/png")
            url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
            used += 1
        out.append({**message, "content": parts})
    if used != len(images):
        raise UserError(
            f"evaluation row {row.get('extra_info', {}).get('index')}: {len(images)} images, {used} {PLACEHOLDER}"
        )
    return out


def image_inputs(row: dict, messages: list, processor, data_cfg) -> tuple[list[int], dict]:
    """An image row's prompt ids and processor outputs (``pixel_values``, ``image_grid_thw``), made by verl's own code
    as its cluster path makes them: ``RLHFDataset._build_messages`` (each ``<image>`` an image entry), the chat
    template, ``qwen_vl_utils``' fetch and resize (``_process_multi_modal_info``) and
    ``build_multimodal_processor_inputs`` with ``data.mm_processor_kwargs``. ``data_cfg``: a mapping or verl's
    ``data`` config (``image_key``, ``mm_processor_kwargs``, ``image_patch_size``)."""
    import copy

    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer import build_multimodal_processor_inputs

    image_key = data_cfg.get("image_key", IMAGE_KEY)
    helper = RLHFDataset.__new__(RLHFDataset)  # the methods only read these attributes
    helper.processor, helper.image_key, helper.video_key, helper.audio_key = processor, image_key, "videos", "audios"
    chat = helper._build_messages(
        {"prompt": copy.deepcopy(messages), image_key: copy.deepcopy(row[image_key])}, "prompt"
    )
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    patch = data_cfg.get("image_patch_size") or getattr(processor.image_processor, "patch_size", 14)
    images, videos, audios = RLHFDataset._process_multi_modal_info(chat, patch, data_cfg)
    mm_kwargs = data_cfg.get("mm_processor_kwargs") or {}
    mm_kwargs = OmegaConf.to_container(mm_kwargs, resolve=True) if OmegaConf.is_config(mm_kwargs) else dict(mm_kwargs)
    enc = build_multimodal_processor_inputs(
        processor, text=[text], images=images, videos=videos, audio=audios, mm_processor_kwargs=mm_kwargs
    )
    mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    return enc["input_ids"][0].tolist(), mm


def vision_inputs(input_ids, mm_rows: list, config) -> dict:
    """A batch's image inputs beside its (padded) ``input_ids``: the rows' patches concatenated and one
    ``image_grid_thw`` line per image, in row order (Qwen-VL models take them so), and ``mm_token_type_ids`` (image
    tokens 1, video tokens 2, text 0) as verl's agent loop builds them (``_compute_position_ids``). transformers places
    the multimodal rotary positions (an image's tokens on its grid, the text after it) only when handed
    ``mm_token_type_ids``: without them every token gets a 1-D position, unlike verl's rollouts and training and a
    user's ``model.generate(**processor(...))``. Nothing for a batch of text rows."""
    import torch

    rows = [m for m in mm_rows if m]
    if not rows:
        return {}
    out = {k: torch.cat([m[k] for m in rows], dim=0) for k in ("pixel_values", "image_grid_thw")}
    types = torch.zeros_like(input_ids)
    for token, kind in (("image_token_id", 1), ("video_token_id", 2)):
        if getattr(config, token, None) is not None:
            types[input_ids == getattr(config, token)] = kind
    out["mm_token_type_ids"] = types
    return out


def vision_token_ids(tokenizer) -> list[int]:
    """The ids of the Qwen-VL vision placeholders: never sampled (one in a response would be taken for an image's
    place)."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})


def generate_hf(model_dir: Path, rows: list[dict], s: dict, batch_size: int = 0) -> list[list[str]]:
    """k completions per row with transformers on CPU; seeded per problem so results do not depend on batching.
    A vision-language model reads each image row's figures (:func:`image_inputs`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    vision = reads_images(model_dir)
    processor = None
    if vision:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
        tok = processor.tokenizer
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    data_cfg = {"image_key": IMAGE_KEY, "mm_processor_kwargs": s.get("mm_processor_kwargs") or {}}
    suppress = vision_token_ids(tok) if vision else None
    k = s["k"]
    bs = batch_size or k
    sample = s["temperature"] > 0
    out: list[list[str]] = []
    for i, row in enumerate(rows):
        if vision and row_images(row):
            ids, mm = image_inputs(row, row["prompt"], processor, data_cfg)
            x = torch.tensor([ids])
            inputs = {"input_ids": x, "attention_mask": torch.ones_like(x), **vision_inputs(x, [mm], model.config)}
        else:
            chat = row["prompt"]
            enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            inputs = dict(enc)
        n_prompt = inputs["input_ids"].shape[-1]
        texts: list[str] = []
        set_seed(s["seed"] * 1_000_003 + i)
        while len(texts) < k:
            n = min(bs, k - len(texts)) if sample else 1  # greedy: one decode, the k samples are copies
            kwargs = dict(max_new_tokens=s["max_new_tokens"], num_return_sequences=n, pad_token_id=tok.pad_token_id)
            if suppress:
                kwargs["suppress_tokens"] = suppress
            if sample:
                kwargs.update(do_sample=True, temperature=s["temperature"], top_p=s["top_p"], top_k=0)
            else:
                kwargs.update(do_sample=False)
            with torch.no_grad():
                gen = model.generate(**inputs, **kwargs)
            texts += tok.batch_decode(gen[:, n_prompt:], skip_special_tokens=True)
            if not sample:
                texts = texts * k
        out.append(texts[:k])
        log.info("problem %d/%d: %d samples", i + 1, len(rows), len(texts))
    return out


def generate_vllm(model_dir: Path, rows: list[dict], s: dict, batch_size: int = 0) -> list[list[str]]:
    """GPU generation with vLLM inside the training image. Untested here (no GPU, no vLLM)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise UserError(
            "--generator vllm: vLLM is not installed here; use the training image on GPU, or --generator hf"
        ) from None
    prompts = [chat_messages(r) for r in rows]
    engine = {"mm_processor_kwargs": s["mm_processor_kwargs"]} if s.get("mm_processor_kwargs") else {}
    most = max((_image_parts(conversation) for conversation in prompts), default=0)
    if most > 1:  # vLLM's V0 engine allowed one image per prompt unless told
        engine["limit_mm_per_prompt"] = {"image": most}
    llm = LLM(model=str(model_dir), seed=s["seed"], tensor_parallel_size=s.get("tensor_parallel_size", 1), **engine)
    params = SamplingParams(
        n=s["k"], temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_new_tokens"], seed=s["seed"]
    )
    outs = llm.chat(prompts, params, add_generation_prompt=True)
    return [[c.text for c in o.outputs] for o in outs]


def _image_parts(conversation: list[dict]) -> int:
    parts = [p for m in conversation if isinstance(m.get("content"), list) for p in m["content"]]
    return sum(isinstance(p, dict) and p.get("type") == "image_url" for p in parts)


GENERATORS = {"hf": generate_hf, "vllm": generate_vllm}
