"""Model, dataset and form text is inert in everything the pipeline publishes (issue 46, item 3).

One run directory is built from hostile fixtures: model answers, ground truths, problem ids, rollouts, preset and
dataset names, the run's overrides and ids, metric keys. Each value carries the probes the issue found: an HTML
``<img>`` whose ``onerror`` sets ``window.pwned``, a Markdown image, an attacker link ("Session expired – log in"),
an autolink and a bare URL, a ``<script>``, an ``<iframe>``, a newline followed by ``# forged heading``; answers
also carry backticks that try to close the code span around them. Every image, frame and script source points at a
local HTTP server that counts its hits.

Then every output is rendered as a reader sees it and opened in Debian's Chromium through Playwright:

* ``report.html``, written by the real ``python -m pipeline_steps report`` on that run directory, and its
  ``report.md`` as a permissive viewer of the store would show it (below);
* the model card (``README.md``, what ``export`` writes with :func:`pipeline_steps.evaluation.model_card.render`)
  and ``results.md`` (what ``evaluate`` writes), each rendered by markdown-it-py with raw HTML allowed and
  linkify on (``gfm-like``: what a Hub or GitHub page does, before any sanitiser).

Each page must make no request (Chromium's request log and the server's hits), run no script, carry no link but
the ones the pipeline gave (the dashboard, the MLflow run, verl's repository), show no image but the report's own
inlined curves, and have only the headings the pipeline wrote. The report must also carry a Content-Security-Policy
that stops a remote load even when something else slips through, without breaking its own page.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline_steps.evaluation import metrics as eval_metrics
from tests.helpers.chromium import CHROMIUM_ARGS
from tests.helpers.step_cli import run_step

pytestmark = [pytest.mark.slow, pytest.mark.browser]

DASHBOARD = "http://127.0.0.1:8265/#/jobs"  # given by the pipeline: the only links a page may carry
MLFLOW_URL = "http://127.0.0.1:5000/#/experiments/1/runs/0a1b2c3d"
VERL_REPO = "https://github.com/volcengine/verl"
MARK = "forged heading"  # the line a payload tries to make a heading of


@pytest.fixture(scope="module")
def trap():
    """A local HTTP server that records every request: a hit is a remote load the page should not have made."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(404)  # not an image: an <img onerror=...> handler would fire next
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield {"port": srv.server_port, "hits": hits}
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: apt-get install -y chromium (.ci/run does it)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def payload(tag: str, port: int, one_line: bool = False) -> str:
    """Every probe at once, named by the field it sits in (so a leak in the network log names its field)."""
    t = f"http://127.0.0.1:{port}/{tag}"
    text = (
        f"{tag} <img src={t}-img onerror=\"window.pwned='{tag}';console.log('pwned {tag}')\"> ![x]({t}-md) "
        f"[Session expired – log in](http://evil.example/{tag}) <{t}-auto> http://evil.example/{tag}-bare "
        f"www.evil.example/{tag} <script>window.pwned='{tag}-script'</script> <iframe src={t}-frame></iframe>"
    )
    return text if one_line else text + f"\n# {MARK} {tag}\n<script>window.pwned='{tag}-block'</script>"


def tick(tag: str, port: int) -> str:
    """An answer whose backticks close a code span opened around it (math_dapo answers keep backticks)."""
    t = f"http://127.0.0.1:{port}/{tag}"
    return f"{tag}` ![x]({t}-tick) <img src={t}-tickimg onerror=\"window.pwned='{tag}-tick'\"> `` ``` `"


