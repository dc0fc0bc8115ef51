"""BytedTsinghua-SIA/DAPO-Math-17k: already in verl's schema; vectorised because the published parquet has 1.79M rows
(17,917 unique rows repeated ~100 times). Deduplication and conflicts are handled by the shared driver."""

import pyarrow as pa
import pyarrow.compute as pc

from pipeline_steps.data.preprocessors import register_preprocessor

DATA_SOURCE = "math_dapo"
REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
TOOL_NAME = "code_interpreter"
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


@register_preprocessor(
    "dapo_math", data_source=DATA_SOURCE, tool_name=TOOL_NAME, required_columns=REQUIRED_COLUMNS, batch=True
)
def convert_batch(batch: pa.RecordBatch, split: str, start: int, data_source: str):
    t = pa.Table.from_batches([batch])
    gt = pc.struct_field(t["reward_model"].combine_chunks(), "ground_truth").cast(pa.string())
    n_msgs = pc.list_value_length(t["prompt"].combine_chunks())
    has_gt = pc.and_(pc.is_valid(gt), pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(pc.fill_null(gt, ""))), 0))
    has_prompt = pc.fill_null(pc.greater(n_msgs, 0), False)
    ok = pc.and_(has_gt, has_prompt)
    rejected = []
    if not pc.all(ok).as_py():
        bad = t.filter(pc.invert(ok)).to_pylist()
        rejected = [
            (r, "missing_ground_truth" if not (r.get("reward_model") or {}).get("ground_truth") else "empty_prompt")
            for r in bad
        ]
        t, gt = t.filter(ok), gt.filter(ok)
    extra = t["extra_info"].combine_chunks()
    index = (
        pc.struct_field(extra, "index").cast(pa.string())
        if "index" in [f.name for f in extra.type]
        else pa.array([str(start + i) for i in range(len(t))])
    )
    n = len(t)
    out = pa.table(
        {
            "data_source": pa.array([data_source] * n, pa.string()),
            "prompt": t["prompt"],
            "ability": t["ability"],
            "reward_model": pa.StructArray.from_arrays(
                [pa.array(["rule-lean"] * n, pa.string()), pc.utf8_trim_whitespace(gt)], names=["style", "ground_truth"]
            ),
            "extra_info": pa.StructArray.from_arrays(
                [pa.array([split] * n, pa.string()), index], names=["split", "index"]
            ),
        }
    )
    return out, rejected
