"""The prepare stage (``stage.py``): raw sources → unified records; converters, readers and cleaning."""
