"""Run in a fresh process (``python -m tests.helpers.vl_answers MODEL_DIR [--polygons N]``): load an exported
vision-language model as a user would (``AutoProcessor`` + ``AutoModelForImageTextToText``), and answer the geometry3k
fixture's test figures (or ``N`` polygons drawn like the tiny VL model's warm-up figures with a seed of their own, held
out from it) and blank images of the same size. Prints one JSON object: per row the ground truth, the greedy answer
with the figure and with the blank, and the model's probabilities of the answers 3..6 after ``\\boxed{`` with each;
and the count right with the figure and with the blank."""

from __future__ import annotations

import argparse
import io
import json

HELD_OUT_SEED = 999  # the warm-up draws with seed + 1 = 1 (tiny_vl_model.warmup_rows)


def main(model_dir: str, polygons: int = 0) -> dict:
    import torch
    from mathruler.grader import extract_boxed_content
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.helpers.vl_rows import geo3k_rows, with_blank_images

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = processor.tokenizer
    digits = [tok.convert_tokens_to_ids(str(d)) for d in (3, 4, 5, 6)]
    out = []
    if polygons:
        from pipeline_steps.local.tiny_vl_model import warmup_rows

        rows = warmup_rows(polygons, HELD_OUT_SEED)
    else:
        rows = geo3k_rows("test")
    for row in rows:
        record = {"ground_truth": row["reward_model"]["ground_truth"]}
        for name, r in (("figure", row), ("blank", with_blank_images(row))):
            text = r["prompt"][0]["content"].replace("<image>", "")
            chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            image = Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB")
            inputs = processor(text=[prompt], images=[image], return_tensors="pt")
            with torch.no_grad():
                gen = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
                answer = tok.decode(gen[0, inputs["input_ids"].shape[-1] :], skip_special_tokens=True)
                forced = processor(text=[prompt + "<think> </think> \\boxed{"], images=[image], return_tensors="pt")
                logits = model(**forced).logits[0, -1]
            p = torch.softmax(logits, -1)[digits]
            record[name] = {"answer": extract_boxed_content(answer), "p": [float(x) for x in p]}
        out.append(record)
    right = {k: sum(r[k]["answer"] == r["ground_truth"] for r in out) for k in ("figure", "blank")}
    return {"rows": out, "right": right, "of": len(out)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--polygons", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(main(args.model_dir, args.polygons)))
