"""How values read on a Markdown page: the run report and its sections share these."""

from __future__ import annotations


def cell(value) -> str:
    """Table cells: no line breaks, pipes escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def fmt(x) -> str:
    """Numbers as shown on the page (4 significant digits)."""
    if x is None:
        return "—"
    return f"{float(x):.4g}"
