"""The pipeline's real work, as plain Python (no Airflow import).

Every step runs as ``python -m pipeline_steps <step> ...`` and prints a one-line
JSON summary as its last stdout line; logs go to stderr.
"""
