"""Step ``evaluate``: k samples per problem, scored by verl's own reward code.

``--model`` is a Hugging Face model directory or a verl checkpoints directory (merged first
with verl's merger through :func:`pipeline_steps.training.checkpoints.materialize`). Each sample is scored
with ``verl.utils.reward_score.default_compute_score`` and the row's ``data_source`` (AIME
rows route to ``math_dapo``), exactly what the training reward uses, and the arithmetic is
in :mod:`pipeline_steps.evaluation.metrics`.

Generators: ``hf`` (default; transformers ``generate`` on CPU, the local backend) and ``vllm``
(for the training image on GPU, run as a RayJob; imported only when asked for, and untested
here: no GPU and no vLLM on this machine). Rows with images (geometry3k) go to vLLM as chat
messages whose ``<image>`` placeholders are the row's images (:func:`chat_messages`), with the
training's pixel limits (``--mm-processor-kwargs``); the ``hf`` generator refuses them: the local
profile does not evaluate a vision-language model yet.

With ``--base-model`` the base model is scored too and the output reports the gain. Its
results are cached in ``--baseline-cache`` under a key made of the model's content hash, the
evaluation set's hash and the sampling settings, so a base model is scored once per revision.

Outputs (atomic, in ``--output``): ``results.json`` (per problem: ground truth, each sample's
extracted answer and correctness, avg@k, pass@k, maj@k; overall; samples actually scored;
base and gain), ``base_results.json`` (with ``--base-model``), ``results.md`` (table) and
``generations.jsonl`` (the raw responses).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import tempfile
from pathlib import Path

from pipeline_steps import atomic, outputs
from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import metrics as eval_metrics

log = logging.getLogger(__name__)

SCORER = "verl.utils.reward_score.default_compute_score"
GEO3K_SOURCE = "hiyouga/geometry3k"  # default_compute_score's key for verl.utils.reward_score.geo3k


def add_arguments(p):
    p.add_argument(
        "--model", required=True, help="Hugging Face model directory or verl checkpoints directory (RUN/checkpoints)"
    )
    p.add_argument(
        "--step", type=int, help="with a checkpoints directory: evaluate global_step_N instead of the latest"
    )
    p.add_argument(
        "--data",
        required=True,
        help="evaluation parquet in verl's schema (prompt, data_source, reward_model.ground_truth)",
    )
    p.add_argument("--output", required=True, help="output directory (results.json, results.md, generations.jsonl)")
    p.add_argument("--k", type=int, default=4, help="samples per problem (>= 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-problems", type=int, default=0, help="score only the first N problems (0: all)")
    p.add_argument("--name", help="the evaluation set's name in results and reports (default: its data sources)")
    p.add_argument("--base-model", help="also score this base model (HF dir) and report the gain over it")
    p.add_argument(
        "--baseline-cache", help="directory caching base model results by model hash, eval set hash and sampling"
    )
    p.add_argument(
        "--generator", choices=("hf", "vllm"), default="hf", help="hf: transformers on CPU; vllm: GPU (cluster image)"
    )
    p.add_argument("--batch-size", type=int, default=0, help="hf: sequences generated at once (0: k)")
    p.add_argument(
        "--mm-processor-kwargs",
        help='vllm: JSON object for the model\'s multimodal processor, e.g. {"max_pixels": 501760}; the pipeline '
        "passes the preset's data.mm_processor_kwargs so figures are scaled as in training",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vllm: GPUs one model is sharded over (a 32B model does not fit one GPU); the pipeline passes the "
        "evaluation job's GPUs",
    )


# ---------------------------------------------------------------------------------------------
# inputs


def sampling_of(args) -> dict:
    s = {
        "k": args.k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "max_problems": args.max_problems,
        "generator": args.generator,
    }
    if args.generator == "vllm":  # sharding can change vLLM's numerics: part of what is cached
        s["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "mm_processor_kwargs", None):  # the pixel limits change what the model sees: cached too
        s["mm_processor_kwargs"] = _json_object(args.mm_processor_kwargs, "--mm-processor-kwargs")
    return s


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise UserError(f'{what} {text[:80]!r}: not JSON; give an object such as {{"max_pixels": 501760}}') from None
    if not isinstance(value, dict):
        raise UserError(f"{what} {text[:80]!r}: must be a JSON object of processor settings")
    return value


def check_sampling(s: dict) -> None:
    if s["k"] < 1:
        raise UserError(f"--k {s['k']}: must be at least 1 (samples per problem)")
    if s["temperature"] < 0 or not math.isfinite(s["temperature"]):
        raise UserError(f"--temperature {s['temperature']}: must be >= 0 (0 means greedy)")
    if not 0 < s["top_p"] <= 1:
        raise UserError(f"--top-p {s['top_p']}: must be in (0, 1]")
    if s["max_new_tokens"] < 1:
        raise UserError(f"--max-new-tokens {s['max_new_tokens']}: must be at least 1")
    if s.get("tensor_parallel_size", 1) < 1:
        raise UserError(f"--tensor-parallel-size {s['tensor_parallel_size']}: must be at least 1")
    if s["max_problems"] < 0:
        raise UserError(f"--max-problems {s['max_problems']}: must be >= 0")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_eval_set(path: str, max_problems: int = 0, name: str | None = None) -> tuple[list[dict], dict]:
    """Rows of a verl-schema parquet, checked: every row has a prompt, a data_source and a ground truth."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--data {p}: file not found; pass the evaluation parquet written by the preprocess step")
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:
        raise UserError(
            f"--data {p}: not a readable parquet file ({exc.__class__.__name__}); re-run preprocess"
        ) from None
    if not rows:
        raise UserError(f"--data {p}: no rows; the evaluation set is empty")
    for i, r in enumerate(rows):
        gt = (r.get("reward_model") or {}).get("ground_truth") if isinstance(r.get("reward_model"), dict) else None
        if gt is None or str(gt).strip() == "":
            raise UserError(
                f"--data {p}: row {i} has no reward_model.ground_truth; an evaluation set needs an answer for every "
                "problem"
            )
        if not r.get("data_source"):
            raise UserError(f"--data {p}: row {i} has no data_source; it selects verl's scorer (for AIME: aime2024)")
        prompt = r.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)):
            raise UserError(f"--data {p}: row {i} prompt is not a list of chat messages (role, content)")
    sources = sorted({str(r["data_source"]) for r in rows})
    info = {
        "path": str(p.resolve()),
        "sha256": file_sha256(p),
        "rows": len(rows),
        "name": name or "+".join(sources),  # the synthetic arithmetic set is scored as openai/gsm8k
        "file": p.name,
    }
    if max_problems:
        rows = rows[:max_problems]
    return rows, info


