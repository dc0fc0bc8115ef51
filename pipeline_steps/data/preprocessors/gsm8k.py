"""openai/gsm8k: the number after ``####`` is the ground truth (verl's examples/data_preprocess/gsm8k.py)."""

import re

from pipeline_steps.data.preprocessors import register_preprocessor
from pipeline_steps.data.preprocessors.common import Reject

DATA_SOURCE = "openai/gsm8k"
REQUIRED_COLUMNS = ("question", "answer")
TOOL_NAME = "code_interpreter"  # pipeline_steps/tools/code_sandbox.yaml (verl 0.9.1 has no gsm8k tool)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"####\s*(.*?)\s*$", re.S)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def extract_answer(answer: str) -> str:
    if not answer or not answer.strip():
        raise Reject("empty_answer")
    m = _FINAL.search(answer)
    if not m:
        raise Reject("missing_final_answer")
    value = m.group(1).replace(",", "").replace("$", "").strip()
    if not _NUMBER.fullmatch(value):
        raise Reject("non_numeric_answer")
    return value


@register_preprocessor("gsm8k", data_source=DATA_SOURCE, tool_name=TOOL_NAME, required_columns=REQUIRED_COLUMNS)
def convert_row(row: dict, split: str, index: int, data_source: str) -> dict:
    question = (row.get("question") or "").strip()
    if not question:
        raise Reject("empty_question")
    answer = row.get("answer") or ""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }
