"""Evaluation: avg@k / pass@k / maj@k, the promotion gate and pointer, the model card, the run report."""
