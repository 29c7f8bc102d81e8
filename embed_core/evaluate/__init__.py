"""The evaluate stage (``stage.py``): MTEB on local data, the evaluated-model adapter, report, geometry."""
