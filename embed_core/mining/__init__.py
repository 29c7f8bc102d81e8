"""Hard-negative mining: embedding cache, FAISS search, positive-aware selection."""

from embed_core.mining.cache import EmbeddingCache
from embed_core.mining.miner import MineSettings, mine_records

__all__ = ["EmbeddingCache", "MineSettings", "mine_records"]
