"""The KV cache: appending K and V (with RoPE, head norms) to contiguous and paged caches; the paged pool layout."""
