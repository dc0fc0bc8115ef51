"""Fault injection for tests/e2e/test_postgres_profile.py, loaded by the API server as an Airflow plugin (the test
points ``AIRFLOW__CORE__PLUGINS_FOLDER`` here): two task-success calls that create the same new Asset are forced to
meet.

Airflow 3.3 looks an alias-emitted Asset up (``AssetManager.register_asset_change`` returns None when it does not
exist) and then inserts it, inside the task-success request. Here a request that found the Asset missing waits, up
to ``ASSET_RACE_WAIT`` seconds, until another request has also found it missing, so both insert: without the
product's serialisation (operators/assets.py) the second fails on ``idx_asset_name_uri_unique``. Requests meet
through files in ``ASSET_RACE_DIR`` (the API server may serve them from several processes); every arrival is
recorded in ``ASSET_RACE_DIR/events.log`` as ``met <asset>`` or ``alone <asset>`` for the test to read.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid
from pathlib import Path

RACE_DIR = os.environ.get("ASSET_RACE_DIR")

if RACE_DIR and any(a == "api-server" for a in sys.argv):
    from airflow.assets.manager import AssetManager

    _original = AssetManager.register_asset_change.__func__
    _wait = float(os.environ.get("ASSET_RACE_WAIT", "20"))

    def register_asset_change(cls, *, asset, **kwargs):
        event = _original(cls, asset=asset, **kwargs)
        name = getattr(asset, "name", None)
        if event is None and name:  # missing: the caller inserts it next; wait for a second creator
            race = Path(RACE_DIR)
            key = hashlib.sha256(f"{name}\0{asset.uri}".encode()).hexdigest()[:16]
            me = race / f"{key}.{uuid.uuid4().hex}"
            me.touch()
            deadline, met = time.monotonic() + _wait, False
            while not met and time.monotonic() < deadline:
                met = any(p != me for p in race.glob(f"{key}.*"))
                time.sleep(0.1)
            with open(race / "events.log", "a") as f:
                f.write(f"{'met' if met else 'alone'} {name}\n")
        return event

    AssetManager.register_asset_change = classmethod(register_asset_change)
