"""The local E2B-compatible code sandbox server (``server.py``, ``pool.py``, ``kernel.py``) and its launcher."""

from pipeline_steps import settings

KEY_ENV = settings.SANDBOX_API_KEY  # the server's API key: the sandbox-server step reads it, the launcher sets it
