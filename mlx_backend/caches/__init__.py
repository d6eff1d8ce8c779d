"""KV caches: quantized ones that batch, and KV states on disk."""
