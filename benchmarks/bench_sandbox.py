"""The local E2B-compatible sandbox server through the pinned E2B SDK (async client, as the code tool uses it).

create latency  ``AsyncSandbox.create`` p50/p99, with the warm pool (``--warm 8``) and without it (``--warm 0``,
                the baseline: every create starts and confines an interpreter); one create every 0.2 s, killed
                after use, so the pool has the gaps a rollout leaves between tool calls to refill
run_code        calls per second at 1, 8 and 32 sandboxes used concurrently (``sum(range(10_000))`` each call)
memory          resident memory of each sandbox's processes with 32 sandboxes alive (the interpreter after a call)
rollout         per multi-turn rollout of the CPU trainer (tiny model, ``local_tiny_tool_agent``, verl's ToolAgentLoop,
                the code tool on this server): seconds verl's loop spent generating against seconds in tool calls,
                as the trainer logs them (``timing_s/agent_loop/{generate_sequences,tool_calls}/mean``); the first
                assistant turn is scripted as a tool call (``ScriptedFirstTurn`` of
                pipeline_steps/local/scripted_tool_turns.py), as a randomly initialised model writes none; the 8
                rollouts of a step run concurrently, as on the cluster, so both figures are wall time and include
                waiting for the others' turns on the CPU

  .venv/bin/python -m benchmarks.bench_sandbox [--creates N] [--seconds S]   (or: make bench BENCH=sandbox)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _create_latencies(opts: dict, n: int) -> list[float]:
    from e2b_code_interpreter import AsyncSandbox

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(**opts)
        out.append(time.perf_counter() - t0)
        await sb.kill()
        await asyncio.sleep(0.2)
    return out


async def _throughput(opts: dict, concurrency: int, seconds: float) -> tuple[float, float]:
    from e2b_code_interpreter import AsyncSandbox

    sandboxes = await asyncio.gather(*[AsyncSandbox.create(**opts) for _ in range(concurrency)])
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker(sb):
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            ex = await sb.run_code("sum(range(10_000))")
            assert ex.error is None and ex.results[0].text == "49995000", ex
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(sb) for sb in sandboxes])
    rate = len(latencies) / (time.perf_counter() - t0)
    await asyncio.gather(*[sb.kill() for sb in sandboxes])
    return rate, statistics.median(latencies)


def _rss_by_uid(uids: set[int]) -> dict[int, int]:
    rss: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
            uid = int(status["Uid"].split()[0])
            if uid in uids and "VmRSS" in status:
                rss[uid] = rss.get(uid, 0) + int(status["VmRSS"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            pass
    return rss


async def _memory(opts: dict, n: int) -> float:
    from e2b_code_interpreter import AsyncSandbox

    sandboxes = await asyncio.gather(*[AsyncSandbox.create(**opts) for _ in range(n)])
    uids = await asyncio.gather(*[sb.run_code("import os; os.getuid()") for sb in sandboxes])
    rss = _rss_by_uid({int(u.results[0].text) for u in uids})
    await asyncio.gather(*[sb.kill() for sb in sandboxes])
    return statistics.median(rss.values()) / 2**20 if rss else float("nan")


def _rollout_timings(tmp: Path, steps: int) -> list[dict]:
    """The trainer's per-step agent-loop timings for ``steps`` GRPO steps of 2 prompts x 4 samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline_steps.local import agent_rollout, grpo_cpu, tiny_model
    from pipeline_steps.local.scripted_tool_turns import ScriptedFirstTurn, code_tool_rows
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    model = tiny_model.build(tmp / "model", format_warmup_steps=0)
    train = tmp / "train.parquet"
    pq.write_table(pa.Table.from_pylist(code_tool_rows(2)), train)
    out = tmp / "run"
    overrides = [f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "actor_rollout_ref.rollout.n=4"]
    derived = train_local.derived_keys([train], [], model, out)
    cfg = experiment.compose(experiment.load("local_tiny_tool_agent", overrides, derived=derived))
    default = agent_rollout._default_server
    agent_rollout._default_server = lambda *a: ScriptedFirstTurn(default(*a))
    try:
        with grpo_cpu.process_group(), agent_rollout.local_sandbox(cfg, hide=[str(out)]):
            grpo_cpu.GRPOTrainer(cfg, reward_fn=lambda *a, **k: 0.0, metrics_path=out / "metrics.jsonl").fit()
    finally:
        agent_rollout._default_server = default
    return [line["data"] for line in grpo_cpu.read_metrics(out / "metrics.jsonl")]


def main(argv: list[str] | None = None) -> int:
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps of the multi-turn rollout timing")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_sandbox: the sandbox server needs root (per-sandbox uids and namespaces)")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        for warm in (0, 8):
            args_ = ["--warm", str(warm), "--max-sandboxes", "48"]
            with LocalSandboxServer(Path(tmp) / f"state-{warm}", args=args_) as srv:
                time.sleep(2)  # let the pool fill before the first create
                lat = asyncio.run(_create_latencies(srv.sdk_options(), args.creates))
                rows.append((warm, _pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3))
                if warm:
                    tput = {c: asyncio.run(_throughput(srv.sdk_options(), c, args.seconds)) for c in (1, 8, 32)}
                    mem = asyncio.run(_memory(srv.sdk_options(), 32))
        for key in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL"):
            os.environ.pop(key, None)  # the trainer starts its own local server, as a local run does
        steps = _rollout_timings(Path(tmp) / "rollout", args.steps)

    print("| sandbox create | p50 | p99 |\n| --- | --- | --- |")
    for warm, p50, p99 in rows:
        print(f"| {'warm pool of ' + str(warm) if warm else 'no warm pool (baseline)'} | {p50:.1f} ms | {p99:.1f} ms |")
    print("\n| concurrent sandboxes | run_code calls/s | median call |\n| --- | --- | --- |")
    for c, (rate, med) in tput.items():
        print(f"| {c} | {rate:.0f} | {med * 1e3:.1f} ms |")
    print(f"\nresident memory per sandbox (32 alive, after one call): {mem:.1f} MiB")
    print("\n| step | generating, s per rollout | in tools, s per rollout | tools / generating | step, s |")
    print("| --- | --- | --- | --- | --- |")
    for i, m in enumerate(steps, 1):
        gen, tool = m["timing_s/agent_loop/generate_sequences/mean"], m["timing_s/agent_loop/tool_calls/mean"]
        ratio = tool / gen if gen else float("nan")
        print(f"| {i} | {gen:.3f} | {tool:.3f} | {ratio:.2f} | {m['timing_s/step']:.2f} |")
    print(f"(cores: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
