"""``python -m pipeline_steps <step> ...``: one entry point for every step.

Each step module exposes ``add_arguments(parser)`` and ``run(args) -> dict``.
Modules are imported lazily so that ``--help`` and cheap steps stay fast.

Exit codes: 0 success, 2 bad input or usage (one line on stderr), 1 anything unexpected.
The last stdout line is always a one-line JSON summary (``{"ok": false, ...}`` on failure).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import traceback

from pipeline_steps import settings
from pipeline_steps.errors import TransientError, UserError, disk_full

# step name -> (module, one-line help)
STEPS: dict[str, tuple[str, str]] = {
    "download": ("pipeline_steps.steps.download", "download a Hugging Face dataset snapshot at a pinned revision"),
    "preprocess": ("pipeline_steps.steps.preprocess", "turn a dataset snapshot into verl's parquet row schema"),
    "resolve-revision": ("pipeline_steps.steps.resolve_revision", "resolve a dataset's revision as of a date"),
    "upload": ("pipeline_steps.steps.upload", "upload a directory to object storage as a manifest-committed version"),
    "stage-model": ("pipeline_steps.steps.stage_model", "stage model weights at a pinned revision into the store"),
    "build-tiny-model": ("pipeline_steps.steps.build_tiny_model", "build the tiny local Qwen2-architecture model"),
    "preflight": ("pipeline_steps.steps.preflight", "validate an experiment's verl config on CPU"),
    "render-rayjob": ("pipeline_steps.steps.render_rayjob", "render the KubeRay RayJob for an experiment"),
    "train-local": ("pipeline_steps.steps.train_local", "train GRPO on CPU on a local Ray cluster"),
    "evaluate": ("pipeline_steps.steps.evaluate", "score a model or checkpoint on an evaluation set"),
    "export": ("pipeline_steps.steps.export", "merge a checkpoint into a Hugging Face model, card, upload, promote"),
    "report": ("pipeline_steps.steps.report", "write the run report"),
    "sandbox-server": ("pipeline_steps.steps.sandbox_server", "serve local E2B-compatible code sandboxes"),
    "doctor": ("pipeline_steps.steps.doctor", "check a cluster for what the pipeline needs before a GPU is requested"),
}

log = logging.getLogger("pipeline_steps")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line, exit 2, JSON summary last
        raise UserError(f"{self.prog}: {message} (see --help)")


def _emit(summary: dict) -> None:
    sys.stdout.write(json.dumps(summary, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _disk_full_error(exc: OSError) -> TransientError:
    return TransientError(f"disk full ({exc.strerror}) writing {exc.filename or 'a file'}; free space and retry")


def _transient(step, exc: TransientError) -> int:
    msg = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
    sys.stderr.write(f"error (transient, exit 1: retried): {msg}\n")
    _emit({"ok": False, "step": step, "error": msg, "transient": True})
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=settings.get(settings.LOG_LEVEL),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    step = argv[0] if argv else None
    try:
        if step in (None, "-h", "--help"):
            lines = [f"  {name:18s} {help_}" for name, (_, help_) in STEPS.items()]
            sys.stderr.write("usage: python -m pipeline_steps <step> [options]\n\nsteps:\n" + "\n".join(lines) + "\n")
            return 0 if step else 2
        if step not in STEPS:
            raise UserError(f"unknown step {step!r}; choose one of: {', '.join(STEPS)}")
        module_name, help_ = STEPS[step]
        module = importlib.import_module(module_name)
        parser = _Parser(prog=f"python -m pipeline_steps {step}", description=help_)
        module.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        summary = module.run(args)
        _emit({"ok": True, "step": step, **summary})
        return 0
    except UserError as exc:
        if disk_full(exc):  # a full disk is never the input's fault, whatever the code that met it said
            return _transient(step, _disk_full_error(disk_full(exc)))
        msg = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        sys.stderr.write(f"error: {msg}\n")
        _emit({"ok": False, "step": step, "error": msg})
        return 2
    except SystemExit as exc:  # --help from argparse
        return int(exc.code or 0)
    except KeyboardInterrupt:
        _emit({"ok": False, "step": step, "error": "interrupted"})
        return 130
    except Exception as exc:  # transient (retried) or unexpected: one line, traceback only in the log on request
        if disk_full(exc):
            exc = _disk_full_error(disk_full(exc))
        if isinstance(exc, TransientError):
            return _transient(step, exc)
        msg = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
        if settings.get(settings.DEBUG):
            traceback.print_exc()
        sys.stderr.write(f"unexpected error in step {step!r}: {msg} (set PIPELINE_DEBUG=1 for the traceback)\n")
        _emit({"ok": False, "step": step, "error": msg})
        return 1
