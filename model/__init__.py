"""omniloom.model: config, embeddings, attention (masks + backends), MoE, the decoder."""
