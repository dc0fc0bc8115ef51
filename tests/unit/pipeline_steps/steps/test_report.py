"""The run report: plots, numbers, lineage and links from a run directory; missing or broken inputs never crash it.

The run directory is built with the real writers where they are cheap: metrics lines by verl's own
``FileLogger`` (the writer both backends use), evaluation results by :func:`pipeline_steps.evaluation.scoring.score`
(verl's reward code on crafted generations). The lineage file is crafted in the shape
:mod:`pipeline_steps.planning.plan` writes. Expected figures are computed from those inputs in the test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.steps import report
from tests.helpers.step_cli import run_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEYS = ("critic/score/mean", "actor/entropy", "response_length/mean", "perf/throughput", "timing_s/step")


def args(run_dir, **kw) -> argparse.Namespace:
    base = {"run_dir": str(run_dir), "output": None, "dashboard_url": "", "exported_uri": "", "task_states": ""}
    return argparse.Namespace(**{**base, **kw})


def write_metrics(path: Path, steps: int, seed: int = 0, drop: tuple[str, ...] = ()) -> dict[int, dict]:
    """Metric lines through verl's FileLogger; returns what was logged."""
    from verl.utils.tracking import FileLogger

    rng = random.Random(seed)
    logged = {}
    old = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        logger = FileLogger("p", "e")
        logger.log(data={"val-core/openai/gsm8k/reward/mean@1": rng.random()}, step=0)
        for step in range(1, steps + 1):
            data = {
                "critic/score/mean": rng.uniform(-1, 1),
                "actor/entropy": rng.uniform(3, 6),
                "response_length/mean": rng.uniform(5, 50),
                "perf/throughput": rng.uniform(100, 900),
                "timing_s/step": rng.uniform(0.5, 3),
                "actor/pg_loss": float("nan"),
            }
            data = {k: v for k, v in data.items() if k not in drop}
            logger.log(data=data, step=step)
            logged[step] = data
        logger.finish()
    finally:
        if old is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = old
    return logged


