"""embed_core: the embedpipe library (pure Python, never imports prefect)."""

__version__ = "0.1.0"
