"""The tiny local vision-language model: a random Qwen2.5-VL (2 text layers, hidden 64, a 2-block vision tower) with a
byte-level BPE tokenizer trained on the fixture text, saved with a ``Qwen2_5_VLProcessor`` (image processor, video
processor, tokenizer, chat template) that loads through ``AutoProcessor`` and ``AutoModelForImageTextToText``.

``stage-model`` builds it for ``--model tiny-vl`` (preset ``local_tiny_vl``), cached like the tiny text model by a
digest of this code, the fixture corpus and the library versions (:func:`build_cached`). Deterministic: the same
inputs and seed give the same files. It reads the image (the vision tower's output replaces the ``<|image_pad|>``
embeddings). Before GRPO it gets a short supervised warm-up (:func:`format_warmup`, ``WARMUP_STEPS``) on polygons
drawn like the fixture's, never the fixture's own: it learns the ``<think> </think> \\boxed{N}`` form verl's geo3k
scorer reads, so GRPO's rollouts earn a reward (0.1 for the form, 1.0 when right; a random model never wrote the
form and every reward was 0). Its targets are the right side count only half the time (else a side count drawn at
random): what it learns of reading the figure beyond that, GRPO's reward must teach. ``warmup_steps=0`` gives the
random model the image-path tests were written against.

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
WARMUP_STEPS = 100  # the form in 100% of greedy answers on the fixture's test figures (measured)
WARMUP_LR = 3e-3
WARMUP_RIGHT_SHARE = 0.5  # a weak start on reading the figure: GRPO needs rollouts that are sometimes right
WARMUP_FIGURES = 64
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
WARMUP_CARD = """{steps} steps of supervised warm-up on {figures} polygons drawn like the geometry3k fixture's (never
its own figures), with its problem text: a target is `<think> </think> \\boxed{{N}}` with N the side count with
probability {share}, else drawn uniformly from 3..6. The model learns the form verl's geo3k scorer reads; what it gains
after the pipeline's `train` task comes from GRPO's reward (the base model's figures are in every evaluation)."""


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
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE
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
) -> Path:
    output = Path(output)
    if complete(output):
        log.info("tiny VL model already at %s", output)
        return output
    with atomic.atomic_dir(output, owner=owner) as tmp:
        model, processor = untrained(tmp, vocab_size, hidden_size, layers, vision_depth, seed)
        if warmup_steps:
            format_warmup(model, processor, warmup_steps, seed)
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
            warmup=WARMUP_CARD.format(steps=warmup_steps, figures=WARMUP_FIGURES, share=WARMUP_RIGHT_SHARE)
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


def format_warmup(
    model,
    processor,
    steps: int,
    seed: int,
    batch_size: int = 8,
    lr: float = WARMUP_LR,
    right_share: float = WARMUP_RIGHT_SHARE,
    figures: int = WARMUP_FIGURES,
) -> float:
    """Supervised steps on (figure + problem -> ``<think> </think> \\boxed{R}``), R the side count with probability
    ``right_share``, else drawn uniformly from the answers independently of the figure. Prompts are made by verl's
    code as the CPU trainer and the evaluation make them (:func:`generation.image_inputs`) under the preset's pixel
    limits, so the warm-up is token for token what a rollout sees. The loss covers the response tokens only. Returns
    the last loss."""
    import random

    import torch

    from pipeline_steps.evaluation.generation import image_inputs
    from pipeline_steps.local import geometry_figures, grpo_cpu

    rng = random.Random(seed)
    torch.manual_seed(seed)
    data_cfg = {"image_key": "images", "mm_processor_kwargs": dict(WARMUP_MM)}
    prompts = []
    for row in warmup_rows(figures, seed + 1):
        ids, mm = image_inputs(row, row["prompt"], processor, data_cfg)
        prompts.append((ids, mm, row["reward_model"]["ground_truth"]))
    tok = processor.tokenizer
    answers = [str(s) for s in geometry_figures.SIDES]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        seqs, masks, mms = [], [], []
        for _ in range(batch_size):
            ids, mm, truth = prompts[rng.randrange(len(prompts))]
            answer = truth if rng.random() < right_share else rng.choice(answers)
            r_ids = tok(RESPONSE.format(answer=answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            seqs.append(ids + r_ids)
            masks.append([0] * len(ids) + [1] * len(r_ids))
            mms.append(mm)
        width = max(map(len, seqs))
        pad = tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
        attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        loss_mask = torch.tensor([[0] * (width - len(m)) + m for m in masks], dtype=torch.bool)
        logits = model(input_ids=input_ids, attention_mask=attn, **grpo_cpu.mm_batch(mms)).logits[:, :-1]
        target = loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[target], input_ids[:, 1:][target])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    log.info("tiny VL format warm-up: %d steps, last loss %.3f", steps, float(loss.detach()))
    return float(loss.detach())