def eval_results(k: int, correct_per_problem: list[int], model: str) -> dict:
    """Results in evaluate's shape, scored by verl's gsm8k reward on crafted generations."""
    from pipeline_steps.evaluation import scoring

    rows, gens = [], []
    for i, c in enumerate(correct_per_problem):
        answer = str(10 + i)
        rows.append(
            {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": answer}, "extra_info": {"index": i}}
        )
        gens.append([f"so #### {answer}"] * c + ["so #### -1"] * (k - c))
    res = scoring.score(rows, gens)
    res.update(
        {
            "model": {"path": model, "step": 3 if "ckpt" in model else None},
            "eval_set": {"name": "gsm8k-test", "sha256": "e" * 64},
            "sampling": {"k": k, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24},
        }
    )
    return res


LINEAGE = {
    "base_model": {"name": "tiny", "revision": "rev-base-0001", "uri": "file:///store/models/tiny/local"},
    "datasets": [
        {
            "name": "gsm8k",
            "role": "train",
            "repo_id": "openai/gsm8k",
            "revision": "a1b2c3d4e5",
            "content_hash": "f" * 64,
            "uri": "file:///store/datasets/gsm8k/a1b2c3d4e5/ffff",
        },
        {"name": "mine", "role": "train", "repo_id": "<img src=x onerror=alert(1)>"},
    ],  # a registry file's text
    "experiment": {
        "name": "local_tiny",
        "preset_sha256": "9" * 64,
        "overrides": ["trainer.total_training_steps=1", "data.note=<b>a|b</b>"],
    },
    "dag_id": "verl_grpo_pipeline",
    "run_id": "manual__2026-01-02",
    "run_uri": "file:///store/runs/local_tiny/r1",
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    logged = write_metrics(run / "metrics.jsonl", steps=6, seed=7)
    (run / "eval").mkdir()
    res = eval_results(4, [4, 2, 0, 1, 3], "/runs/r1/ckpt")
    base = eval_results(4, [1, 2, 0, 0, 1], "/models/tiny")
    (run / "eval" / "results.json").write_text(json.dumps(res))
    (run / "eval" / "base_results.json").write_text(json.dumps(base))
    (run / "lineage.json").write_text(json.dumps(LINEAGE))
    (run / "train_summary.json").write_text(
        json.dumps(
            {
                "last_step": 6,
                "resumed_from_step": 2,
                "experiment": "local_tiny",
                "checkpoint_dir": "/runs/r1/checkpoints/global_step_6",
                "mlflow": {
                    "run_id": "0a1b2c3d",
                    "tracking_uri": "http://u:secret@127.0.0.1:5000",
                    "experiment_id": "1",
                    "url": "http://u:secret@127.0.0.1:5000/#/experiments/1/runs/0a1b2c3d",
                },
            }
        )
    )
    return {"dir": run, "logged": logged, "res": res, "base": base}


def assert_png(path: Path) -> None:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 8_000, f"{path.name}: {len(data)} bytes, suspiciously small"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] >= 400 and im.size[1] >= 200
        assert len(set(im.convert("RGB").getdata())) > 20, f"{path.name} looks blank"


def test_full_report_has_plots_numbers_lineage_and_links(full_run):
    run, logged = full_run["dir"], full_run["logged"]
    out = report.run(
        args(
            run,
            dashboard_url="http://admin:pw@127.0.0.1:8265/#/jobs",
            exported_uri="file:///store/models/exported/x/v1",
        )
    )

    assert out["report"] == str(run / "report" / "report.md")
    names = [Path(p).name for p in out["plots"]]
    assert names == ["reward.png", "entropy.png", "response_length.png", "throughput.png", "step_timing.png"]
    for p in out["plots"]:
        assert_png(Path(p))
    md = Path(out["report"]).read_text()
    for name in names:
        assert f"]({name})" in md

    steps = sorted(logged)
    for key in KEYS:  # first/last/min/max of every curve, computed from what was logged
        ys = [logged[s][key] for s in steps]
        assert f"| {key} | {ys[0]:.4g} | {ys[-1]:.4g} | {min(ys):.4g} | {max(ys):.4g} | {len(ys)} |" in md
    assert out["metrics_steps"] == len(steps) + 1 and out["metrics_skipped_lines"] == 0  # + the step-0 validation line

    o, b = full_run["res"]["overall"], full_run["base"]["overall"]
    k = o["k"]
    avg_row = (
        f"| avg@{k} | {100 * o['avg@k']:.1f}% | {100 * b['avg@k']:.1f}% | {100 * (o['avg@k'] - b['avg@k']):+.1f} pt |"
    )
    maj_row = (
        f"| maj@{k} | {100 * o['maj@k']:.1f}% | {100 * b['maj@k']:.1f}% | {100 * (o['maj@k'] - b['maj@k']):+.1f} pt |"
    )
    assert avg_row in md and maj_row in md
    for j, v in o["pass@k"].items():
        assert f"| pass@{j} | {100 * v:.1f}% | {100 * b['pass@k'][j]:.1f}% |" in md
    up = sum(p["correct"] > q["correct"] for p, q in zip(full_run["res"]["problems"], full_run["base"]["problems"]))
    assert f"{up} problem(s) with more correct samples than the base" in md

    for text in (
        "a1b2c3d4e5",
        "f" * 64,
        "9" * 64,
        "rev-base-0001",
        "openai/gsm8k",
        "manual__2026-01-02",
        "trainer.total_training_steps=1",
    ):
        assert text in md, text
    assert "data.note=<b>a|b</b>" in md  # the override as typed, inside a code span
    assert (
        "<http://127.0.0.1:8265/#/jobs>" in md and "admin" not in md and ":pw@" not in md
    )  # no credentials in the link
    # the MLflow run of the training, linked, without the URL's credentials
    assert "| MLflow run | `0a1b2c3d` (<http://127.0.0.1:5000/#/experiments/1/runs/0a1b2c3d>) |" in md
    assert "secret" not in md
    assert "file:///store/models/exported/x/v1" in md
    assert "not produced" not in md

    page = (run / "report" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(
        names
    )  # reward, entropy, response length, throughput, step timing
    assert "<b>a" not in page and "&lt;b&gt;a" in page  # typed text is escaped, not rendered
    assert "<img src=x" not in page and "&lt;img src=x" in page
    # the page may load nothing but what it carries (tests/e2e/test_inert_outputs.py opens it in Chromium)
    assert "Content-Security-Policy\" content=\"default-src 'none'; img-src data:;" in page
    assert ' style="' not in page and "'unsafe-inline'" not in page  # table alignment is a class, not a style


def test_report_is_atomic_and_a_retry_writes_the_same_bytes(full_run, tmp_path):
    out_dir = tmp_path / "rep"
    report.run(args(full_run["dir"], output=str(out_dir)))
    first = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-rep.{dead.pid}.abcd1234"  # what a writer that crashed mid-write leaves
    stale.mkdir()
    (out_dir / "leftover.txt").write_text("from an older run")
    report.run(args(full_run["dir"], output=str(out_dir)))
    second = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert second == first  # same inputs, same bytes; the old directory was replaced as a whole
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_missing_inputs_say_not_produced(tmp_path):
    out = report.run(args(tmp_path))
    md = Path(out["report"]).read_text()
    assert out["plots"] == []
    for name in ("metrics.jsonl", "eval/results.json", "eval/base_results.json", "lineage.json", "train_summary.json"):
        assert out["inputs"][name] == "not produced"
        assert f"| `{name}` | not produced |" in md
    assert "Ray dashboard: not given" in md and "Exported model: not given" in md
    assert not list((tmp_path / "report").glob("*.png"))


def test_system_curves_are_plotted_when_the_metrics_carry_them(tmp_path):
    """Grad norm, learning rate, MFU, peak memory and step timing: plotted when logged, absent (no line) otherwise."""
    from verl.utils.tracking import FileLogger

    os.environ["VERL_FILE_LOGGER_PATH"] = str(tmp_path / "metrics.jsonl")
    try:
        logger = FileLogger("p", "e")
        for step in range(1, 4):
            logger.log(
                data={
                    "critic/score/mean": step / 10,
                    "actor/grad_norm": 1.0 / step,
                    "actor/lr": 1e-3,
                    "perf/mfu/actor": 0.01 * step,
                    "perf/max_memory_allocated_gb": 10.0 + step,
                    "perf/max_memory_reserved_gb": 12.0 + step,
                    "timing_s/step": 2.0,
                    "timing_s/gen": 1.2,
                    "timing_s/update_actor": 0.7,
                },
                step=step,
            )
        logger.finish()
    finally:
        os.environ.pop("VERL_FILE_LOGGER_PATH", None)
    out = report.run(args(tmp_path))
    names = [Path(p).name for p in out["plots"]]
    assert names == ["reward.png", "grad_norm.png", "lr.png", "mfu.png", "memory.png", "step_timing.png"]
    for p in out["plots"]:
        assert_png(Path(p))
    md = Path(out["report"]).read_text()
    assert "![Peak memory (perf/max_memory_allocated_gb)](memory.png)" in md


def test_malformed_metrics_lines_are_skipped_and_counted(tmp_path):
    logged = write_metrics(tmp_path / "metrics.jsonl", steps=4, seed=3, drop=("perf/throughput",))
    good = (tmp_path / "metrics.jsonl").read_text().splitlines()
    bad = [
        "not json",
        '{"step": 9, "data": [1, 2]}',
        '{"data": {"critic/score/mean": 1}}',
        "[1, 2]",
        '{"step": "two", "data": {}}',
        '{"step": 5, "data": {"critic/score/mean": 0.5',
    ]  # the last one: torn by a crash
    lines = good[:2] + bad[:3] + good[2:] + bad[3:]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    bad_line_numbers = [i + 1 for i, line in enumerate(lines) if line in bad]

    out = report.run(args(tmp_path))
    md = Path(out["report"]).read_text()
    assert out["metrics_skipped_lines"] == len(bad)
    assert f"{len(bad)} malformed line(s) skipped (line {', '.join(map(str, bad_line_numbers))})" in md
    assert [Path(p).name for p in out["plots"]] == [
        "reward.png",
        "entropy.png",
        "response_length.png",
        "step_timing.png",
    ]
    assert "**Throughput (perf/throughput)**: not produced" in md
    rewards = [logged[s]["critic/score/mean"] for s in sorted(logged)]
    assert f"| critic/score/mean | {rewards[0]:.4g} | {rewards[-1]:.4g} |" in md


def test_a_resumed_run_keeps_the_later_line_of_a_repeated_step(tmp_path):
    lines = [
        {"step": 1, "data": {"critic/score/mean": 0.1}},
        {"step": 2, "data": {"critic/score/mean": 0.2}},
        {"step": 2, "data": {"critic/score/mean": 0.25}},
        {"step": 3, "data": {"critic/score/mean": 0.3}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = report.read_metrics(tmp_path / "metrics.jsonl")
    assert report.series(m["steps"], "critic/score/mean") == ([1, 2, 3], [0.1, 0.25, 0.3]) and m["duplicates"] == 1


def test_unreadable_eval_and_lineage_are_reported_not_fatal(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text('{"overall": ')
    (tmp_path / "lineage.json").write_text("[]")
    (tmp_path / "train_summary.json").write_text(json.dumps({"no": "fields"}))
    out = report.run(args(tmp_path))
    md = Path(out["report"]).read_text()
    assert out["inputs"]["eval/results.json"].startswith("unreadable: not JSON")
    assert out["inputs"]["lineage.json"] == "unreadable: top level is not an object"
    assert "`eval/results.json`: unreadable" in md and "`lineage.json`: unreadable" in md
    assert "| last step | not recorded |" in md
    assert "| MLflow run | not tracked |" in md


def test_base_embedded_in_results_is_used_when_base_file_is_missing(full_run, tmp_path):
    res = dict(full_run["res"], base={"model": {"path": "/models/tiny"}, "overall": full_run["base"]["overall"]})
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text(json.dumps(res))
    md = Path(report.run(args(tmp_path))["report"]).read_text()
    o, b = res["overall"], res["base"]["overall"]
    assert f"| avg@{o['k']} | {100 * o['avg@k']:.1f}% | {100 * b['avg@k']:.1f}% |" in md
    assert "the base recorded in `eval/results.json`" in md


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"run_dir": "/definitely/not/here"}, "--run-dir"),
        ({"run_dir": "oss://bucket-x/runs/r1"}, "no OSS region"),  # read from the store: credentials needed
        ({"dashboard_url": "javascript:alert(1)"}, "--dashboard-url"),
        ({"exported_uri": "file:///x\nInjected: yes"}, "--exported-uri"),
    ],
)
def test_bad_arguments_are_one_line_user_errors(tmp_path, kw, needle):
    with pytest.raises(UserError) as err:
        report.run(args(kw.pop("run_dir", tmp_path), **kw))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "report").exists()


