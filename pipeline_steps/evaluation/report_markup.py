"""The run report's page as HTML: its Markdown rendered with raw HTML off, its curves inlined, and a
Content-Security-Policy that lets the page load nothing but what it carries (the escaping of untrusted text is in
:mod:`pipeline_steps.evaluation.markdown`)."""

from __future__ import annotations

import base64
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)


def render_html(markdown_text: str, out: Path, title: str) -> str | None:
    """The page as HTML (raw HTML in the Markdown is escaped, not passed through); images inlined.

    The page carries a Content-Security-Policy that forbids every load (``default-src 'none'``) but its own inlined
    curves (``img-src data:``) and its one style sheet (by its hash): no script, frame, font, remote image or form,
    even if text got past the escaping. Table alignment becomes classes, since a style attribute would need
    ``'unsafe-inline'``.
    """
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        log.info("markdown-it-py is not installed: report.html skipped (report.md has everything)")
        return None
    import hashlib
    import html

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    body = md.render(markdown_text)

    def inline(m):
        p = out / html.unescape(m.group(1))
        if p.is_file() and p.parent == out:
            return 'src="data:image/png;base64,' + base64.b64encode(p.read_bytes()).decode() + '"'
        return m.group(0)

    body = re.sub(r'src="([A-Za-z0-9_.-]+\.png)"', inline, body)
    # the renderer's own attribute (text cannot make one: it is HTML-escaped, quotes included)
    body = re.sub(r' style="text-align:(left|center|right)"', r' class="\1"', body)
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .5rem}"
        ".left{text-align:left}.center{text-align:center}.right{text-align:right}"
        "code{background:#f4f4f4}img{max-width:100%}"
    )
    style_hash = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
    policy = f"default-src 'none'; img-src data:; style-src 'sha256-{style_hash}'; base-uri 'none'; form-action 'none'"
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
        f'<meta name="referrer" content="no-referrer"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n{body}</body></html>\n"
    )