def hostile_results(port: int, who: str) -> dict:
    """Evaluation results in evaluate's shape (its own metric functions), every text field hostile."""
    problems = []
    for i in range(3):
        gt = tick(f"{who}-gt{i}", port) if i == 0 else payload(f"{who}-gt{i}", port)
        answers = [tick(f"{who}-ans{i}", port)] * 2 + [gt]
        correct = [False, False, True]
        samples = [{"answer": a, "correct": c, "score": float(c)} for a, c in zip(answers, correct)]
        pid, source = payload(f"{who}-pid{i}", port), payload(f"{who}-source", port, one_line=True)
        problems.append(eval_metrics.problem_record(pid, i, source, gt, samples))
    return {
        **eval_metrics.results_of(problems),
        "model": {"path": payload(f"{who}-modelpath", port), "step": 1, "content_sha256": "m" * 64},
        "eval_set": {"name": payload(f"{who}-evalset", port), "sha256": payload(f"{who}-evalsha", port)},
        "sampling": {"k": 3, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
        "scorer": payload(f"{who}-scorer", port),
    }


def hostile_lineage(port: int) -> dict:
    p = lambda tag: payload(tag, port)  # noqa: E731
    return {
        "base_model": {"name": p("basemodel"), "revision": p("baserev"), "uri": p("baseuri")},
        "datasets": [
            {
                "name": p("dsname"),
                "role": p("dsrole"),
                "repo_id": p("dsrepo"),
                "revision": p("dsrev"),
                "content_hash": p("dshash"),
                "uri": p("dsuri"),
            }
        ],
        "experiment": {
            "name": p("preset"),
            "preset_sha256": p("presetsha"),
            "overrides": [p("override"), "trainer.total_training_steps=1"],
            "overrides_sha256": p("overridesha"),
        },
        "verl_version": p("verl"),
        "dag_id": p("dagid"),
        "run_id": p("runid"),
        "run_uri": p("runuri"),
    }


def hostile_run(tmp: Path, port: int) -> Path:
    """A run directory as the pipeline leaves it, from hostile fixtures."""
    run = tmp / "run"
    (run / "eval").mkdir(parents=True)
    (run / "rollouts").mkdir()
    metric = f"val-core/{payload('metrickey', port, one_line=True)}/acc/mean@1"
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "data": {"critic/score/mean": s / 4, "timing_s/step": 1.0, metric: s / 8}}) + "\n"
            for s in (1, 2, 3)
        )
    )
    res, base = hostile_results(port, "model"), hostile_results(port, "base")
    (run / "eval" / "results.json").write_text(json.dumps(res))
    (run / "eval" / "base_results.json").write_text(json.dumps(base))
    (run / "lineage.json").write_text(json.dumps(hostile_lineage(port)))
    p = lambda tag: payload(tag, port)  # noqa: E731
    (run / "train_summary.json").write_text(
        json.dumps(
            {
                "experiment": p("tsexperiment"),
                "experiment_digest": p("tsdigest"),
                "last_step": p("tslaststep"),
                "resumed_from_step": p("tsresumed"),
                "checkpoint_dir": p("tsckpt"),
                "metrics_path": p("tsmetrics"),
                "mlflow": {"run_id": "0a1b2c3d", "tracking_uri": "http://127.0.0.1:5000", "url": MLFLOW_URL},
            }
        )
    )
    rollout = {
        "input": p("prompt"),
        "output": p("output"),
        "gts": p("rolloutgt"),
        "score": 1.0,
        "step": 3,
        "uid": p("uid"),
        "advantage": 0.5,
        "num_turns": p("numturns"),
        "turns": [{"role": p("role"), "text": p("turn") + "\n```\n" + p("afterfence")}],
        "tool_calls": [{"code": p("toolcall")}],
    }
    (run / "rollouts" / "3.jsonl").write_text(json.dumps(rollout) + "\n")
    return run


def open_page(browser, path: Path, trap: dict) -> dict:
    """Open a page as a reader does; what it requested, ran and shows."""
    before = len(trap["hits"])
    page = browser.new_page()
    requests: list[str] = []
    console: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: console.append(m.text))
    page.add_init_script(
        "window.__violations = [];"
        "document.addEventListener('securitypolicyviolation',"
        " e => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"
    )
    url = path.as_uri()
    try:
        page.goto(url, wait_until="load")
        page.wait_for_timeout(500)  # onerror handlers of failed loads, late frames
        seen = page.evaluate(
            """() => ({
                pwned: window.pwned === undefined ? null : String(window.pwned),
                violations: window.__violations,
                links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
                images: [...document.querySelectorAll('img')].map(i => i.getAttribute('src') || ''),
                broken_images: [...document.querySelectorAll('img')].filter(i => !i.complete || !i.naturalWidth)
                    .map(i => (i.getAttribute('src') || '').slice(0, 60)),
                frames: document.querySelectorAll('iframe, frame, object, embed').length,
                scripts: document.querySelectorAll('script').length,
                headings: [...document.querySelectorAll('h1,h2,h3,h4,h5,h6')].map(h => h.textContent),
                csp: [...document.querySelectorAll('meta[http-equiv="Content-Security-Policy" i]')]
                    .map(m => m.getAttribute('content')),
            })"""
        )
    finally:
        page.close()
    seen["requests"] = [u for u in requests if u != url and not u.startswith("data:")]
    seen["hits"] = trap["hits"][before:]
    seen["console"] = [c for c in console if "pwned" in c]
    log = {"requests": seen["requests"], "server hits": seen["hits"], "script ran": seen["pwned"]}
    log |= {"links": seen["links"], "headings": seen["headings"]}
    print(f"\nnetwork log of {path.name}: {json.dumps(log)}")  # for the record: run with -s
    return seen


