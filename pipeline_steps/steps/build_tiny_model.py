"""``python -m pipeline_steps build-tiny-model --output DIR``: the local profile's tiny model (see
:mod:`pipeline_steps.local.tiny_model`)."""

from __future__ import annotations

from pipeline_steps import outputs
from pipeline_steps.errors import UserError
from pipeline_steps.local.tiny_model import FIXTURES, FORMAT_WARMUP_STEPS, build


def add_arguments(p):
    p.add_argument("--output", required=True, help="directory for the model (config, safetensors, tokenizer)")
    p.add_argument("--corpus", default=str(FIXTURES), help="directory whose *.jsonl text trains the tokenizer")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--format-warmup-steps",
        type=int,
        default=FORMAT_WARMUP_STEPS,
        help="supervised steps teaching the answer format with random answers (0: random weights)",
    )


def run(args):
    outputs.refuse_overlap(args.output, {"--corpus": args.corpus})
    if args.format_warmup_steps < 0:
        raise UserError(f"--format-warmup-steps {args.format_warmup_steps}: must be >= 0")
    out = build(
        args.output,
        args.corpus,
        args.vocab_size,
        args.hidden_size,
        args.layers,
        args.seed,
        owner="build-tiny-model",
        format_warmup_steps=args.format_warmup_steps,
    )
    return {"path": str(out)}