# ---------------------------------------------------------------------------------------------
# generation


IMAGE_KEY = "images"  # verl's data.image_key default, the column the geometry3k preprocessor writes
PLACEHOLDER = "<image>"  # one per image, in order (verl's RLHFDataset._build_messages)


def row_images(row: dict) -> list[bytes]:
    return [img["bytes"] for img in row.get(IMAGE_KEY) or [] if isinstance(img, dict) and img.get("bytes")]


def chat_messages(row: dict) -> list[dict]:
    """The row's prompt as chat messages for vLLM: each ``<image>`` placeholder becomes the row's next image as an
    OpenAI-style ``image_url`` part (a data URI), the text around it ``text`` parts, as verl's dataset splits them for
    training. A row without images keeps its plain string contents."""
    images = row_images(row)
    if not images:
        return row["prompt"]
    import base64
    import io

    from PIL import Image

    out, used = [], 0
    for message in row["prompt"]:
        content = message["content"]
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(message)
            continue
        parts = []
        for piece in [x for x in re.split(f"({re.escape(PLACEHOLDER)})", content) if x]:
            if piece != PLACEHOLDER:
                parts.append({"type": "text", "text": piece})
                continue
            if used >= len(images):
                raise UserError(
                    f"evaluation row {row.get('extra_info', {}).get('index')}: more {PLACEHOLDER} than images"
                )
            data = images[used]
            with Image.open(io.BytesIO(data)) as im:
                mime = Image.MIME.get(im.format or "", "image/png")
            url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
            used += 1
        out.append({**message, "content": parts})
    if used != len(images):
        raise UserError(
            f"evaluation row {row.get('extra_info', {}).get('index')}: {len(images)} images, {used} {PLACEHOLDER}"
        )
    return out


def check_generator_reads(rows: list[dict], s: dict, eval_info: dict) -> None:
    """Image rows need a generator that passes images (vLLM on the cluster): refused before any model is loaded."""
    with_images = sum(bool(row_images(r)) for r in rows)
    if with_images and s["generator"] != "vllm":
        raise UserError(
            f"--data {eval_info['file']}: {with_images} rows carry images; the {s['generator']} generator (CPU, the "
            "local profile) does not evaluate a vision-language model yet: use --generator vllm (the cluster)"
        )