def assert_inert(seen: dict, allowed_links: set[str], own_images: tuple[Path, ...] = ()) -> None:
    """No request (but the pipeline's own curves beside the page), no script, no foreign link, image or heading."""
    own = {p.name for p in own_images}
    requests = [u for u in seen["requests"] if u not in {p.as_uri() for p in own_images}]
    assert requests == [], f"the page requested {requests}"
    assert seen["hits"] == [], f"the trap server was hit: {seen['hits']}"
    assert seen["pwned"] is None and seen["console"] == [], f"a script ran: {seen['pwned']} {seen['console']}"
    assert seen["scripts"] == 0 and seen["frames"] == 0, seen
    foreign = [h for h in seen["links"] if h not in allowed_links]
    assert foreign == [], f"links that did not come from the pipeline: {foreign}"
    assert [s for s in seen["images"] if not s.startswith("data:image/png;base64,") and s not in own] == [], seen
    assert [h for h in seen["headings"] if h.strip().startswith(MARK)] == [], f"forged headings: {seen['headings']}"


def render_markdown(text: str, out: Path) -> Path:
    """Markdown as a permissive renderer shows it: raw HTML allowed, bare URLs linked, GFM tables."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("gfm-like", {"html": True})
    out.write_text(f'<!doctype html>\n<html><head><meta charset="utf-8"></head><body>\n{md.render(text)}</body></html>')
    return out


def test_report_html_from_hostile_fixtures_loads_nothing_and_runs_nothing(tmp_path, trap, browser):
    run = hostile_run(tmp_path, trap["port"])
    states = {"train": payload("taskstate", trap["port"]), payload("taskid", trap["port"], one_line=True): "success"}
    code, summary, err = run_step(
        "report",
        "--run-dir",
        run,
        "--dashboard-url",
        DASHBOARD,
        "--exported-uri",
        "file:///store/models/exported/x/v1",
        "--task-states",
        json.dumps(states),
    )
    assert code == 0, err[-3000:]
    page = Path(summary["html"])
    seen = open_page(browser, page, trap)
    assert_inert(seen, {DASHBOARD, MLFLOW_URL})
    assert seen["broken_images"] == [] and len(seen["images"]) == len(summary["plots"]) >= 1  # its own curves show
    assert seen["violations"] == [], f"the report's own page breaks its policy: {seen['violations']}"
    (policy,) = seen["csp"]
    directives = {d.split()[0]: d.split()[1:] for d in policy.split(";") if d.strip()}
    assert directives["default-src"] == ["'none'"] and directives["img-src"] == ["data:"], policy
    assert "'unsafe-inline'" not in policy and "script-src" not in directives, policy

    # the policy is the second line: a remote load that got past the escaping would still be refused
    probe = browser.new_page()
    try:
        probe.goto(page.as_uri(), wait_until="load")
        probe.evaluate(
            f"""() => new Promise(done => {{
                const img = new Image(); img.onload = img.onerror = done;
                img.src = 'http://127.0.0.1:{trap["port"]}/csp-probe'; setTimeout(done, 1000); }})"""
        )
    finally:
        probe.close()
    assert "/csp-probe" not in trap["hits"], "the report's Content-Security-Policy let a remote image load"

    # report.md itself, as a permissive viewer of the store shows it (raw HTML allowed, no policy): inert too
    plots = tuple(Path(p) for p in summary["plots"])
    permissive = render_markdown(Path(summary["report"]).read_text(), page.parent / "report-permissive.html")
    assert_inert(open_page(browser, permissive, trap), {DASHBOARD, MLFLOW_URL}, own_images=plots)


def test_model_card_from_hostile_fixtures_is_inert_when_rendered_with_html(tmp_path, trap, browser):
    from pipeline_steps.evaluation import model_card

    port = trap["port"]
    record = {
        "version": payload("version", port),
        "experiment": payload("experiment", port),
        "exported_at": payload("exportedat", port),
        "checkpoint": {"dir": payload("ckptdir", port), "step": payload("ckptstep", port)},
        "weights_sha256": payload("weights", port),
        "promotion": {"promote": False, "reason": payload("reason", port)},
        "lineage": hostile_lineage(port),
        "mlflow": {"run_id": "0a1b2c3d", "url": MLFLOW_URL, "tracking_uri": "http://127.0.0.1:5000"},
    }
    card = model_card.render(record, hostile_results(port, "model"), hostile_results(port, "base"))
    seen = open_page(browser, render_markdown(card, tmp_path / "card.html"), trap)
    assert_inert(seen, {VERL_REPO, MLFLOW_URL})
    front = card.split("\n---\n", 1)[0]  # the Hub's metadata: repository ids only, nothing it would link blindly
    assert "127.0.0.1" not in front and "evil" not in front, front


def test_results_md_from_hostile_fixtures_is_inert_when_rendered_with_html(tmp_path, trap, browser):
    from pipeline_steps.evaluation import results_page

    port = trap["port"]
    text = results_page.render(hostile_results(port, "model"), hostile_results(port, "base"))
    seen = open_page(browser, render_markdown(text, tmp_path / "results.html"), trap)
    assert_inert(seen, set())
    assert len(seen["headings"]) == 1, seen["headings"]  # the page's own title, nothing forged
