"""Scoring with MTEB on local files, below the stages that score: the task spec and the scoring
libraries (``config.py``), local task data (``data.py``), MTEB task objects (``tasks.py``) and the
encoder MTEB evaluates (``model.py``). The evaluate stage scores saved models with them; a train
stage scores its dev tasks with them while it trains (``embed_core.train.dev``)."""
