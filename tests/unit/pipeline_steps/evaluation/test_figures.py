"""Thumbnails of the evaluated figures (pipeline_steps/evaluation/figures.py) and the run report that shows them beside
the model's answers: small re-encoded PNGs, inlined as data: URIs (the page's CSP allows no other image), and a file
that is not an image never reaches the page."""

from __future__ import annotations

import base64
import io
import json
import re

from pipeline_steps.evaluation import eval_run, figures, run_report, scoring
from tests.helpers.eval_rows import png
from tests.helpers.vl_rows import geo3k_rows


def test_a_thumbnail_is_small_and_only_pixels():
    from PIL import Image

    big = png(640, 480, "red")
    thumb = figures.thumbnail(big)
    with Image.open(io.BytesIO(thumb)) as im:
        assert im.format == "PNG" and im.size == (96, 72)
    assert len(thumb) <= figures.MAX_BYTES
    assert figures.thumbnail(b"<script>alert(1)</script>") is None
    assert figures.thumbnail(b"") is None
    # a decompression bomb's header is refused before any pixel is decoded
    from PIL import Image as I

    buf = io.BytesIO()
    I.new("1", (5000, 5000)).save(buf, format="PNG")
    assert figures.thumbnail(buf.getvalue()) is None


def test_the_report_shows_each_figure_beside_the_answers_as_an_inline_data_uri(tmp_path):
    rows = geo3k_rows("test", 3)
    gens = [
        [f"<think> </think> \\boxed{{{r['reward_model']['ground_truth']}}}", "\\boxed{<img src=x onerror=1>}"]
        for r in rows
    ]
    res = scoring.score(rows, gens)
    run = tmp_path / "run"
    eval_run.write_outputs(run / "eval", res, None, gens, rows)
    assert sorted(p.name for p in (run / "eval" / "figures").iterdir()) == ["0000.png", "0001.png", "0002.png"]
    (run / "eval" / "figures" / "0001.png").write_text("<html><img src=http://evil/></html>")  # not an image
    summary = run_report.write_report(str(run), None, "", "", "")
    md = (run / "report" / "report.md").read_text()
    assert "| figure | problem |" in md
    assert "![figure](figure-0000.png)" in md and "![figure](figure-0002.png)" in md
    assert "figure-0001.png" not in md and not (run / "report" / "figure-0001.png").exists()
    page = (run / "report" / "report.html").read_text()
    sources = re.findall(r'<img src="([^"]*)"', page)
    figures_inlined = [s for s in sources if s.startswith("data:image/png;base64,")]
    assert len(figures_inlined) == len(sources) >= 2 and "evil" not in page
    for s in figures_inlined:
        assert len(base64.b64decode(s.split(",", 1)[1])) <= figures.MAX_BYTES
    assert "img-src data:" in page and "<img src=x" not in page
    assert json.loads((run / "eval" / "results.json").read_text())["figures"] == {"dir": "figures", "count": 3}
    assert summary["inputs"]["eval/results.json"] == "ok"
