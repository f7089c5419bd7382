"""What `pip install` of the repository (as the Colab setup cell does) actually ships."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_module_and_the_trained_weights(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "infra_lab", source / "infra_lab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    names = zipfile.ZipFile(next(tmp_path.glob("infra_lab-*.whl"))).namelist()
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "infra_lab").rglob("*.py")}
    assert sources <= set(names)
    assert {"infra_lab/model/weights/target.npz", "infra_lab/model/weights/draft.npz"} <= set(names)
    assert any(name.endswith("entry_points.txt") for name in names)
