"""The tiny local model: a small Qwen2-architecture config with random weights and a
byte-level BPE tokenizer trained on the fixture text.

No machine here can download weights, so the local profile stages, trains,
evaluates and exports this model. It is deterministic: the same corpus and seed
give byte-identical files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline_steps import atomic

log = logging.getLogger(__name__)

FIXTURES = Path(__file__).with_name("hub")  # the offline Hub fixtures (package data): their text trains the tokenizer
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(root: Path):
    for f in sorted(root.rglob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            yield " ".join(str(v) for k, v in sorted(row.items()) if isinstance(v, (str, int)) and k != "bytes_b64")
    yield "Answer: #### <think> </think> \\boxed{} 0123456789 + - * / = ."


def build(
    output: str | Path,
    corpus: str | Path = FIXTURES,
    vocab_size=512,
    hidden_size=64,
    layers=2,
    seed=0,
    owner: str | None = None,
) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    output = Path(output)
    if (output / "config.json").exists() and (output / "tokenizer.json").exists():
        log.info("tiny model already at %s", output)
        return output
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(Path(corpus)), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
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
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    with atomic.atomic_dir(output, owner=owner) as tmp:
        model.save_pretrained(tmp)
        fast.save_pretrained(tmp)
    log.info("built tiny model at %s (%d parameters)", output, sum(p.numel() for p in model.parameters()))
    return output
