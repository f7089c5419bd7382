"""Weight files: one .npz of arrays per model (float32, or float16 for the mixture of experts), with
its config and training figures."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from infra_lab.model.config import CONFIGS, ModelConfig, weight_shapes

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def path_for(size: str) -> Path:
    return WEIGHTS_DIR / f"{size}.npz"


def save(weights: dict, config: ModelConfig, path: Path, figures: dict, dtype=np.float32) -> None:
    """Write the arrays in `dtype` (float32, or float16 to halve a large model's file; `load`
    gives float32 back either way)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"config": asdict(config), "figures": figures})
    with open(path, "wb") as handle:
        np.savez(handle, __meta__=np.frombuffer(meta.encode(), np.uint8),
                 **{name: np.asarray(value, dtype) for name, value in weights.items()})


def load(path: Path) -> tuple[dict, ModelConfig, dict]:
    """(weights, config, training figures); a missing or corrupt file names itself and the
    command that rebuilds it."""
    size = path.stem
    rebuild = f"run `infra-lab train --size {size}` to rebuild it" if size in CONFIGS else \
        f"run `infra-lab train --size {'|'.join(CONFIGS)}`"
    if not path.is_file():
        raise FileNotFoundError(f"no weight file at {path}; {rebuild}")
    try:
        with np.load(path) as archive:
            meta = json.loads(bytes(archive["__meta__"]).decode())
            weights = {name: archive[name].astype(np.float32) for name in archive.files if name != "__meta__"}
        config = ModelConfig(**meta["config"])
    except Exception as error:  # zip, json and key errors all mean the same thing here
        raise ValueError(f"weight file {path} is corrupt ({type(error).__name__}); {rebuild}") from None
    for name, shape in weight_shapes(config).items():
        if name not in weights or weights[name].shape != shape:
            got = weights[name].shape if name in weights else "missing"
            raise ValueError(f"weight file {path} is corrupt: {name} is {got}, expected {shape}; {rebuild}")
    return weights, config, meta["figures"]
