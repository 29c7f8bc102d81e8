"""Text encoders (Hugging Face checkpoints from a local path) with pooling and L2 normalisation, the
trained embedder, saved-model settings, the GGUF cache and the embedding cache shared by the stages."""
