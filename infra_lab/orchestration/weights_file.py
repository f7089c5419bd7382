"""Weights files that a running server may load (hot reload), checked before the engine is touched.

A reload names a file and its SHA-256. The file's bytes are hashed first, then read (the book's
.npz format, model.weights.save), then its config is compared with the served model's and every
weight's name and shape checked (model.transformer.check_state). Any mismatch is refused with
`RefusedWeights` naming what differs, and the server goes on serving the old weights.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from infra_lab.model.pretrained import sha256_of
from infra_lab.model.transformer import check_state


class RefusedWeights(ValueError):
    """A weights file that must not be served, and why."""


def read_checked(path: str, sha256: str, config) -> tuple[dict, dict]:
    """(weights, timings) from the .npz at `path` if its SHA-256 is `sha256` and its weights fit
    `config` (the served model's ModelConfig); RefusedWeights otherwise. Timings in seconds:
    hash_s (reading and hashing the file), read_s (parsing its arrays), check_s."""
    file = Path(path)
    if not isinstance(sha256, str) or len(sha256) != 64:
        raise RefusedWeights(f"sha256 must be the file's 64-hex-digit SHA-256; got {sha256!r}")
    if not file.is_file():
        raise RefusedWeights(f"no weights file at {path}")
    if file.suffix != ".npz":
        raise RefusedWeights(f"{file.name}: a reload takes the book's .npz weights format; got {file.suffix!r}")
    started = time.perf_counter()
    found = sha256_of(file)
    hashed = time.perf_counter()
    if found != sha256.lower():
        raise RefusedWeights(f"{file.name} is corrupt or not the file meant: its SHA-256 is {found}, "
                             f"expected {sha256.lower()}")
    try:
        with np.load(file) as archive:
            meta = json.loads(bytes(archive["__meta__"]).decode())
            state = {name: archive[name].astype(np.float32) for name in archive.files if name != "__meta__"}
    except Exception as error:  # zip, json and key errors all mean the file cannot be read
        raise RefusedWeights(f"{file.name} cannot be read as weights ({type(error).__name__}: {error})") from None
    read = time.perf_counter()
    served = asdict(config)
    theirs = meta.get("config", {})
    differ = sorted(key for key in served if key != "name" and theirs.get(key) != served[key])
    if differ:
        shown = ", ".join(f"{key} {theirs.get(key)!r} (serving {served[key]!r})" for key in differ)
        raise RefusedWeights(f"{file.name} holds another model: {shown}")
    try:
        check_state(config, state)
    except ValueError as error:
        raise RefusedWeights(f"{file.name}: {error}") from None
    return state, {"hash_s": hashed - started, "read_s": read - hashed, "check_s": time.perf_counter() - read}
