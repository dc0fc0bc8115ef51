"""The evaluation's generators (pipeline_steps/evaluation/generation.py): image rows as vLLM chat parts, and image
rows through the staged processor into the tiny vision-language model on CPU (verl's own input code)."""

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import generation
from tests.helpers.eval_rows import aime_rows, png
from tests.helpers.eval_rows import converted_geo3k_rows as geo3k_rows


def test_image_placeholders_become_the_rows_images_as_vllm_chat_parts():
    import base64

    row = geo3k_rows(1)[0]
    row["images"][0]["bytes"] = png(color="red")
    (message,) = generation.chat_messages(row)
    assert message["role"] == "user"
    image, text = message["content"]  # "<image>Find x ..." -> the image first, then the text, as verl splits it
    assert image["type"] == "image_url" and text["type"] == "text" and text["text"].startswith("Find x")
    head, data = image["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64" and base64.b64decode(data) == row["images"][0]["bytes"]
    assert "<image>" not in json.dumps(message)
    # text rows (AIME stays available to a VL preset) keep their plain prompt
    assert generation.chat_messages(aime_rows(1)[0]) == aime_rows(1)[0]["prompt"]
    # a placeholder without its image is refused in one line
    row["prompt"][0]["content"] += " <image>"
    with pytest.raises(UserError, match="more <image> than images"):
        generation.chat_messages(row)


def test_a_text_model_is_refused_image_rows_and_a_vision_model_reads_them(tiny_model, tiny_vl_model):
    rows = geo3k_rows(2)
    s = {"generator": "hf"}
    with pytest.raises(UserError, match="2 rows carry images, but the model .* reads text only"):
        generation.check_generator_reads(rows, s, {"file": "test.parquet"}, tiny_model)
    generation.check_generator_reads(rows, s, {"file": "test.parquet"}, tiny_vl_model)
    generation.check_generator_reads(aime_rows(), s, {"file": "aime.parquet"}, tiny_model)  # text rows: any model
    generation.check_generator_reads(rows, {"generator": "vllm"}, {"file": "test.parquet"}, tiny_model)  # vLLM's call


@pytest.mark.slow  # the tiny VL model: about 5 s of CPU
def test_the_image_tokens_follow_the_pixel_limits_and_the_vision_tokens_are_never_sampled(tiny_vl_model):
    from transformers import AutoProcessor

    from tests.helpers.vl_rows import PRESET_MM
    from tests.helpers.vl_rows import geo3k_rows as fixture_rows

    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    row = fixture_rows("test", 1)[0]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for limits, tokens in ((PRESET_MM, 16), ({"min_pixels": 3136, "max_pixels": 3136}, 4)):
        ids, mm = generation.image_inputs(row, row["prompt"], processor, {"mm_processor_kwargs": limits})
        assert ids.count(pad) == tokens == int(mm["image_grid_thw"].prod()) // 4
    s = {"k": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0, "mm_processor_kwargs": PRESET_MM}
    (texts,) = generation.generate_hf(tiny_vl_model, [row], s)
    assert len(texts) == 4 and not any(t in x for x in texts for t in generation.VISION_TOKENS)
