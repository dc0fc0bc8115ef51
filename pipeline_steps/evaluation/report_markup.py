"""Markdown pieces for untrusted text (run ids, overrides typed in the trigger form), and the page as HTML."""

from __future__ import annotations

import base64
import logging
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)


def code(value, table: bool = True) -> str:
    """An inline code span that holds any text (the fence is longer than any backtick run inside).

    In a table cell ``|`` is escaped even inside the span: GFM splits cells before it reads spans.
    """
    s = " ".join(str(value).split()) or " "
    if table:
        s = s.replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def safe_url(url: str) -> str:
    """A URL without user:password (a link on the page must not carry credentials)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def link(url: str) -> str:
    """A Markdown autolink when the URL has no characters that would end it early; else a code span."""
    if url.startswith(("http://", "https://")) and not re.search(r"[\s<>`]", url):
        return f"<{url}>"
    return code(url, table=False)


def render_html(markdown_text: str, out: Path, title: str) -> str | None:
    """The page as HTML (raw HTML in the Markdown is escaped, not passed through); images inlined."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        log.info("markdown-it-py is not installed: report.html skipped (report.md has everything)")
        return None
    import html

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    body = md.render(markdown_text)

    def inline(m):
        p = out / html.unescape(m.group(1))
        if p.is_file() and p.parent == out:
            return 'src="data:image/png;base64,' + base64.b64encode(p.read_bytes()).decode() + '"'
        return m.group(0)

    body = re.sub(r'src="([A-Za-z0-9_.-]+\.png)"', inline, body)
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .5rem}"
        "code{background:#f4f4f4}img{max-width:100%}"
    )
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n{body}</body></html>\n"
    )
