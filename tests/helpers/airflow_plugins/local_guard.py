"""The local profile's own plugin (scripts/airflow_plugins/local_guard.py: the Host check and the login link), for a
test that points ``AIRFLOW__CORE__PLUGINS_FOLDER`` here: Airflow reads one plugins folder, and the API server must
stay guarded while this folder's fault injection runs."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[3] / "scripts" / "airflow_plugins" / "local_guard.py"
_spec = importlib.util.spec_from_file_location("pipeline_local_guard", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
LocalGuardPlugin = _module.LocalGuardPlugin
