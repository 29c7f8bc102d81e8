"""Prefect tasks: thin wrappers over embed_core that add caching, retries, logging and artifacts."""
