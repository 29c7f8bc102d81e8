"""Text encoders (Hugging Face checkpoints from a local path) with pooling and L2 normalisation."""

from embed_core.model.encoder import Encoder, default_model_path

__all__ = ["Encoder", "default_model_path"]