def test_cli_writes_report_into_the_run_dir_and_fails_cleanly(full_run, tmp_path):
    rc, summary, _ = run_step("report", "--run-dir", f"file://{full_run['dir']}", "--output", tmp_path / "r", check=0)
    assert summary["ok"] and summary["report"] == str(tmp_path / "r" / "report.md") and len(summary["plots"]) == 5
    rc, summary, stderr = run_step("report", "--run-dir", tmp_path / "missing")
    assert rc == 2 and not summary["ok"]
    assert stderr.strip().splitlines()[-1].startswith("error: --run-dir") and "Traceback" not in stderr


def test_a_run_that_stopped_before_training_is_reported_from_its_task_states(tmp_path):
    """The DAG's report runs after a failed task; its planned run directory may never have been made."""
    run_dir = tmp_path / "runs" / "local_tiny" / "r1"
    states = {"plan": "success", "upload_dataset_0": "failed", "train": "upstream_failed", "export": None}
    rc, summary, err = run_step("report", "--run-dir", run_dir, "--task-states", json.dumps(states), check=0)
    md = Path(summary["report"]).read_text()
    assert Path(summary["report"]).parent == run_dir / "report"
    for row in ("| `upload_dataset_0` | failed |", "| `train` | upstream_failed |", "| `export` | not started |"):
        assert row in md
    assert "| `metrics.jsonl` | not produced |" in md
    # without the task states (a user's own call) a missing directory is still refused in one line
    rc, _, err = run_step("report", "--run-dir", tmp_path / "elsewhere")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --run-dir")
    rc, _, err = run_step("report", "--run-dir", run_dir, "--task-states", "[1]")
    assert rc == 2 and "--task-states" in err.strip().splitlines()[-1]


