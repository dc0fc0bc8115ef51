"""The tiny local model: a small Qwen2-architecture config, a byte-level BPE tokenizer trained on the fixture
text, and a short supervised warm-up on the synthetic ``arithmetic`` task.

No machine here can download weights, so the local profile stages, trains, evaluates and exports this model.
The warm-up (``format_warmup_steps``) trains on the synthetic ``arithmetic`` dataset's train questions (with
GSM8K's instruction) whose targets are ``#### R``: R is the right answer with probability ``WARMUP_RIGHT_SHARE``
and otherwise drawn at random from the answers' range, independently of the question. The model learns to answer
``#### <a number>`` and stop, and a weak start on the skill, so that GRPO's rollouts are sometimes right and the
reward has something to work with (from a model at chance, 1 in 10, a hundred CPU steps of GRPO did not learn to
copy the digit). What it gains over this base after GRPO, the reward taught it; every evaluation reports the base.
The model card (``README.md``) says so. Deterministic: the same corpus and seed give the same files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.local import build_cache

log = logging.getLogger(__name__)

FIXTURES = Path(__file__).with_name("hub")  # the offline Hub fixtures (package data): their text trains the tokenizer
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORMAT_WARMUP_STEPS = 400  # with WARMUP_LR: greedy 100/100 held-out, sampled 41% (the skill half taught)
WARMUP_LR = 2e-3
WARMUP_RIGHT_SHARE = 0.5  # a weak start on the skill: GRPO needs rollouts that are sometimes right
CARD = """---
license: mit
library_name: transformers
---
# tiny local model

A {params}-parameter Qwen2-architecture model with a {vocab}-token byte-level BPE tokenizer, built by
`python -m pipeline_steps build-tiny-model` (seed {seed}) for the pipeline's local profile.

