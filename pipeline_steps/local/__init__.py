"""The embedded CPU backend: local Ray cluster, CPU GRPO trainer, tiny model, offline Hugging Face Hub."""
