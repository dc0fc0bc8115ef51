"""Custom JSONL in the shape hosted RL services take: ``{"messages": [...], "rollout_extra": {"solution": ...}}``.

Lines are read one by one so that a non-UTF-8 or truncated line is a counted rejection, not a failed file.
Trailing assistant messages (reference answers) are dropped from the prompt.
"""

import json

from pipeline_steps.data.preprocessors.base import Reject

DATA_SOURCE = "math_dapo"  # rule-based "Answer:" matching; set data_source in the registry entry for another scorer
REQUIRED_COLUMNS = ()
TOOL_NAME = "code_interpreter"


def read_rows(path):
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield {"raw": raw[:200].decode("utf-8", "replace")}, "not_utf8"
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                yield {"raw": text[:200]}, "invalid_json"
                continue
            if not isinstance(row, dict):
                yield {"raw": text[:200]}, "not_an_object"
                continue
            yield row, None


def convert_row(row: dict, split: str, index: int, data_source: str) -> dict:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Reject("missing_messages")
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise Reject("malformed_message")
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not any(m["role"] == "user" for m in messages):
        raise Reject("no_user_message")
    extra = row.get("rollout_extra")
    solution = extra.get("solution") if isinstance(extra, dict) else None
    if solution is None or str(solution).strip() == "":
        raise Reject("missing_solution")
    return {
        "data_source": data_source,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in messages],
        "ability": "custom",
        "reward_model": {"style": "rule", "ground_truth": str(solution).strip()},
        "extra_info": {"split": split, "index": index, "rollout_extra": json.dumps(extra, sort_keys=True)},
    }
