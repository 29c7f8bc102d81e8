"""Prefect flows: composition of tasks only. Importing this package has no side effects; the
environment defaults for a process that runs flows are applied by ``flows.env.apply_defaults``."""
