"""Step ``evaluate``: k samples per problem, scored by verl's own reward code.

``--model`` is a Hugging Face model directory or a verl checkpoints directory (merged first with verl's merger
through :func:`pipeline_steps.training.checkpoints.materialize`). The engine is the library's: the evaluation set
(:mod:`pipeline_steps.evaluation.eval_set`), the generators (:mod:`~pipeline_steps.evaluation.generation`: ``hf``
on CPU, images included for a vision-language model; ``vllm`` on GPU), scoring by data source with
``verl.utils.reward_score.default_compute_score`` (:mod:`~pipeline_steps.evaluation.scoring`), the base model's
cache and the outputs (:mod:`~pipeline_steps.evaluation.eval_run`: ``results.json``, ``base_results.json``,
``results.md``, ``generations.jsonl``, ``figures/``). This step parses its arguments and calls them.

With ``--base-model`` the base model is scored too (cached in ``--baseline-cache`` per model content, evaluation
set and sampling) and the output reports the gain.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pipeline_steps import outputs
from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import eval_run, eval_set, generation


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
        help='JSON object for the model\'s multimodal processor, e.g. {"max_pixels": 501760} (hf and vllm); the '
        "pipeline passes the preset's data.mm_processor_kwargs so figures are scaled as in training",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vllm: GPUs one model is sharded over (a 32B model does not fit one GPU); the pipeline passes the "
        "evaluation job's GPUs",
    )


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


def _materialized(model: str, work: Path, step=None) -> tuple[dict, str]:
    """The model as a Hugging Face directory (a checkpoints directory merged into ``work``) and its content hash."""
    from pipeline_steps.training.checkpoints import dir_sha256, materialize

    m = materialize(model, work, step)
    return {"path": model, "dir": m["path"], "source": m["source"], "step": m["step"]}, dir_sha256(m["path"])


def run(args) -> dict:
    s = sampling_of(args)
    generation.check_sampling(s)
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
    rows, eval_info = eval_set.load_eval_set(args.data, args.max_problems, args.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-work.", dir=out.parent))  # merged checkpoints, removed below
    try:
        model, sha = _materialized(args.model, work, args.step)
        base_model = _materialized(args.base_model, work) if args.base_model else None
        for m in [model] + ([base_model[0]] if base_model else []):  # before any weights are loaded
            generation.check_generator_reads(rows, s, eval_info, m["dir"])
        res, gens = eval_run.evaluate_model(model, sha, rows, eval_info, s, None, args.batch_size)
        base = None
        if base_model:
            base, _ = eval_run.evaluate_model(*base_model, rows, eval_info, s, args.baseline_cache, args.batch_size)
            eval_run.add_base(res, base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    eval_run.write_outputs(out, res, base, gens, rows)
    return eval_run.summary(out, res, base)
