"""Training set-up: presets and their loader, the run plan, override rules, CPU pre-flight, RayJob rendering."""
