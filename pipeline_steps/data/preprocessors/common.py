"""What every preprocessor shares: the rejection type, prompt keys and the tool-agent variant.

A preprocessor module (one per dataset, like verl's ``utils/reward_score``) registers its conversion function with
:func:`pipeline_steps.data.preprocessors.register_preprocessor` (the package's docstring lists what it declares).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


class Reject(Exception):
    """A row that cannot become a training row; the message is a short reason slug."""


def framed(*parts: pa.Array) -> pa.Array:
    """Row-wise ``len(a):a len(b):b ...`` (lengths in bytes) as binary: an exact, reversible key for any bytes, where a
    separator character could also occur in the data (a NUL, a 0x1e) and make two different rows one key. Nulls count
    as empty."""
    pieces = []
    for part in parts:
        if isinstance(part, pa.ChunkedArray):
            part = part.combine_chunks()
        b = pc.fill_null(part.cast(pa.binary()), pa.scalar(b"", pa.binary()))
        pieces += [pc.binary_length(b).cast(pa.string()).cast(pa.binary()), pa.scalar(b":", pa.binary()), b]
    return pc.binary_join_element_wise(*pieces, pa.scalar(b"", pa.binary()))


def unframe_first(value: bytes) -> tuple[bytes, bytes]:
    """``(a, rest)`` of a :func:`framed` value: its first part and the framed parts after it."""
    colon = value.index(b":")
    end = colon + 1 + int(value[:colon])
    return value[colon + 1 : end], value[end:]


def prompt_key(prompt: pa.Array) -> pa.Array:
    """One binary key per row identifying its chat prompt (roles and contents, exactly), vectorised."""
    if isinstance(prompt, pa.ChunkedArray):
        prompt = prompt.combine_chunks()
    flat = pc.list_flatten(prompt)
    joined = framed(flat.field("role"), flat.field("content"))  # each message self-delimiting: concatenation is exact
    offsets = prompt.offsets
    offsets = pc.subtract(offsets, offsets[0])
    return pc.binary_join(pa.ListArray.from_arrays(offsets, joined), pa.scalar(b"", pa.binary()))


def ground_truth(table: pa.Table) -> pa.Array:
    return pc.struct_field(table["reward_model"].combine_chunks(), "ground_truth").cast(pa.string())


TOOL_SYSTEM_PROMPT = (
    "You are a careful problem solver. You can call the `{tool}` tool to run Python code; reason step by step, "
    "use the tool to compute or check intermediate results, then give the final answer in the format the question "
    "asks for."
)


def tool_agent_rows(rows: list[dict], tool_name: str, system_prompt: str | None = None) -> list[dict]:
    """verl's multi-turn tool recipes: an agent loop name, a system prompt naming the tool (a model is only offered
    the tool's schema by the chat template; the guides' prompts also say when to use it) and per-row kwargs for the
    tool's create()."""
    system = {"role": "system", "content": (system_prompt or TOOL_SYSTEM_PROMPT).format(tool=tool_name)}
    out = []
    for row in rows:
        gt = row["reward_model"]["ground_truth"]
        question = row["prompt"][-1]["content"]
        extra = dict(row["extra_info"] or {})
        extra["need_tools_kwargs"] = True
        extra["tools_kwargs"] = {tool_name: {"create_kwargs": {"ground_truth": gt}}}
        extra["interaction_kwargs"] = {"query": question, "ground_truth": gt}
        prompt = list(row["prompt"])
        if prompt[0]["role"] != "system":  # a dataset's own system prompt is kept
            prompt = [system, *prompt]
        out.append(dict(row, prompt=prompt, agent_name="tool_agent", extra_info=extra))
    return out
