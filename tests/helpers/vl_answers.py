"""Run in a fresh process (``python -m tests.helpers.vl_answers MODEL_DIR``): load an exported vision-language model
as a user would (``AutoProcessor`` + ``AutoModelForImageTextToText``), and answer the geometry3k fixture's test
figures and blank images of the same size. Prints one JSON object: per row the ground truth, the greedy answer with the
figure and with the blank, and the model's probabilities of the answers 3..6 after ``\\boxed{`` with each."""

from __future__ import annotations

import io
import json
import sys


def main(model_dir: str) -> dict:
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
    for row in geo3k_rows("test"):
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
    return {"rows": out}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