Training before GRPO: {warmup}
"""
WARMUP_CARD = """{steps} steps of supervised warm-up. Prompts are the synthetic `arithmetic` dataset's train questions
("Which digit is in k 7 7 m 7 7 b 7 7?") with GSM8K's instruction; a target is `#### R` with R the right answer
with probability {share}, else drawn uniformly from {answers} independently of the question. The model learns the
answer form verl's GSM8K scorer reads, to stop, and (with a share above 0) a weak start on the skill. What it gains
after the pipeline's `train` task comes from GRPO's reward (the base model's figures are in every evaluation)."""


# fixture revisions added after the tokenizer's recipe: their text would change the tokenizer, and with it what every
# tiny model (and the tool and arithmetic demos' warm-ups) learns; the corpus stays the fixtures' text before them
CORPUS_EXCLUDES = ("hiyouga/geometry3k/v2/",)


def _corpus(root: Path):
    for f in sorted(root.rglob("*.jsonl")):
        if any(part in f.relative_to(root).as_posix() for part in CORPUS_EXCLUDES):
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            yield " ".join(str(v) for k, v in sorted(row.items()) if isinstance(v, (str, int)) and k != "bytes_b64")
    yield "Answer: #### <think> </think> \\boxed{} 0123456789 + - * / = ."


def untrained(
    directory: Path,
    corpus,
    vocab_size: int,
    chat_template: str,
    hidden_size: int,
    layers: int,
    seed: int,
    added_tokens=(),
    digits_apart: bool = False,
):
    """A byte-level BPE tokenizer trained on ``corpus`` (plus ``added_tokens``: not special, so a decoded response keeps
    them as Qwen2.5's does and verl's hermes parser finds a tool call) and a randomly initialised
    Qwen2 model sized to it; config and tokenizer are saved to ``directory`` and the tokenizer returned is the one
    loaded back from there. Warm-ups must use that one: the in-memory object tokenizes differently ("#### 7" ->
    "####", "Ġ7" in memory; "####", "Ġ", "7" once loaded), and a warm-up taught in other tokens teaches the loaded
    model nothing (it stayed at chance). ``digits_apart``: every digit its own token, as in Qwen2.5's tokenizer, so a
    number is the same tokens wherever it stands (byte-level BPE alone makes " 347" in a question and "347" in code
    different tokens, and copying it a translation)."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digits_apart:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = chat_template
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
    )
    config.save_pretrained(directory)
    fast.save_pretrained(directory)
    fast = AutoTokenizer.from_pretrained(directory)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    return model, fast


def build(
    output: str | Path,
    corpus: str | Path = FIXTURES,
    vocab_size=512,
    hidden_size=64,
    layers=2,
    seed=0,
    owner: str | None = None,
    format_warmup_steps: int = FORMAT_WARMUP_STEPS,
    right_share: float | None = None,
) -> Path:
    output = Path(output)
    if build_cache.complete(output):
        log.info("tiny model already at %s", output)
        return output
    # the output directory first: an unwritable --output fails in one line before any work
    with atomic.atomic_dir(output, owner=owner) as tmp:
        model, fast = untrained(tmp, _corpus(Path(corpus)), vocab_size, CHAT_TEMPLATE, hidden_size, layers, seed)
        if format_warmup_steps:
            format_warmup(
                model,
                fast,
                format_warmup_steps,
                seed,
                lr=WARMUP_LR,
                right_share=WARMUP_RIGHT_SHARE if right_share is None else right_share,
            )
        model.save_pretrained(tmp)
        fast.save_pretrained(tmp)
        from pipeline_steps.local import synthetic

        card = CARD.format(
            params=sum(p.numel() for p in model.parameters()),
            vocab=len(fast),
            seed=seed,
            warmup=WARMUP_CARD.format(
                steps=format_warmup_steps,
                share=WARMUP_RIGHT_SHARE if right_share is None else right_share,
                answers=f"{min(synthetic.ANSWERS)}..{max(synthetic.ANSWERS)}",
            )
            if format_warmup_steps
            else "none: random weights (built with `--format-warmup-steps 0`).",
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
    log.info("built tiny model at %s (%d parameters)", output, sum(p.numel() for p in model.parameters()))
    return output


def _build_inputs() -> str:
    """A digest of everything the build reads: this code, the synthetic task and the instruction it trains on, the
    tokenizer corpus, and the libraries that produce the weights. Same digest, same files (the build is seeded)."""
    import hashlib
    from importlib.metadata import version

    from pipeline_steps.data.preprocessors import gsm8k
    from pipeline_steps.local import synthetic

    h = hashlib.sha256()
    for f in [Path(__file__), Path(synthetic.__file__), Path(gsm8k.__file__), *sorted(FIXTURES.rglob("*.jsonl"))]:
        h.update(f.read_bytes())
    h.update(" ".join(f"{d}=={version(d)}" for d in ("torch", "transformers", "tokenizers")).encode())
    return h.hexdigest()[:16]


def build_cached(cache_root: Path, tmp: Path) -> Path:
    """The default tiny model, built once per cache (``PIPELINE_CACHE_DIR``): a build trains the tokenizer and the
    warm-up, and every local run and test stages the same bytes (:func:`build_cache.cached_build`)."""
    entry = Path(cache_root) / "tiny-model" / _build_inputs()
    return build_cache.cached_build(entry, build, Path(tmp) / "tiny", "tiny model")


def format_warmup(
    model, tokenizer, steps: int, seed: int, batch_size: int = 16, lr: float = 5e-3, right_share: float = 0.0
) -> None:
    """Supervised steps on (synthetic question -> ``#### R``, R random): the answer format, not the answers.

    The loss covers the response tokens only (``#### R`` and the end-of-turn token).
    """
    import random

    import torch

    from pipeline_steps.data.preprocessors.gsm8k import INSTRUCTION
    from pipeline_steps.local import synthetic

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    template = [{"role": "user", "content": "{question} " + INSTRUCTION}]
    prompt = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    items, _ = synthetic.splits(len(synthetic.ITEMS))  # never the held-out questions
    prompts = [encode(prompt.replace("{question}", synthetic.question(item))) for item in items]
    for _ in range(steps):
        seqs, masks = [], []
        for _ in range(batch_size):
            i = rng.randrange(len(prompts))
            p_ids = prompts[i]
            r_ids = encode(synthetic.format_example(items[i], rng, right_share) + "<|im_end|>")
            seqs.append(p_ids + r_ids)
            masks.append([0] * len(p_ids) + [1] * len(r_ids))
        width = max(map(len, seqs))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
        loss_mask = torch.tensor([[0] * (width - len(m)) + m for m in masks], dtype=torch.bool)
        attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1]
        target_mask = loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[target_mask], ids[:, 1:][target_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    log.info("format warm-up: %d steps, last loss %.3f", steps, float(loss.detach()))
