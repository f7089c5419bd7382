"""KV caches beyond the contiguous one: quantized (chapter 02), paged and radix (later chapters)."""
