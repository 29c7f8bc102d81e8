"""The synthesize stage (``stage.py``): LLM paraphrase, augmentation and hard negatives; the OpenAI-compatible
client, request cache, prompt templates and the local llama.cpp server."""
