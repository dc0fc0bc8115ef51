"""hiyouga/geometry3k: one ``<image>`` placeholder per image; rows with missing or unreadable images are rejected
(verl's examples/data_preprocess/geo3k.py)."""

import hashlib
import io

from pipeline_steps.data.preprocessors import register_preprocessor
from pipeline_steps.data.preprocessors.common import Reject

DATA_SOURCE = "hiyouga/geometry3k"
REQUIRED_COLUMNS = ("images", "problem", "answer")
TOOL_NAME = "calc_geo3k_reward"
TOOL_SYSTEM_PROMPT = (  # verl's geo3k multi-turn recipe: the tool scores a candidate answer
    "You can call the `{tool}` tool with a candidate answer to check it before giving the final answer in \\boxed{{}}."
)
PLACEHOLDER = "<image>"
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \boxed{}."
)


def _check_image(img) -> bytes:
    from PIL import Image, UnidentifiedImageError

    data = (img or {}).get("bytes") if isinstance(img, dict) else None
    if not data:
        raise Reject("missing_image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise Reject("unreadable_image") from None
    return data


@register_preprocessor(
    "geometry3k",
    data_source=DATA_SOURCE,
    tool_name=TOOL_NAME,
    required_columns=REQUIRED_COLUMNS,
    tool_system_prompt=TOOL_SYSTEM_PROMPT,
)
def convert_row(row: dict, split: str, index: int, data_source: str) -> dict:
    problem = (row.get("problem") or "").strip()
    answer = row.get("answer")
    if not problem:
        raise Reject("empty_problem")
    if answer is None or str(answer).strip() == "":
        raise Reject("missing_answer")
    images = list(row.get("images") or [])
    placeholders = problem.count(PLACEHOLDER)
    if placeholders < len(images):
        raise Reject("image_without_placeholder")
    if placeholders > len(images):
        raise Reject("placeholder_without_image")
    digest = hashlib.sha256()
    for img in images:
        digest.update(hashlib.sha256(_check_image(img)).digest())
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": [{"bytes": img["bytes"], "path": img.get("path")} for img in images],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer).strip()},
        "extra_info": {"split": split, "index": index, "answer": str(answer).strip(), "question": problem},
        "_key_extra": digest.hexdigest(),  # the same text over different figures is a different problem
    }
