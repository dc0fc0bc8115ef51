"""Hooks: the connections the operators and triggers go through (Kubernetes RayJobs, the store, Hugging Face)."""
