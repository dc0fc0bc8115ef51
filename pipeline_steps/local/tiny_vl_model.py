"""The tiny local vision-language model: a random Qwen2.5-VL (2 text layers, hidden 64, a 2-block vision tower) with a
byte-level BPE tokenizer trained on the fixture text, saved with a ``Qwen2_5_VLProcessor`` (image processor, video
processor, tokenizer, chat template) that loads through ``AutoProcessor`` and ``AutoModelForImageTextToText``.

``stage-model`` builds it for ``--model tiny-vl`` (preset ``local_tiny_vl``), cached like the tiny text model by a
digest of this code, the fixture corpus and the library versions (:func:`build_cached`). Deterministic: the same
inputs and seed give the same files. It reads the image (the vision tower's output replaces the ``<|image_pad|>``
embeddings; its processor maps white to 0, ``IMAGE_MEAN``/``IMAGE_STD``). Before GRPO it gets a supervised warm-up
(:func:`warmup`) on polygons drawn like the fixture's, never the fixture's own: it learns the
``<think> </think> \\boxed{N}`` form verl's geo3k scorer reads and a first reading of the figure (about two thirds of
held-out figures right; a blank gets one constant answer), so GRPO's rollouts are sometimes right and sometimes wrong
and earn a reward (0.1 for the form, 1.0 when right). ``warmup_steps=0`` gives the random model the image-path tests
were written against.

The processor's own pixel limits are the ones a run's ``data.mm_processor_kwargs`` narrow (verl hands those to the
processor); ``MIN_PIXELS``/``MAX_PIXELS`` are the saved defaults (at most ``MAX_PIXELS // 28**2`` image tokens).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.local import build_cache, tiny_model

log = logging.getLogger(__name__)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's chat template in short: a string content as is, a content list's image parts as the vision tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PATCH, MERGE = 14, 2  # 28 x 28 pixels per image token
MIN_PIXELS = 56 * 56
MAX_PIXELS = 64 * 28 * 28  # at most 64 image tokens per image unless a run's mm_processor_kwargs say otherwise
WARMUP_MM = {"min_pixels": 3136, "max_pixels": 12544}  # the local_tiny_vl preset's data.mm_processor_kwargs
RESPONSE = "<think> </think> \\boxed{{{answer}}}"  # the form verl's geo3k scorer reads (format and accuracy)
# White maps to 0, black to -2. The default (CLIP) normalisation maps white to about +1.9, and the patch embedding has
# no bias: every white patch of every figure was then one constant vector that the 2-pixel lines barely moved, and the
# warmed-up model answered one side count for every figure and for a blank (measured, docs/vision-language.md).
IMAGE_MEAN, IMAGE_STD = [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]
# The warm-up in two stages, measured on 64 held-out polygons (docs/vision-language.md): 1024 figures, 1500 reading
# steps and 300 answer steps read 67% of them right (a blank: one constant answer, 25%) in about 100 s of CPU.
WARMUP_FIGURES = 1024
READING_STEPS = 1500  # stage 1: the vision tower and the output layer learn to name the side count per image token
READING_LR = 1e-3  # 1e-2 never left ln 4 (chance)
WARMUP_STEPS = 300  # stage 2: the text model (vision frozen) learns the form and to answer from the image tokens
WARMUP_LR = 3e-3
ANSWER_WEIGHT = 5.0  # the answer digit's loss weight among the response tokens
CARD = """---
license: mit
library_name: transformers
pipeline_tag: image-text-to-text
---
# tiny local vision-language model

A {params}-parameter Qwen2.5-VL-architecture model (`Qwen2_5_VLForConditionalGeneration`: {layers} text layers,
hidden {hidden}, a {depth}-block vision tower) with a {vocab}-token byte-level BPE tokenizer and a
`Qwen2_5_VLProcessor` (pixels {min_pixels}..{max_pixels}), built by the pipeline's `stage-model --model tiny-vl`
(seed {seed}) for the local profile.

