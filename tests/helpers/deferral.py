"""Run a deferrable operator the way Airflow does, without a scheduler or triggerer process.

``deferred(op, context)``: ``execute`` must raise ``TaskDeferred`` resuming in ``execute_complete``; the trigger is
rebuilt from its ``serialize()`` output, as the triggerer does, so what does not survive serialisation fails here.
``run_trigger(trigger)``: run the rebuilt trigger until its first event and return that event's payload.
"""

from __future__ import annotations

import asyncio
import importlib

import pytest
from airflow.sdk.exceptions import TaskDeferred


def deferred(op, context):
    with pytest.raises(TaskDeferred) as exc:
        op.execute(context)
    assert exc.value.method_name == "execute_complete"
    path, kwargs = exc.value.trigger.serialize()
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)(**kwargs)


def run_trigger(trigger, timeout: float = 60) -> dict:
    async def first():
        gen = trigger.run()
        try:
            return (await gen.__anext__()).payload
        finally:
            await gen.aclose()

    return asyncio.run(asyncio.wait_for(first(), timeout))
