"""The preprocessors, one per dataset (like verl's ``utils/reward_score``), registered by name with
:func:`register_preprocessor`, as verl registers its advantage estimators (``register_adv_est``) and agent loops.

A preprocessor module decorates its conversion function with what the preprocess engine needs to know::

    @register_preprocessor("gsm8k", data_source=DATA_SOURCE, tool_name=TOOL_NAME, required_columns=REQUIRED_COLUMNS)
    def convert_row(row: dict, split: str, index: int, data_source: str) -> dict: ...

* ``data_source``: the rows' default ``data_source`` (routes to the scorer in verl's ``default_compute_score``; a
  registry entry's own ``data_source`` wins); ``tool_name``: the tool of the ``tool_agent`` variant, and
  ``tool_system_prompt`` its system prompt (default: ``common.TOOL_SYSTEM_PROMPT``);
* ``required_columns``: the parquet columns the function reads; ``split_names``: source split -> output split;
* the function is ``convert_row(row, split, index, data_source) -> dict`` (raises ``common.Reject``) for small
  datasets, or, with ``batch=True``, ``convert_batch(batch, split, start, data_source) -> (pa.Table, [(row,
  reason)])`` for vectorised ones;
* ``read_rows(path) -> iterator of (row | None, reject reason | None)`` replaces the parquet reader (line-oriented
  formats); ``row_schema(paths) -> pa.Schema`` fixes the converted rows' types by a first pass over every input file
  before any batch is written (rows built from Python dicts would otherwise get a type inferred batch by batch).

A dataset registry entry names its preprocessor (:attr:`pipeline_steps.data.registry.DatasetSpec.preprocessor`);
:func:`get_preprocessor` looks it up. The built-in modules register when the registry is first read
(:func:`_register_builtins`): importing this package imports none of them (nor pyarrow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from pipeline_steps.errors import UserError


@dataclasses.dataclass(frozen=True)
class Preprocessor:
    """A registered preprocessor: exactly one of ``convert_row`` and ``convert_batch`` is set."""

    name: str
    data_source: str
    tool_name: str
    required_columns: tuple[str, ...] = ()
    convert_row: Callable | None = None
    convert_batch: Callable | None = None
    read_rows: Callable | None = None
    row_schema: Callable | None = None
    split_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tool_system_prompt: str | None = None


_REGISTRY: dict[str, Preprocessor] = {}


def register_preprocessor(
    name: str,
    *,
    data_source: str,
    tool_name: str,
    required_columns: tuple[str, ...] = (),
    batch: bool = False,
    read_rows: Callable | None = None,
    row_schema: Callable | None = None,
    split_names: Mapping[str, str] | None = None,
    tool_system_prompt: str | None = None,
):
    """Register the decorated conversion function as preprocessor ``name`` (see the module's docstring); the
    function itself is returned unchanged. A second, different function under a taken name is refused."""

    def decorator(fn: Callable) -> Callable:
        known = _REGISTRY.get(name)
        if known is not None:
            same = known.convert_batch if batch else known.convert_row
            if same is None or (same.__module__, same.__qualname__) != (fn.__module__, fn.__qualname__):
                raise ValueError(f"preprocessor {name!r} is already registered by {_function_name(known)}")
        _REGISTRY[name] = Preprocessor(
            name=name,
            data_source=data_source,
            tool_name=tool_name,
            required_columns=tuple(required_columns),
            convert_row=None if batch else fn,
            convert_batch=fn if batch else None,
            read_rows=read_rows,
            row_schema=row_schema,
            split_names=dict(split_names or {}),
            tool_system_prompt=tool_system_prompt,
        )
        return fn

    return decorator


def _function_name(pre: Preprocessor) -> str:
    fn = pre.convert_batch or pre.convert_row
    return f"{fn.__module__}.{fn.__qualname__}"


def _register_builtins() -> None:
    """The built-in preprocessors register by being imported (as verl's ``reward_manager/__init__.py`` imports its
    managers); here, not at this package's import, so a module of the package never waits on its siblings."""
    from pipeline_steps.data.preprocessors import aime, dapo_math, geometry3k, gsm8k, jsonl  # noqa: F401


def preprocessor_names() -> tuple[str, ...]:
    """The registered preprocessors' names, sorted."""
    _register_builtins()
    return tuple(sorted(_REGISTRY))


def get_preprocessor(name: str) -> Preprocessor:
    """The preprocessor registered as ``name``, or a one-line UserError naming the known ones."""
    _register_builtins()
    if name not in _REGISTRY:
        raise UserError(
            f"preprocessor {name!r} is not registered; known: {', '.join(sorted(_REGISTRY))} "
            "(@register_preprocessor in pipeline_steps/data/preprocessors/)"
        )
    return _REGISTRY[name]
