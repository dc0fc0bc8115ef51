"""How untrusted text reads on a Markdown page: the one home of the escaping the published pages share.

The run report (``report.md`` and ``report.html``), the model card (``README.md``) and ``results.md`` show text that
came from a model (answers, rollouts), a dataset (ground truths, problem ids, names) or the trigger form (preset and
dataset names, overrides, run ids). Such text must read as typed and never become markup: no image or frame that
loads something, no link, no raw HTML, no heading, no table row of its own. Each helper is for one context:

* :func:`text` (alias :func:`cell`): prose, a heading or a table cell. One line (line breaks folded into spaces);
  every character that could start Markdown or HTML markup is backslash-escaped (CommonMark shows an escaped ASCII
  punctuation character as itself), including ``:`` and the ``.`` of a domain, so neither a CommonMark autolink nor
  a linkifier (markdown-it's ``linkify``, GitHub's extended autolinks) finds a URL in it;
* :func:`code`: an inline code span whose fence is longer than any backtick run inside, so nothing closes it early
  (inside a span no renderer makes links, images or HTML);
* :func:`block`: a fenced code block for multi-line text (rollouts, tool calls), fenced the same way;
* :func:`link`: a URL the pipeline itself gives (the Ray dashboard, the MLflow run): only ``http(s)``, without
  credentials; anything else is shown as a code span, never linked.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# always escaped: code spans, emphasis, links and images, raw HTML and entities, table cells, headings, math, URL
# schemes, attribute lists ({...} of markdown-it-attrs), backslash itself
_ALWAYS = frozenset("\\`*[]<>&|#$:{}~")
_LINE_START = re.compile(r"^(?:[-+=]|\d+(?=\)))")  # a list item, a setext underline, an ordered list's number


def text(value) -> str:
    """Inline text that reads as typed in prose, a heading or a table cell, and is never markup."""
    s = " ".join(str(value).split())
    out = []
    for i, ch in enumerate(s):
        if ch in _ALWAYS:
            out.append("\\" + ch)
        elif ch == ".":  # a domain's dot (what a linkifier looks for); a version's or a number's stays as it is
            out.append("." if i + 1 < len(s) and s[i + 1].isdigit() else "\\.")
        elif ch == "_":  # emphasis only where it is not inside a word: a_b stays, _b_ is escaped
            j = i
            while j < len(s) and s[j] == "_":
                j += 1
            k = i
            while k > 0 and s[k - 1] == "_":
                k -= 1
            inside = k > 0 and s[k - 1].isalnum() and j < len(s) and s[j].isalnum()
            out.append("_" if inside else "\\_")
        else:
            out.append(ch)
    s = "".join(out)
    m = _LINE_START.match(s)  # harmless inside a line, but the value may start one
    if m and m.group()[0].isdigit():  # "1)": escape the delimiter ("1." has its dot escaped already)
        s = s[: m.end()] + "\\" + s[m.end() :]
    elif m:
        s = "\\" + s
    return s


def cell(value) -> str:
    """A table cell (or any inline text): see :func:`text`."""
    return text(value)


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


def block(value, info: str = "text") -> list[str]:
    """A fenced code block holding any text, as lines: the fence is longer than any backtick run inside, so no line
    of the text closes it; the renderer shows the text verbatim (HTML-escaped)."""
    s = str(value)
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    return [fence + info, s, fence]


def fmt(x) -> str:
    """Numbers as shown on the page (4 significant digits); a value that is not a number is shown as text."""
    if x is None:
        return "—"
    try:
        return f"{float(x):.4g}"
    except (TypeError, ValueError):
        return text(x)


def safe_url(url: str) -> str:
    """A URL without user:password (a link on the page must not carry credentials)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


_LINKABLE = re.compile(r"^https?://[^\s<>`()\[\]\\\"']+$")


def linkable(url: str) -> bool:
    """An http(s) URL that a Markdown link or autolink holds whole (nothing in it ends the link early)."""
    return bool(_LINKABLE.match(url or "")) and bool(urlsplit(url).netloc)


def link(url: str) -> str:
    """A URL the pipeline gives, as a Markdown autolink (credentials dropped); anything but http(s), or a URL with
    characters that would end the link early, is shown as a code span, not linked."""
    url = safe_url(url)
    return f"<{url}>" if linkable(url) else code(url, table=False)


def labelled_link(label_code: str, url: str) -> str:
    """``[label](url)`` for a pipeline-given http(s) URL (credentials dropped); just the label otherwise.

    :param label_code: the label, already made inert (a :func:`code` span)
    """
    url = safe_url(url or "")
    return f"[{label_code}]({url})" if linkable(url) else label_code
