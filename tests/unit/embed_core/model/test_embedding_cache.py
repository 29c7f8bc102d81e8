"""``LazyCachedEmbed``: the run's embedding cache opened, and the encoder built, on first use."""

import numpy as np

from embed_core.model.embedding_cache import EmbeddingCache, LazyCachedEmbed


def _lengths(texts):
    return np.array([[len(t), 1.0, 0.0] for t in texts], dtype=np.float32)


def test_the_encoder_is_built_on_the_first_uncached_text_and_never_for_a_rerun_on_cached_texts(tmp_path):
    built, opened = [], []

    def open_():
        opened.append(1)
        return EmbeddingCache(tmp_path, "fp", 3, "float32")

    def make_encoder(cache):
        built.append(cache.dim)
        return _lengths

    embed = LazyCachedEmbed(open_, make_encoder)
    assert embed.cache is None and not opened and not built  # nothing opened or loaded before a call
    first = embed(["a", "bbb"])
    assert opened == [1] and built == [3]
    np.testing.assert_array_equal(first, _lengths(["a", "bbb"]))
    embed(["bbb", "cc"])
    assert opened == [1] and built == [3] and embed.cache.encoded_texts == 3  # "bbb" came from the cache

    rerun = LazyCachedEmbed(open_, make_encoder)
    np.testing.assert_array_equal(rerun(["cc", "a"]), _lengths(["cc", "a"]))
    assert opened == [1, 1] and built == [3] and rerun.cache.encoded_texts == 0  # opened, no model loaded
