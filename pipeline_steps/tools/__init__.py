"""verl tools (code sandbox, MCP) and their configs, shipped as package data.

A preset names a shipped tool config as ``pkg:pipeline_steps.tools/code_sandbox.yaml``: the installed package's
location differs between a laptop's virtualenv and the training image, so the path is resolved where it is used
(the local trainer, the pre-flight, and ``verl_main`` before verl reads ``multi_turn.tool_config_path``). The same
rule serves reward files (``pkg:pipeline_steps.rewards/...``) and agent-loop configs (``pkg:pipeline_steps.rollouts/
...``).
"""

from __future__ import annotations

PKG = "pkg:"


def resolve_config_path(value) -> str:
    """``pkg:<package>/<file>`` -> that file of the installed package (a path inside its directory, no ``..``);
    any other value unchanged."""
    from importlib.resources import files

    from pipeline_steps.errors import UserError

    text = str(value)
    if not text.startswith(PKG):
        return text
    package, _, name = text[len(PKG) :].partition("/")
    if not name or name.startswith("/") or "\\" in name or ".." in name.split("/"):
        # the file must be the package's own: no way out of its directory
        raise UserError(f"{text}: name a file inside the package as pkg:<package>/<path>, without '..'")
    try:
        path = files(package) / name
    except (ModuleNotFoundError, TypeError):  # TypeError: a module, not a package
        raise UserError(f"{text}: {package!r} is not an installed package") from None
    if not path.is_file():
        raise UserError(f"{text}: no file {name!r} in package {package}")
    return str(path)


CODE_SANDBOX_TOOL = "pipeline_steps.tools.code_sandbox.CodeSandboxTool"


def uses_code_sandbox(value) -> bool:
    """Whether the tool config ``value`` (``pkg:`` or a readable path) loads our E2B code sandbox tool; a path that
    exists only in the training image counts as not."""
    from pathlib import Path

    from pipeline_steps.errors import UserError

    try:
        return CODE_SANDBOX_TOOL in Path(resolve_config_path(value)).read_text(errors="replace")
    except (OSError, UserError):
        return False