Training before GRPO: {warmup}
"""
WARMUP_CARD = """supervised warm-up on {figures} polygons drawn like the geometry3k fixture's (never its own figures),
with its problem text, in two stages: {reading} steps in which the vision tower and the output layer learn to name a
figure's side count from each image token, then {steps} steps of supervised warm-up of the text model (vision frozen)
on `<think> </think> \\boxed{{N}}`, N the side count. The model learns the form verl's geo3k scorer reads and a
first reading of the figure; what it gains after the pipeline's `train` task comes from GRPO's reward (the base
model's figures are in every evaluation)."""


def _tokenizer(directory: Path, vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=tiny_model.SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_model._corpus(tiny_model.FIXTURES), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def untrained(directory: Path, vocab_size=512, hidden_size=64, layers=2, vision_depth=2, seed=0):
    """Tokenizer, processor and config written to ``directory``; the random model and the processor returned."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    directory = Path(directory)
    fast = _tokenizer(directory, vocab_size)
    ids = {t: fast.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    heads = 4
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(fast),
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size * 2,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "eos_token_id": fast.eos_token_id,
            "pad_token_id": fast.pad_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [vision_depth - 1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=MIN_PIXELS,
            max_pixels=MAX_PIXELS,
            patch_size=PATCH,
            merge_size=MERGE,
            image_mean=IMAGE_MEAN,
            image_std=IMAGE_STD,
        ),
        video_processor=Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=MERGE),
        tokenizer=fast,
        chat_template=CHAT_TEMPLATE,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.eval()
    return model, processor


def complete(entry: Path) -> bool:
    """A built entry: config, tokenizer and the processor's settings are written (weights come first in the build)."""
    return build_cache.complete(entry) and any(
        (Path(entry) / n).exists() for n in ("processor_config.json", "preprocessor_config.json")
    )


def build(
    output: str | Path,
    vocab_size=512,
    hidden_size=64,
    layers=2,
    vision_depth=2,
    seed=0,
    owner=None,
    warmup_steps: int = WARMUP_STEPS,
    reading_steps: int = READING_STEPS,
    figures: int = WARMUP_FIGURES,
) -> Path:
    """The model's files in ``output``. ``warmup_steps=0``: the random model, no warm-up at all."""
    output = Path(output)
    if complete(output):
        log.info("tiny VL model already at %s", output)
        return output
    with atomic.atomic_dir(output, owner=owner) as tmp:
        model, processor = untrained(tmp, vocab_size, hidden_size, layers, vision_depth, seed)
        if warmup_steps:
            warmup(model, processor, warmup_steps, reading_steps, figures, seed)
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        card = CARD.format(
            params=sum(p.numel() for p in model.parameters()),
            layers=layers,
            hidden=hidden_size,
            depth=vision_depth,
            vocab=len(processor.tokenizer),
            min_pixels=MIN_PIXELS,
            max_pixels=MAX_PIXELS,
            seed=seed,
            warmup=WARMUP_CARD.format(steps=warmup_steps, reading=reading_steps, figures=figures)
            if warmup_steps
            else "none: random weights (built with `warmup_steps=0`).",
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
    log.info("built tiny VL model at %s (%d parameters)", output, sum(p.numel() for p in model.parameters()))
    return output


def _build_inputs() -> str:
    """A digest of everything the build reads: this code, the tiny text model's code (its corpus and special tokens),
    the warm-up's figures, prompt and prompt builder, the fixture text, and the libraries that produce the files."""
    import hashlib
    from importlib.metadata import version

    from pipeline_steps.data.preprocessors import geometry3k
    from pipeline_steps.evaluation import generation
    from pipeline_steps.local import geometry_figures

    h = hashlib.sha256()
    code = [Path(m.__file__) for m in (tiny_model, geometry_figures, geometry3k, generation)]
    for f in [Path(__file__), *code, *sorted(tiny_model.FIXTURES.rglob("*.jsonl"))]:
        h.update(f.read_bytes())
    libraries = ("torch", "torchvision", "transformers", "tokenizers", "verl", "pillow", "qwen-vl-utils")
    h.update(" ".join(f"{d}=={version(d)}" for d in libraries).encode())
    return h.hexdigest()[:16]


def build_cached(cache_root: Path, tmp: Path) -> Path:
    """The tiny VL model, built once per cache (``PIPELINE_CACHE_DIR``; :func:`build_cache.cached_build`)."""
    entry = Path(cache_root) / "tiny-vl-model" / _build_inputs()
    return build_cache.cached_build(entry, build, Path(tmp) / "tiny-vl", "tiny VL model", complete=complete)


def warmup_rows(n: int, seed: int) -> list[dict]:
    """``n`` geometry3k-schema rows of freshly drawn polygons (:mod:`geometry_figures`, seeded apart from the fixture's
    figures), each side count equally often, with the preprocessor's prompt."""
    import random

    from pipeline_steps.data.preprocessors import geometry3k
    from pipeline_steps.local import geometry_figures

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sides = geometry_figures.SIDES[i % len(geometry_figures.SIDES)]
        raw = {
            "problem": geometry_figures.PROBLEM,
            "answer": str(sides),
            "images": [{"bytes": geometry_figures.figure(sides, rng), "path": None}],
        }
        rows.append(geometry3k.convert_row(raw, "warmup", i, geometry3k.DATA_SOURCE))
    return rows


def warmup(model, processor, steps: int, reading_steps: int, figures: int, seed: int, batch_size: int = 8) -> float:
    """The two-stage warm-up on ``figures`` fresh polygons (:func:`warmup_rows`); returns the last loss. Prompts are
    made by verl's code as the CPU trainer and the evaluation make them (:func:`generation.image_inputs`) under the
    preset's pixel limits, so the warm-up is token for token what a rollout sees.

    Why two stages: trained whole from the start, the text model learns the form and one constant answer long before
    the vision tower tells figures apart, and the whole model then stays there (measured). So first the vision tower
    learns, through the output layer, to make each image token name the side count (:func:`_reading_stage`); then,
    with the vision tower frozen (its lr > 0 here undid that reading: a probe fell back to chance), the text model
    learns to answer from those tokens (:func:`_answer_stage`)."""
    import torch

    from pipeline_steps.evaluation.generation import image_inputs

    torch.manual_seed(seed)
    data_cfg = {"image_key": "images", "mm_processor_kwargs": dict(WARMUP_MM)}
    tok = processor.tokenizer
    prompts = []
    for row in warmup_rows(figures, seed + 1):
        ids, mm = image_inputs(row, row["prompt"], processor, data_cfg)
        prompts.append((ids, mm, row["reward_model"]["ground_truth"]))
    digit = {p[2]: tok.convert_tokens_to_ids(p[2]) for p in prompts}  # each side count is one token
    model.train()
    loss = _reading_stage(model, prompts, digit, reading_steps, seed, batch_size)
    log.info("tiny VL warm-up, reading: %d steps, last loss %.3f", reading_steps, loss)
    loss = _answer_stage(model, tok, prompts, digit, steps, seed, batch_size)
    log.info("tiny VL warm-up, answering: %d steps, last loss %.3f", steps, loss)
    model.eval()
    return loss


def _reading_stage(model, prompts, digit, steps, seed, batch_size) -> float:
    """The vision tower and the output layer only: each image token's features, through the text model's final norm
    and the (tied) output layer, predict the side count's token."""
    import random

    import torch

    rng = random.Random(seed)
    params = [*model.model.visual.parameters(), model.lm_head.weight]
    opt = torch.optim.AdamW(params, lr=READING_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
        pixels, grids = (torch.cat([b[1][k] for b in batch]) for k in ("pixel_values", "image_grid_thw"))
        feats = model.model.get_image_features(pixels, grids).pooler_output
        logits = model.lm_head(model.model.language_model.norm(torch.cat(feats)))
        target = torch.cat([torch.full((f.shape[0],), digit[b[2]]) for f, b in zip(feats, batch)])
        loss = torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())


def _answer_stage(model, tok, prompts, digit, steps, seed, batch_size) -> float:
    """The whole model but the vision tower, on (figure + problem -> ``<think> </think> \\boxed{N}``): the loss
    covers the response tokens, the answer digit's weighted ``ANSWER_WEIGHT``, and the ``<|vision_end|>`` position
    also predicts the digit (a place right after the image tokens that gathers them for the answer)."""
    import random

    import torch

    from pipeline_steps.evaluation.generation import vision_inputs

    rng = random.Random(seed + 2)
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=WARMUP_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    vision_end = tok.convert_tokens_to_ids("<|vision_end|>")
    responses = {  # tokenized once per answer, not per sample
        truth: tok(RESPONSE.format(answer=truth) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        for truth in digit
    }
    loss = torch.tensor(0.0)
    try:
        for _ in range(steps):
            seqs, targets, weights, mms = [], [], [], []
            for ids, mm, truth in (prompts[rng.randrange(len(prompts))] for _ in range(batch_size)):
                seq = ids + responses[truth]
                target, weight = [-100] * len(seq), [0.0] * len(seq)  # position j predicts seq[j + 1]
                for j in range(len(ids) - 1, len(seq) - 1):
                    target[j] = seq[j + 1]
                    weight[j] = ANSWER_WEIGHT if seq[j + 1] == digit[truth] else 1.0
                k = ids.index(vision_end)
                target[k], weight[k] = digit[truth], 1.0
                seqs.append(seq), targets.append(target), weights.append(weight), mms.append(mm)
            width = max(map(len, seqs))
            left = [width - len(s) for s in seqs]  # left padding, as the rollouts pad
            input_ids = torch.tensor([[tok.pad_token_id] * n + s for n, s in zip(left, seqs)])
            attention = torch.tensor([[0] * n + [1] * len(s) for n, s in zip(left, seqs)])
            target = torch.tensor([[-100] * n + t for n, t in zip(left, targets)])
            weight = torch.tensor([[0.0] * n + w for n, w in zip(left, weights)])
            images = vision_inputs(input_ids, mms, model.config)  # verl's rotary positions: mm_token_type_ids
            logits = model(input_ids=input_ids, attention_mask=attention, **images).logits
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none", ignore_index=-100
            )
            loss = (ce * weight.reshape(-1)).sum() / weight.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        for p in model.model.visual.parameters():
            p.requires_grad_(True)
    return float(loss.detach())
