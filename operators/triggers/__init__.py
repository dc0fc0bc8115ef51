"""Triggers: wait for a training or step job asynchronously (one poll loop, two backends)."""
