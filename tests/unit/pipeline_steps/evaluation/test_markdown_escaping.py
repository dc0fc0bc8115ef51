"""The escaping helpers every published page uses (pipeline_steps/evaluation/markdown.py): hostile text, rendered by
markdown-it-py with raw HTML allowed and linkify on (what a permissive Hub or GitHub renderer does), reads exactly as
typed (line breaks folded) and makes no tag, link, image, heading or table cell of its own.

The browser-level proof, on a whole hostile run, is tests/e2e/test_inert_outputs.py.
"""

from __future__ import annotations

import html
import re

import pytest

from pipeline_steps.evaluation.markdown import block, cell, code, fmt, labelled_link, link

HOSTILE = [
    "<img src=http://127.0.0.1:9/x onerror=alert(1)>",
    "![x](http://127.0.0.1:9/y)",
    "[Session expired – log in](http://evil.example/login)",
    "[x][r]\n\n[r]: http://evil.example/ref",
    "<http://127.0.0.1:9/auto> http://evil.example/bare www.evil.example evil.example a@evil.example",
    "mailto:a@evil.example javascript:alert(1) //evil.example/x",
    "a` ![x](http://127.0.0.1:9/tick) `b ``` `",
    "p1\n# forged heading\n<script>alert(1)</script>",
    "x\r\n===\n- item\n> quote\n    indented",
    "| a | b |\n| --- | --- |",
    "_em_ *em* **strong** ~~del~~ $x$ {onclick=alert(1)} [^1]",
    "&amp; &#x3C;img&#x3E; <!-- c --> \\` \\",
    "- list",
    "+ list",
    "= setext",
    "1) ordered",
    "2. ordered",
    "a_b manual__2026-01-02T03:00:00+00:00 val-core/math_dapo/acc/mean@8 0.9.1",
    "ends with a backslash \\",
    "",
]


def render(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("gfm-like", {"html": True}).render(text)


def shown(fragment: str) -> str:
    """What a reader sees of an HTML fragment: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def folded(value: str) -> str:
    return " ".join(value.split())


TAGS = re.compile(r"<(?!/?(?:p|table|thead|tbody|tr|th|td|h1|code)\b)[a-z!]", re.I)


@pytest.mark.parametrize("value", HOSTILE)
def test_text_in_a_table_cell_a_heading_and_prose_reads_as_typed(value):
    page = render(f"# {cell(value)}\n\nsaid {cell(value)} here\n\n| col |\n| --- |\n| {cell(value)} |\n")
    assert not TAGS.search(page), page  # no img, a, script, iframe, em, del, li, blockquote, pre, comment...
    (h1,) = re.findall(r"<h1>(.*?)</h1>", page, re.S)
    assert shown(h1) == folded(value)
    (para,) = re.findall(r"<p>(.*?)</p>", page, re.S)
    assert shown(para) == f"said {folded(value)} here"
    cells = re.findall(r"<td>(.*?)</td>", page, re.S)
    assert [shown(c) for c in cells] == [folded(value)], page  # one row, one cell
    assert page.count("<tr>") == 2 and page.count("<h1>") == 1


@pytest.mark.parametrize("value", HOSTILE)
def test_a_code_span_holds_any_text_in_a_table_and_in_prose(value):
    page = render(f"| col | next |\n| --- | --- |\n| {code(value)} | after |\n\nprose {code(value, table=False)} end\n")
    assert not re.search(r"<(?!/?(?:p|table|thead|tbody|tr|th|td|code)\b)[a-z!]", page, re.I), page
    cells = re.findall(r"<td>(.*?)</td>", page, re.S)
    assert len(cells) == 2 and cells[1] == "after", page
    spans = re.findall(r"<code>(.*?)</code>", page, re.S)
    assert [html.unescape(s).strip() for s in spans] == [folded(value).strip()] * 2, page


@pytest.mark.parametrize("value", HOSTILE)
def test_a_fenced_block_holds_any_text(value):
    page = render("\n".join(["before", "", *block(value + "\n```\n" + value), "", "after"]) + "\n")
    assert page.count("<pre>") == 1 and page.startswith("<p>before</p>") and page.endswith("<p>after</p>\n"), page
    (inner,) = re.findall(r"<pre><code[^>]*>(.*?)</code></pre>", page, re.S)
    typed = (value + "\n```\n" + value).replace("\r\n", "\n")  # the renderer normalises line endings
    assert html.unescape(inner) == typed + "\n"


def test_only_pipeline_given_http_urls_are_linked_and_never_with_credentials():
    assert link("http://u:pw@127.0.0.1:8265/#/jobs") == "<http://127.0.0.1:8265/#/jobs>"
    for url in ("javascript:alert(1)", "file:///store/x", "http://a b", "http://x/<img>", "https://x/a)(b", "data:,x"):
        assert "<a " not in render(link(url)), url
    assert labelled_link("`r`", "http://127.0.0.1:5000/#/runs/r") == "[`r`](http://127.0.0.1:5000/#/runs/r)"
    assert labelled_link("`r`", "javascript:alert(1)") == "`r`"


def test_numbers_are_shown_rounded_and_anything_else_as_text():
    assert fmt(None) == "—" and fmt(0.123456) == "0.1235" and fmt("2") == "2"
    assert fmt("<img src=x>") == "\\<img src=x\\>"
