"""Model loading: resolution as LocalAI names models, GGUF, LoRA, export."""
