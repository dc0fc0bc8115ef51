"""`make demo-tools`: a tool-using policy that learns on CPU, against a control without the tool.

Two runs of the ``local_tool_learning`` preset through the real ``train-local`` step (verl's ToolAgentLoop, the code
tool on the local sandbox server, verl's GSM8K reward), from the same tiny tool model on the same rows, side by side:

* tool: the preset as it is;
* control: the same with the tool removed (``multi_turn.tool_config_path=null``: no schema in the prompt, and a call
  gets verl's "Unknown function" answer).

Prints, per run, the tool-call rate (share of trajectories that call a tool), the tool success rate (calls whose
answer is the question's product) and the mean reward of the first and last steps, and the wall time; writes the
per-step figures (``tool_learning.json``) and a plot (``tool_learning.png``) into the output directory. Needs root (the
sandbox server) unless ``E2B_*`` points at an E2B service.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline_steps import settings

ROOT = Path(__file__).resolve().parents[1]
PRESET = "local_tool_learning"
K = 4  # steps averaged at each end of a run
CONTROL = ["actor_rollout_ref.rollout.multi_turn.tool_config_path=null"]


def write_rows(path: Path, train_rows: int = 512) -> Path:
    """The ``multiply`` train split as the preprocess step's ``tool_agent`` variant shapes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline_steps.data.preprocessors import gsm8k
    from pipeline_steps.data.preprocessors.common import tool_agent_rows
    from pipeline_steps.local import synthetic

    train, _ = synthetic.multiply_splits(train_rows)
    rows = [gsm8k.convert_row(synthetic.multiply_row(p), "train", i, gsm8k.DATA_SOURCE) for i, p in enumerate(train)]
    pq.write_table(pa.Table.from_pylist(tool_agent_rows(rows, gsm8k.TOOL_NAME)), path)
    return path


def per_step(run_dir: Path) -> list[dict]:
    """Per step: tool-call rate (trajectories with a call), tool success rate (calls whose answer is the question's
    product: the call computed what was asked; from the step's trajectories in ``rollouts/``), reward (mean score)."""
    from pipeline_steps.local import grpo_cpu

    out = []
    for row in grpo_cpu.read_metrics(run_dir / "metrics.jsonl"):
        m = row["data"]
        calls = right = 0
        trajectories = run_dir / "rollouts" / f"{row['step']}.jsonl"
        for line in trajectories.read_text().splitlines() if trajectories.exists() else []:
            t = json.loads(line)
            for answer in t.get("tool_outputs") or []:
                calls += 1
                right += answer["text"].strip() == str(t["gts"]).strip()
        out.append(
            {
                "step": row["step"],
                "tool_call_rate": m.get("tool/call_rate", 0.0),
                "tool_success_rate": right / calls if calls else 0.0,
                "tool_calls": calls,
                "tool_errors": m.get("tool/errors", 0.0),
                "reward": m["critic/score/mean"],
            }
        )
    return out


def ends(steps: list[dict], key: str, k: int = K) -> tuple[float, float]:
    values = [s[key] for s in steps]
    k = min(k, len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(
        axes,
        ("tool_call_rate", "tool_success_rate", "reward"),
        ("tool-call rate", "tool success rate (calls that computed the product)", "mean reward"),
    ):
        for name, r in runs.items():
            ax.plot([s["step"] for s in r["steps"]], [s[key] for s in r["steps"]], marker=".", label=name)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(out: Path, model: Path | None = None, overrides: list[str] = (), control: bool = True) -> dict:
    """Train the tool run and (``control``) the control side by side into ``out``; the figures, also written to
    ``out/tool_learning.json``."""
    from pipeline_steps import settings
    from pipeline_steps.local import tiny_tool_model

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    model = model or tiny_tool_model.build_cached(settings.cache_dir(), out)
    built = time.monotonic() - start
    train = write_rows(out / "multiply-train.parquet")
    env = dict(os.environ)
    # one thread per trainer: two trainers and the sandboxes share the cores, and torch's threads spin-wait when
    # oversubscribed (measured here: a warm-up step 6x slower with two threads on a loaded 2-core machine)
    env.setdefault("OMP_NUM_THREADS", "1")
    names = {"tool": [], "control": CONTROL} if control else {"tool": []}
    procs = {}
    for name, extra in names.items():
        cmd = [sys.executable, "-m", "pipeline_steps", "train-local", "--experiment", PRESET]
        cmd += ["--train-files", str(train), "--model-path", str(model), "--output-dir", str(out / name)]
        for o in [*overrides, *extra]:
            cmd += ["--override", o]
        log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs[name] = (proc, log, time.monotonic())
    ended: dict[str, float] = {}
    while len(ended) < len(procs):  # each run's own wall time
        for name, (proc, _, _) in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.monotonic()
        time.sleep(0.5)
    runs = {}
    for name, (proc, log, t0) in procs.items():
        rc = proc.wait()
        log.close()
        if rc != 0:
            tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
            what = f"the {name} run failed (exit {rc}); its log {out / f'{name}.log'} ends:"
            raise SystemExit("\n".join([what, *tail]))
        runs[name] = {"steps": per_step(out / name), "wall_s": ended[name] - t0}
    result = {
        "preset": PRESET,
        "k": K,
        "model": str(model),
        "build_s": built,
        "wall_s": time.monotonic() - start,
        "runs": runs,
        "ends": {
            name: {key: ends(r["steps"], key) for key in ("tool_call_rate", "tool_success_rate", "reward")}
            for name, r in runs.items()
        },
    }
    (out / "tool_learning.json").write_text(json.dumps(result, indent=1))
    _plot(runs, out / "tool_learning.png")
    return result


def report(result: dict, out: Path) -> str:
    lines = []
    for name, e in result["ends"].items():
        r = result["runs"][name]
        n = len(r["steps"])
        lines.append(
            f"{name:8s} {n} GRPO steps, {r['wall_s']:.0f} s: steps 1-{K} -> {n - K + 1}-{n}: "
            f"tool-call rate {e['tool_call_rate'][0]:.2f} -> {e['tool_call_rate'][1]:.2f}, "
            f"tool success rate {e['tool_success_rate'][0]:.2f} -> {e['tool_success_rate'][1]:.2f}, "
            f"reward {e['reward'][0]:.3f} -> {e['reward'][1]:.3f}"
        )
    lines.append(f"wall time {result['wall_s']:.0f} s (model build {result['build_s']:.0f} s)")
    lines.append(f"per step: {out / 'tool_learning.json'}; plot: {out / 'tool_learning.png'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(settings.home() / "tool-learning"))
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for both runs")
    args = p.parse_args(argv)
    out = Path(args.out) / time.strftime("%Y%m%dT%H%M%S")
    result = run(out, overrides=args.override)
    print(report(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
