"""One module per CLI step (``add_arguments`` and ``run``): what ``python -m pipeline_steps <step>`` runs."""