def generate_hf(model_dir: Path, prompts: list[list[dict]], s: dict, batch_size: int = 0) -> list[list[str]]:
    """k completions per prompt with transformers on CPU; seeded per problem so results do not depend on batching."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    k = s["k"]
    bs = batch_size or k
    sample = s["temperature"] > 0
    out: list[list[str]] = []
    for i, messages in enumerate(prompts):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        n_prompt = ids["input_ids"].shape[-1]
        texts: list[str] = []
        set_seed(s["seed"] * 1_000_003 + i)
        while len(texts) < k:
            n = min(bs, k - len(texts)) if sample else 1  # greedy: one decode, the k samples are copies
            kwargs = dict(max_new_tokens=s["max_new_tokens"], num_return_sequences=n, pad_token_id=tok.pad_token_id)
            if sample:
                kwargs.update(do_sample=True, temperature=s["temperature"], top_p=s["top_p"], top_k=0)
            else:
                kwargs.update(do_sample=False)
            with torch.no_grad():
                gen = model.generate(**ids, **kwargs)
            texts += tok.batch_decode(gen[:, n_prompt:], skip_special_tokens=True)
            if not sample:
                texts = texts * k
        out.append(texts[:k])
        log.info("problem %d/%d: %d samples", i + 1, len(prompts), len(texts))
    return out


def generate_vllm(model_dir: Path, prompts: list[list[dict]], s: dict, batch_size: int = 0) -> list[list[str]]:
    """GPU generation with vLLM inside the training image. Untested here (no GPU, no vLLM)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise UserError(
            "--generator vllm: vLLM is not installed here; use the training image on GPU, or --generator hf"
        ) from None
    engine = {"mm_processor_kwargs": s["mm_processor_kwargs"]} if s.get("mm_processor_kwargs") else {}
    most = max((_image_parts(conversation) for conversation in prompts), default=0)
    if most > 1:  # vLLM's V0 engine allowed one image per prompt unless told
        engine["limit_mm_per_prompt"] = {"image": most}
    llm = LLM(model=str(model_dir), seed=s["seed"], tensor_parallel_size=s.get("tensor_parallel_size", 1), **engine)
    params = SamplingParams(
        n=s["k"], temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_new_tokens"], seed=s["seed"]
    )
    outs = llm.chat(prompts, params, add_generation_prompt=True)
    return [[c.text for c in o.outputs] for o in outs]


def _image_parts(conversation: list[dict]) -> int:
    parts = [p for m in conversation if isinstance(m.get("content"), list) for p in m["content"]]
    return sum(isinstance(p, dict) and p.get("type") == "image_url" for p in parts)


GENERATORS = {"hf": generate_hf, "vllm": generate_vllm}


# ---------------------------------------------------------------------------------------------
# scoring


def score_sample(data_source: str, response: str, ground_truth: str, extra_info=None) -> dict:
    """verl's reward for one sample -> {"answer", "correct", "score"}."""
    from verl.utils.reward_score import default_compute_score

    try:
        res = default_compute_score(data_source, response, ground_truth, extra_info=extra_info)
    except NotImplementedError:
        raise UserError(
            f"data_source {data_source!r} has no reward function in verl's default_compute_score; "
            "set the eval set's data_source to one verl knows (AIME: aime2024)"
        ) from None
    if isinstance(res, dict):  # math_dapo: {"score": +-1, "acc": bool, "pred": str}
        answer = res.get("pred")
        correct = bool(res.get("acc", res.get("score", 0) > 0))
        return {
            "answer": None if answer in eval_metrics.INVALID else answer,
            "correct": correct,
            "score": float(res.get("score", 0)),
        }
    if data_source == GEO3K_SOURCE:  # 0.9 x accuracy + 0.1 x format: a well-formed wrong answer scores 0.1
        from mathruler.grader import extract_boxed_content
        from verl.utils.reward_score import geo3k

        answer = extract_boxed_content(response)
        return {
            "answer": None if answer in ("None", "") else answer.strip(),
            "correct": geo3k.acc_reward(response, ground_truth) > 0,
            "score": float(res),
        }
    answer = None
    if data_source == "openai/gsm8k":  # a bare score; verl's own GSM8K extractor gives the answer maj@k votes on
        from verl.utils.reward_score.gsm8k import extract_solution

        answer = extract_solution(response)
    return {"answer": answer, "correct": float(res) > 0, "score": float(res)}


def score(rows: list[dict], generations: list[list[str]]) -> dict:
    problems = []
    for i, (row, texts) in enumerate(zip(rows, generations)):
        gt = str(row["reward_model"]["ground_truth"])
        extra = row.get("extra_info") or {}
        samples = [score_sample(row["data_source"], t, gt, extra) for t in texts]
        pid = str(extra.get("id", extra.get("index", i)))
        problems.append(eval_metrics.problem_record(pid, extra.get("index", i), row["data_source"], gt, samples))
    return eval_metrics.results_of(problems)


