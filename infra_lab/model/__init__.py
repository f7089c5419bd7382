"""The book's small GPT: a LLaMA-style decoder trained on Python's own standard library.

`load("target")` gives the shipped ~1M-parameter model and `load("draft")` the ~0.15M one;
`generate` samples from either; `infra-lab train --size target|draft` retrains them.
"""
from infra_lab.model.config import CONFIGS, ModelConfig
from infra_lab.model.generate import Generation, generate
from infra_lab.model.transformer import Transformer, load

__all__ = ["CONFIGS", "ModelConfig", "Transformer", "load", "generate", "Generation"]
