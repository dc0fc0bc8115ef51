"""The tiny tool model: the tiny Qwen2-architecture model, made able to call the code tool.

What the tiny model (:mod:`pipeline_steps.local.tiny_model`) lacks for tool calling, and this build adds:

* a chat template that renders the tools' schemas into the system turn and the hermes tool-call and tool-response
  turns, as Qwen2.5-Instruct's own template does (``TOOL_CHAT_TEMPLATE``); the plain tiny model's template dropped
  ``tools``, so the model was never shown the tool;
* ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<tools>``, ``</tools>`` as single
  added tokens, as in Qwen2.5's vocabulary: to call the tool the policy makes one decision at the first token of its
  turn (``<tool_call>`` or ``####``), which GRPO can move, instead of eleven character tokens;
* a tokenizer trained on the fixtures plus the rendered tool prompts, so the template's boilerplate costs few tokens,
  with every digit its own token as in Qwen2.5's: byte-level BPE alone made " 347" in the question and "347" in the
  code different tokens, and the model copied both operands right in 5 of 19 sampled calls (23 of 24 with digits
  apart), so few calls earned a reward;
* a supervised format warm-up on the synthetic ``multiply`` task ("What is 347 * 812?"): a share ``TOOL_SHARE`` of the
  targets is a tool call ``print(A * B)`` followed, after the tool's real answer, by ``#### <that answer>``; the rest
  answer ``#### R`` at once with R a random product-sized number (the format of a direct answer, never a right one).
  The model learns the two formats and calls the tool in about ``TOOL_SHARE`` of its first turns, whatever the
  question: whether to call it is left to GRPO's reward. The warm-up's sequences are built with verl's own
  Continuous Token builder, the code the agent loop builds rollouts with, so they are token for token what a rollout
  of the same turns holds (tool turn included; its tokens take no part in the loss, as in GRPO).

Deterministic: the same code, corpus and seed give the same files.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.local import build_cache, tiny_model

log = logging.getLogger(__name__)

TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
# Qwen2.5-Instruct's template (the tools' schemas in the system turn inside <tools></tools>, hermes tool calls, tool
# answers as <tool_response> in a user turn), without its paragraph of instructions around the schemas: every token of
# the prompt costs CPU in each rollout and update, and the warm-up teaches the call's form
TOOL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.' }}{%- endif %}"
    '{%- if tools %}{{- "\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>" }}{%- endif %}'
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_NAME = "code_interpreter"  # pipeline_steps/tools/code_sandbox.yaml
TOOL_SHARE = 0.2  # first turns that call the tool after the warm-up: sometimes, so GRPO's groups can compare
# share of warm-up examples that hold a tool call and its answer (the forms to learn: copying the operands into the
# code, the tool's answer into `#### N`); only so many of them train the first token (call or answer at once) that
# the first tokens trained are calls in TOOL_SHARE of cases
FORM_SHARE = 0.75
WARMUP_STEPS = 300  # with digits apart, enough to copy both operands right in ~96% of calls (700 did no better)
WARMUP_LR = 3e-3
VOCAB_SIZE = 1024
CARD_WARMUP = """{steps} steps of supervised warm-up on the synthetic `multiply` task ("What is 347 * 812?", GSM8K's
instruction, the code tool's schema in the system turn): {share_pct}% of the targets call the code tool
(`print(A * B)`) and then answer `#### <the tool's answer>`; the others answer `#### R` at once with R a random
number (never taught a right answer). The model learns the formats and calls the tool in about {share_pct}% of its
first turns whatever the question; whether to call it is left to GRPO's reward."""


def tool_schemas() -> list[dict]:
    """The code tool's schema as verl's ToolAgentLoop hands it to the chat template."""
    import yaml
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from pipeline_steps.tools import resolve_config_path

    config = yaml.safe_load(Path(resolve_config_path("pkg:pipeline_steps.tools/code_sandbox.yaml")).read_text())
    return [
        OpenAIFunctionToolSchema.model_validate(t["tool_schema"]).model_dump(exclude_unset=True, exclude_none=True)
        for t in config["tools"]
    ]


def prompt_messages(a: int, b: int) -> list[dict]:
    """A ``multiply`` row's prompt exactly as the pipeline makes it: the gsm8k preprocessor's user turn and the
    ``tool_agent`` variant's system turn."""
    from pipeline_steps.data.preprocessors import gsm8k
    from pipeline_steps.data.preprocessors.common import tool_agent_rows
    from pipeline_steps.local import synthetic

    row = gsm8k.convert_row(synthetic.multiply_row((a, b)), "train", 0, gsm8k.DATA_SOURCE)
    return list(tool_agent_rows([row], gsm8k.TOOL_NAME)[0]["prompt"])


def call_text(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {{"code": "print({a} * {b})"}}}}\n</tool_call>'


