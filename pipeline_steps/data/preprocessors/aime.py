"""Maxwell-Jia/AIME_2024: the evaluation set. Prompted like DAPO so verl's ``math_dapo`` scorer reads "Answer:"."""

from pipeline_steps.data.preprocessors import register_preprocessor
from pipeline_steps.data.preprocessors.common import Reject
from pipeline_steps.data.preprocessors.dapo_math import PROMPT_TEMPLATE

DATA_SOURCE = "aime2024"  # verl's default_compute_score sends "aime*" to math_dapo
REQUIRED_COLUMNS = ("ID", "Problem", "Answer")
TOOL_NAME = "code_interpreter"
SPLIT_NAMES = {"train": "test"}  # the repository's only split is the evaluation set


@register_preprocessor(
    "aime",
    data_source=DATA_SOURCE,
    tool_name=TOOL_NAME,
    required_columns=REQUIRED_COLUMNS,
    split_names=SPLIT_NAMES,
)
def convert_row(row: dict, split: str, index: int, data_source: str) -> dict:
    problem = (row.get("Problem") or "").strip()
    if not problem:
        raise Reject("empty_problem")
    answer = row.get("Answer")
    if answer is None or str(answer).strip() == "":
        raise Reject("missing_answer")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"style": "rule-lean", "ground_truth": str(answer).strip()},
        "extra_info": {"split": split, "index": index, "id": str(row.get("ID") or index)},
    }