def test_report_of_a_run_on_an_oss_store_reads_and_writes_the_store(oss_server, tmp_path):
    """Before: report refused anything but local paths, so the always-run report failed on every oss:// run.
    Real OSS client against the OSS test layer; the step runs as the DAG runs it (store credentials in its env)."""
    import alibabacloud_oss_v2 as oss

    local = tmp_path / "run"
    local.mkdir()
    write_metrics(local / "metrics.jsonl", steps=3)
    (local / "lineage.json").write_text(json.dumps({"run_id": "manual__1", "experiment": {"name": "gsm8k"}}))
    client = oss_server.client()
    prefix = "runs/gsm8k/manual__1"
    for f in ("metrics.jsonl", "lineage.json"):
        client.put_object(
            oss.PutObjectRequest(bucket="test-bucket", key=f"{prefix}/{f}", body=(local / f).read_bytes())
        )
    uri = f"oss://test-bucket/{prefix}"
    code, s, err = run_step("report", "--run-dir", uri, env=oss_server.env())
    assert code == 0, err
    assert s["report"] == f"{uri}/report/report.md" and s["inputs"]["metrics.jsonl"] == "ok"
    md = client.get_object(oss.GetObjectRequest(bucket="test-bucket", key=f"{prefix}/report/report.md")).body.read()
    assert uri.encode() in md and b"critic/score/mean" in md
    manifest = client.get_object(oss.GetObjectRequest(bucket="test-bucket", key=f"{prefix}/report/_manifest.json"))
    assert manifest.body.read()  # committed like every version in the store