def _corpus(schemas):
    from pipeline_steps.local import synthetic

    yield from tiny_model._corpus(tiny_model.FIXTURES)
    rng = random.Random(0)
    for a, b in synthetic.multiply_items(64, seed=1):
        messages = prompt_messages(a, b)
        text = _render(messages, schemas)
        yield text + call_text(a, b) + f"<tool_response>\n{a * b}\n</tool_response>#### {rng.randint(10**4, 10**6)}"


def _render(messages, schemas) -> str:
    from jinja2 import Environment

    env = Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    return env.from_string(TOOL_CHAT_TEMPLATE).render(messages=messages, tools=schemas, add_generation_prompt=True)


def build(
    output: str | Path,
    seed: int = 0,
    warmup_steps: int = WARMUP_STEPS,
    tool_share: float = TOOL_SHARE,
    hidden_size: int = 128,
    layers: int = 2,
) -> Path:
    output = Path(output)
    if build_cache.complete(output):
        return output
    schemas = tool_schemas()
    with atomic.atomic_dir(output) as tmp:
        model, fast = tiny_model.untrained(
            tmp,
            _corpus(schemas),
            VOCAB_SIZE,
            TOOL_CHAT_TEMPLATE,
            hidden_size,
            layers,
            seed,
            added_tokens=TOOL_TOKENS,
            digits_apart=True,
        )
        for t in TOOL_TOKENS:
            ids = fast.encode(t, add_special_tokens=False)
            assert len(ids) == 1, f"{t} is {len(ids)} tokens in the saved tokenizer"
        if warmup_steps:
            warmup(model, fast, schemas, warmup_steps, seed, tool_share=tool_share)
        model.save_pretrained(tmp)
        fast.save_pretrained(tmp)
        card = tiny_model.CARD.format(
            params=sum(p.numel() for p in model.parameters()),
            vocab=len(fast),
            seed=seed,
            warmup=CARD_WARMUP.format(steps=warmup_steps, share_pct=round(100 * tool_share)),
        )
        (tmp / "README.md").write_text(card.replace("# tiny local model", "# tiny local tool model"), encoding="utf-8")
    log.info("built tiny tool model at %s", output)
    return output


