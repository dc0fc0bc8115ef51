"""The ``verl_evaluate_model`` DAG's plan, made once by its ``plan`` task (:func:`evaluation_plan`).

Cheap to import: the DAG file uses it at parse time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pipeline_steps.errors import UserError
from pipeline_steps.planning import argv_templates as argv
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.planning.plan import default_store, run_key
from pipeline_steps.planning.run_plan import EvaluationPlan


def evaluation_plan(
    params: dict, triggered_by: str | None, run_id: str, dag_id: str, credentials: Mapping[str, str] | None = None
) -> dict:
    """The ``verl_evaluate_model`` run's plan (an :class:`EvaluationPlan`'s dict): which model (the form's, else the
    exported model whose event triggered the run), which evaluation parquet (the form's, else the named dataset's
    last processed version in the store), where the results go, and the evaluate step's argv (``steps``).
    ``credentials``: the store client's (the worker's connection); without them, the environment's."""
    from pipeline_steps.store import open_store

    store = (params.get("store_uri") or default_store()).rstrip("/")
    layout = RunLayout.for_store(store)
    model = params.get("model_uri") or triggered_by or ""
    if not model:
        raise UserError("model_uri: empty and no exported-model event triggered this run; name a model to evaluate")
    data = params.get("eval_data_uri")
    if not data:
        name = params["eval_dataset"]
        pointer = open_store(store, credentials=credentials).read_bytes(layout.last_processed(name))
        if pointer is None:
            raise UserError(
                f"eval_dataset {name!r}: no processed version in {store}; run verl_grpo_pipeline with it first or "
                "pass eval_data_uri"
            )
        data = json.loads(pointer)["uri"].rstrip("/") + "/test.parquet"
    key = run_key(run_id)
    # the output is in the store: the results outlive the task's machine
    evaluate = argv.evaluate_model_argv(model, data, layout.evaluation(key), params)
    return EvaluationPlan(
        backend="local",  # in the worker; a model and data on a cloud store are fetched into its local mirror
        store=store,
        model=model,
        data=data,
        run_key=key,
        dag_id=dag_id,
        run_id=run_id,
        steps={"evaluate": evaluate},
        carry={"evaluate": {"model": model, "data": data}},  # in the evaluate task's XCom, as before
    ).to_dict()
