"""Data value: whether each data source or synthetic strategy earns its place (``rule.py``: the decision)."""
