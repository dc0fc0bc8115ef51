"""Datasets: the registry, revision resolution, and one preprocessor per dataset into verl's row schema."""
