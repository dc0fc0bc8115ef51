"""verl FSDP checkpoints: find ``global_step_N/actor`` in a run's checkpoints directory, merge its shards into a
Hugging Face model with verl's merger, check the merged model, hash model directories.

Used by the ``export`` step (merge, check, publish) and the ``evaluate`` step (score a checkpoint: it merges the
same way, so both hash the same content).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.constants import CHECKPOINT_TRACKER
from pipeline_steps.digests import sha256_file
from pipeline_steps.errors import UserError

log = logging.getLogger(__name__)

TRACKER = CHECKPOINT_TRACKER
SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# ---------------------------------------------------------------------------------------------
# checkpoint layout


def resolve_checkpoint(checkpoint_dir: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """``RUN/checkpoints`` (+ optional step) -> (step, ``global_step_N/actor``), layout checked.

    Raises UserError naming the missing piece and what to do about it.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise UserError(
            f"--checkpoint-dir {root}: not a directory; pass the run's checkpoints directory (RUN/checkpoints)"
        )
    tracker = root / TRACKER
    if step is None:
        if not tracker.is_file():
            raise UserError(
                f"--checkpoint-dir {root}: no {TRACKER} (no completed checkpoint save); "
                "pass --step N to pick a global_step_N directory, or point at the run's checkpoints directory"
            )
        text = tracker.read_text(encoding="utf-8").strip()
        if not text.isdigit():
            raise UserError(f"{tracker}: expected a step number, found {text[:40]!r}; fix the file or pass --step N")
        step = int(text)
    if step < 0:
        raise UserError(f"--step {step}: must be a non-negative training step")
    step_dir = root / f"global_step_{step}"
    if not step_dir.is_dir():
        have = sorted(p.name for p in root.glob("global_step_*"))
        raise UserError(f"{step_dir}: missing; available: {have or 'none'}; pass --step with one of them")
    actor = step_dir / "actor"
    shards = {}
    if actor.is_dir():
        for f in actor.iterdir():
            m = SHARD_RE.match(f.name)
            if m and f.stat().st_size > 0:
                shards.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not shards:
        raise UserError(
            f"{step_dir}: empty checkpoint (no actor/model_world_size_*_rank_*.pt shards; the save was interrupted); "
            "pass --step with an earlier complete step"
        )
    if len(shards) > 1:
        raise UserError(f"{actor}: shards from several world sizes {sorted(shards)}; keep one set and retry")
    ((world_size, ranks),) = shards.items()
    missing = sorted(set(range(world_size)) - ranks)
    if missing:
        raise UserError(
            f"{actor}: shard files for ranks {missing} of world size {world_size} are missing; the save is incomplete"
        )
    cfg = actor / "fsdp_config.json"
    if not cfg.is_file():
        raise UserError(
            f"{cfg}: missing (checkpoints from verl before 0.3 lack it); create it with the content "
            f'{{"FSDP_version": 1, "world_size": {world_size}}} and retry'
        )
    try:
        recorded = json.loads(cfg.read_text(encoding="utf-8")).get("world_size")
    except (ValueError, AttributeError):
        raise UserError(
            f'{cfg}: not valid JSON; rewrite it as {{"FSDP_version": 1, "world_size": {world_size}}}'
        ) from None
    if recorded != world_size:
        raise UserError(f"{cfg}: world_size {recorded!r} but the shards are for {world_size}; set it to {world_size}")
    if not (actor / "huggingface" / "config.json").is_file():
        raise UserError(
            f"{actor}/huggingface/config.json: missing; verl writes it with every save, copy the base model's "
            "config.json there"
        )
    return step, actor


# ---------------------------------------------------------------------------------------------
# merge and check


def merge_checkpoint(actor_dir: str | os.PathLike, target_dir: str | os.PathLike) -> Path:
    """Merge FSDP actor shards into a Hugging Face model with verl's merger (in-process).

    Equivalent to ``python -m verl.model_merger merge --backend fsdp --local_dir ACTOR --target_dir OUT``;
    the output appears atomically (a crash leaves no half-written model).
    """
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor_dir, target_dir = Path(actor_dir), Path(target_dir)
    with atomic.atomic_dir(target_dir) as tmp:
        config = ModelMergerConfig(
            operation="merge",
            backend="fsdp",
            local_dir=str(actor_dir),
            target_dir=str(tmp),
            hf_model_config_path=str(actor_dir / "huggingface"),
        )
        # the merger prints progress to stdout; our stdout carries the step's JSON summary
        with contextlib.redirect_stdout(sys.stderr):
            merger = FSDPModelMerger(config)
            merger.merge_and_save()
            merger.cleanup()
        if (actor_dir / "lora_train_meta.json").exists():
            log.warning(
                "checkpoint has LoRA adapters: verl saved them to %s/lora_adapter next to the merged base weights",
                target_dir,
            )
    return target_dir


def _reads_images(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def check_model(model_dir: str | os.PathLike, max_new_tokens: int = 4) -> dict:
    """Load with transformers and generate a few tokens; UserError when the model is unusable."""
    model_dir = Path(model_dir)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if _reads_images(model_dir):  # a vision-language model: loaded as a user loads it, and shown an image
            from PIL import Image
            from transformers import AutoModelForImageTextToText, AutoProcessor

            processor = AutoProcessor.from_pretrained(model_dir)
            tok = processor.tokenizer
            model = AutoModelForImageTextToText.from_pretrained(model_dir)
            chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "1 + 1 ="}]}]
            text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = processor(text=[text], images=[Image.new("RGB", (56, 56), "white")], return_tensors="pt")
        else:
            tok = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            ids = tok("1 + 1 =", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        new = int(out.shape[-1] - ids["input_ids"].shape[-1])
        if new < 1:
            raise RuntimeError("generated no tokens")
    except Exception as exc:  # any failure here means the export must not be published
        msg = " ".join(f"{exc.__class__.__name__}: {exc}".split())[:300]
        raise UserError(
            f"merged model at {model_dir} fails to load or generate with transformers ({msg}); nothing was exported or "
            "promoted"
        ) from None
    return {
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "dtype": str(next(model.parameters()).dtype),
        "generated_tokens": new,
    }


def dir_sha256(path: str | os.PathLike, names: tuple[str, ...] | None = None) -> str:
    """Content hash of a directory: sha256 over (relative path, file sha256) of its files, sorted."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(".") or (names is not None and rel not in names):
            continue
        h.update(f"{rel}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def weights_sha256(model_dir: str | os.PathLike) -> str:
    root = Path(model_dir)
    names = tuple(p.relative_to(root).as_posix() for p in root.glob("*.safetensors")) + WEIGHT_FILES
    return dir_sha256(root, names)


def materialize(model_or_checkpoint: str | os.PathLike, work_dir: str | os.PathLike, step: int | None = None) -> dict:
    """An HF model dir as is, or a checkpoint dir merged into ``work_dir``: {"path", "source", "step"}."""
    p = Path(model_or_checkpoint)
    if (p / "config.json").is_file():
        return {"path": p, "source": "hf_model", "step": None}
    if (p / TRACKER).is_file() or any(p.glob("global_step_*")) or step is not None:
        step, actor = resolve_checkpoint(p, step)
        merged = merge_checkpoint(actor, Path(work_dir) / f"merged-step{step}")
        return {"path": merged, "source": "checkpoint", "step": step}
    raise UserError(
        f"--model {p}: neither a Hugging Face model directory (config.json) nor a verl checkpoints directory "
        f"({TRACKER})"
    )
