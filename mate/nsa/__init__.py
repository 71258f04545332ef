"""DeepSeek NSA (Native Sparse Attention) stages."""
