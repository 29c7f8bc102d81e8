"""The mine stage (``stage.py``): FAISS hard-negative mining (``miner.py``)."""