def _examples(tokenizer, schemas, seed: int, tool_share: float):
    """(token ids, loss mask) of warm-up conversations, built as verl's agent loop builds a rollout."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    builder = create_continuous_token_builder(tokenizer)  # what AgentLoopBase makes for this tokenizer
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    from pipeline_steps.local import synthetic

    # P(first token trained | call example) such that calls are TOOL_SHARE of the first tokens trained
    decide = tool_share * (1 - FORM_SHARE) / (FORM_SHARE * (1 - tool_share)) if tool_share < 1 else 1.0
    while True:
        a, b = rng.randint(*synthetic.MULTIPLY_RANGE), rng.randint(*synthetic.MULTIPLY_RANGE)
        messages = prompt_messages(a, b)
        ids = builder.build_initial_tokens(messages, tools=schemas)
        mask = [0] * len(ids)
        if rng.random() < FORM_SHARE:
            call = encode(call_text(a, b)) + [eos]
            ids, mask = ids + call, mask + [int(rng.random() < decide)] + [1] * (len(call) - 1)
            arguments = json.dumps({"code": f"print({a} * {b})"})
            function = {"name": TOOL_NAME, "arguments": arguments}
            assistant = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
            before = [*messages, assistant]
            delta = builder.tokenize_context_incremental_messages(
                before, [*before, {"role": "tool", "content": str(a * b)}], tools=schemas
            )
            ids, mask = ids + delta, mask + [0] * len(delta)
            final = encode(f"#### {a * b}") + [eos]
        else:
            final = encode(f"#### {rng.randint(10**5, 10**6 - 1)}") + [eos]
        yield ids + final, mask + [1] * len(final)


def warmup(model, tokenizer, schemas, steps: int, seed: int, tool_share: float, batch_size: int = 32) -> None:
    """Supervised steps on ``_examples``; the loss covers the model's turns only.

    Every example starts with the same system turn (the instruction and the tool's schema, most of its tokens): it is
    run once per step without gradient and its key/value cache shared by the batch, which then runs only the rest
    (question, turns), right-padded. The rest attends to the system turn exactly as in a rollout.
    """
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    examples = _examples(tokenizer, schemas, seed, tool_share)
    first, second = next(examples), next(examples)
    n = 0
    while first[0][n] == second[0][n]:
        n += 1
    prefix = torch.tensor([first[0][:n]])
    pad = tokenizer.pad_token_id
    for step in range(steps):
        batch = [next(examples) for _ in range(batch_size)]
        assert all(s[:n] == prefix[0].tolist() for s, _ in batch)
        rest = [(s[n:], m[n:]) for s, m in batch]
        width = max(len(s) for s, _ in rest)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in rest])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rest], dtype=torch.bool)
        attn = torch.tensor([[1] * (n + len(s)) + [0] * (width - len(s)) for s, _ in rest])
        with torch.no_grad():
            cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch_size)
        pos = torch.arange(n, n + width)[None].expand(batch_size, -1)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache).logits[:, :-1]
        target = loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[target], ids[:, 1:][target])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            log.info("tool format warm-up: step %d/%d, loss %.3f", step, steps, float(loss.detach()))
    model.eval()
    log.info("tool format warm-up: %d steps, last loss %.3f", steps, float(loss.detach()))


def _build_inputs() -> str:
    """A digest of everything the build reads (this code, the tiny model's, the task, the row shape, the tool's
    schema, the corpus, the libraries): same digest, same files."""
    import hashlib
    from importlib.metadata import version

    from pipeline_steps.data.preprocessors import common, gsm8k
    from pipeline_steps.local import synthetic
    from pipeline_steps.tools import resolve_config_path

    h = hashlib.sha256()
    files = [Path(__file__), Path(tiny_model.__file__), Path(synthetic.__file__), Path(gsm8k.__file__)]
    files += [Path(common.__file__), Path(resolve_config_path("pkg:pipeline_steps.tools/code_sandbox.yaml"))]
    for f in [*files, *sorted(tiny_model.FIXTURES.rglob("*.jsonl"))]:
        h.update(f.read_bytes())
    h.update(" ".join(f"{d}=={version(d)}" for d in ("torch", "transformers", "tokenizers", "verl")).encode())
    return h.hexdigest()[:16]


def build_cached(cache_root: Path, tmp: Path) -> Path:
    """The tiny tool model, built once per cache (``PIPELINE_CACHE_DIR``), as :func:`tiny_model.build_cached`."""
    entry = Path(cache_root) / "tiny-tool-model" / _build_inputs()
    return build_cache.cached_build(entry, build, Path(tmp) / "tiny-tool", "tiny tool model")
