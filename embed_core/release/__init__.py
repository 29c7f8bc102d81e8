"""Releases: a run's versioned models in MLflow's model registry, the gate a new one passes to become current."""
