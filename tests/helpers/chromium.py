"""How the browser tests start Debian's Chromium (headless, no sandbox, no background traffic)."""

from __future__ import annotations

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
