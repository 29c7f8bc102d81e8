"""AutoRegEmbed (autoregembed.txt): embeddings from k compression tokens of a decoder LLM, trained by
information compression (stage 1) and conditional distribution alignment (stage 2) against a
frozen copy of the decoder. ``model`` (encoder, frozen decoder), ``data`` (examples from unified
records), ``trainer``; the losses are in ``embed_core.losses.autoregembed``."""