def test_report_of_an_oss_run_shows_the_clusters_rollout_dump(oss_server):
    """A cluster run's trainer.rollout_data_dir (verl's <step>.jsonl dump, its own keys only) is fetched from the
    store: the report gets its Trajectories section; only the newest REMOTE_ROLLOUT_STEPS files are fetched."""
    import alibabacloud_oss_v2 as oss

    from pipeline_steps.steps.report import REMOTE_ROLLOUT_STEPS

    client = oss_server.client()
    prefix = "runs/retool/manual__2"

    def put(key, body: bytes):
        client.put_object(oss.PutObjectRequest(bucket="test-bucket", key=f"{prefix}/{key}", body=body))

    put("lineage.json", json.dumps({"run_id": "manual__2"}).encode())
    last = REMOTE_ROLLOUT_STEPS + 1
    for step in range(1, last + 1):  # numeric order decides the newest (10 sorts before 9 as text)
        row = {"input": "What is 6*7?", "output": f"step {step} says \\boxed{{42}}", "gts": "42", "score": 1.0}
        put(f"rollouts/{step}.jsonl", (json.dumps({**row, "step": step}) + "\n").encode())
    put("rollouts/notes.txt", b"not a step file")
    uri = f"oss://test-bucket/{prefix}"
    code, s, err = run_step("report", "--run-dir", uri, env=oss_server.env())
    assert code == 0, err
    assert s["inputs"]["rollouts/"] == f"ok ({REMOTE_ROLLOUT_STEPS} steps)", s["inputs"]
    md = client.get_object(oss.GetObjectRequest(bucket="test-bucket", key=f"{prefix}/report/report.md")).body.read()
    md = md.decode()
    assert "## Trajectories" in md and f"step {last} says" in md
    table = md.split("## Trajectories")[1]
    shown = [
        int(line.split("|")[1])
        for line in table.splitlines()
        if line.split("|")[1:2] != [] and line.split("|")[1].strip().isdigit()
    ]
    assert shown == list(range(2, last + 1)), shown  # the newest, in step order; step 1 was not fetched


def test_a_cluster_shaped_metrics_file_shows_its_validation_curve(tmp_path):
    """verl's naive reward manager makes ``acc`` the headline: ``val-core/<source>/acc/mean@N`` (reward under
    ``val-aux``). Key names as verl's v1 trainer writes them (tests/unit/pipeline_steps/local/test_trainer_parity.py
    checks the CPU trainer writes the same)."""
    from verl.utils.tracking import FileLogger

    run = tmp_path / "run"
    run.mkdir()
    os.environ["VERL_FILE_LOGGER_PATH"] = str(run / "metrics.jsonl")
    try:
        logger = FileLogger("p", "e")
        for step in range(0, 11):
            data = {"critic/score/mean": step / 10} if step else {}
            if step % 5 == 0:
                data.update({"val-core/math_dapo/acc/mean@8": step / 20, "val-aux/math_dapo/reward/mean@8": step / 10})
            logger.log(data=data, step=step)
        logger.finish()
    finally:
        os.environ.pop("VERL_FILE_LOGGER_PATH", None)
    out = report.run(args(run))
    md = Path(out["report"]).read_text()
    assert "| val-core/math_dapo/acc/mean@8 | 0 | 0.5 | 0 | 0.5 | 3 |" in md
    assert "reward.png" in [Path(p).name for p in out["plots"]]
