"""Byte-level tokenizer: token i is byte i, so the vocabulary is 256 and nothing is downloaded."""
from __future__ import annotations

import numpy as np


def encode(text: str | bytes) -> np.ndarray:
    """Text (UTF-8) or bytes -> token ids, (n,) int64."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def decode(tokens) -> str:
    """Token ids -> text; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