# ---------------------------------------------------------------------------------------------
# one model, with cache


def cache_key(model_sha: str, eval_sha: str, s: dict) -> str:
    blob = json.dumps({"model": model_sha, "eval": eval_sha, "sampling": s, "scorer": SCORER}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def evaluate_model(
    model: str, rows, eval_info, s, work: Path, step=None, cache_dir=None, batch_size=0
) -> tuple[dict, list]:
    """Score one model (HF dir or checkpoints dir). Returns (results, generations); cached when cache_dir is set."""
    from pipeline_steps.training.checkpoints import dir_sha256, materialize

    m = materialize(model, work, step)
    model_sha = dir_sha256(m["path"])
    key = cache_key(model_sha, eval_info["sha256"], s)
    cached = Path(cache_dir) / f"{key}.json" if cache_dir else None
    if cached and cached.is_file():
        log.info("base model results from cache %s", cached)
        res = json.loads(cached.read_text(encoding="utf-8"))
        res["overall"].setdefault("answers", eval_metrics.figures_of(res))  # cached before the figures existed
        return res, []
    prompts = [chat_messages(r) for r in rows] if s["generator"] == "vllm" else [r["prompt"] for r in rows]
    gens = GENERATORS[s["generator"]](Path(m["path"]), prompts, s, batch_size)
    res = score(rows, gens)
    res.update(
        {
            "model": {"path": str(model), "source": m["source"], "step": m["step"], "content_sha256": model_sha},
            "eval_set": eval_info,
            "sampling": s,
            "scorer": SCORER,
            "key": key,
            "verl_version": _verl_version(),
        }
    )
    if cached:
        atomic.write_json(cached, res)
    return res, gens


def _verl_version() -> str:
    from importlib.metadata import version

    return version("verl")


def markdown(res: dict, base: dict | None) -> str:
    """``results.md``: rendered (every id, answer and name escaped) by :mod:`pipeline_steps.evaluation.results_page`."""
    from pipeline_steps.evaluation import results_page

    return results_page.render(res, base)


def run(args) -> dict:
    s = sampling_of(args)
    check_sampling(s)
    if args.batch_size < 0:
        raise UserError(f"--batch-size {args.batch_size}: must be >= 0")
    out = Path(args.output)
    outputs.refuse_overlap(
        out,
        {
            "--model": args.model,
            "--data": args.data,
            "--base-model": args.base_model,
            "--baseline-cache": args.baseline_cache,
        },
    )
    outputs.check_reusable(out, "evaluate")
    rows, eval_info = load_eval_set(args.data, args.max_problems, args.name)
    check_generator_reads(rows, s, eval_info)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-work.", dir=out.parent))  # merged checkpoints, removed below
    try:
        res, gens = evaluate_model(args.model, rows, eval_info, s, work, args.step, None, args.batch_size)
        base = None
        if args.base_model:
            base, _ = evaluate_model(
                args.base_model, rows, eval_info, s, work, None, args.baseline_cache, args.batch_size
            )
            res["base"] = {"model": base["model"], "overall": base["overall"]}
            res["gain"] = {m: res["overall"][m] - base["overall"][m] for m in ("avg@k", "maj@k")}
            res["gain"]["pass@k"] = {
                j: res["overall"]["pass@k"][j] - base["overall"]["pass@k"][j] for j in res["overall"]["pass@k"]
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with atomic.atomic_dir(out, owner="evaluate") as tmp:
        atomic.write_json(tmp / "results.json", res)
        if base is not None:
            atomic.write_json(tmp / "base_results.json", base)
        atomic.write_text(tmp / "results.md", markdown(res, base))
        with open(tmp / "generations.jsonl", "w", encoding="utf-8") as f:
            for p, texts in zip(res["problems"], gens):
                f.write(json.dumps({"id": p["id"], "responses": texts}, ensure_ascii=False) + "\n")
    o = res["overall"]
    return {
        "output": str(out),
        "results": str(out / "results.json"),
        "base_results": str(out / "base_results.json") if base is not None else None,
        "problems": o["problems"],
        "k": o["k"],
        "samples_scored": o["samples_scored"],
        "avg@k": o["avg@k"],
        "pass@k": o["pass@k"],
        "maj@k": o["maj@k"],
        "gain_avg@k": (res.get("gain") or {}).get("avg@k"),
    }
