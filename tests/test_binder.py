"""Binder's environment, binder/: what the launch buttons' Binder image installs.

repo2docker (what mybinder.org builds images with) reads binder/ when there is one and then
ignores the top-level requirements.txt, whose unpinned torch would pull a CUDA build of torch:
gigabytes that a CPU-only Binder session cannot use. These tests read what binder/ asks pip for
and check that it comes to a CPU build of torch and the package itself. A pin with the local
label `+cpu` only matches the wheels on PyTorch's CPU index, never PyPI's CUDA wheel of the same
version, so the pin and that index together decide the build.
"""
import os
import re
import subprocess
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_PULLERS = re.compile(r"torch|triton|nvidia-.*")  # a CUDA build of torch or what it brings


def read_requirements(path: Path = BINDER / "requirements.txt") -> tuple[list[str], list[str]]:
    """(options, requirements): each line without its comment, options first (`--...`)."""
    options, requirements = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line:
            (options if line.startswith("-") else requirements).append(line)
    return options, requirements


def is_local(requirement: str) -> bool:
    """A path (repo2docker's rule in utils.is_local_pip_requirement: it starts with a dot)."""
    return requirement.startswith(".")


def makefile_torch_version() -> str:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    return re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_binder_holds_only_what_keeps_repo2docker_on_pip():
    """An environment.yml would make the build conda's (and runtime.txt ignored); a Dockerfile
    would make repo2docker ignore every other file."""
    assert {path.name for path in BINDER.iterdir()} == {"requirements.txt", "runtime.txt", "postBuild"}


def test_torch_is_the_makefiles_version_as_a_cpu_build_from_the_cpu_index():
    options, requirements = read_requirements()
    torch = [Requirement(r) for r in requirements
             if not is_local(r) and canonicalize_name(Requirement(r).name) == "torch"]
    assert len(torch) == 1, requirements
    (pin,) = torch[0].specifier
    assert pin.operator == "==" and pin.version == f"{makefile_torch_version()}+cpu"
    assert Version(pin.version).local == "cpu"
    assert f"--extra-index-url {CPU_INDEX}" in options or f"--index-url {CPU_INDEX}" in options


def test_nothing_else_asks_for_a_torch_that_would_pull_cuda():
    """Not binder's other lines, not the package's own dependencies, and not an extra of the
    package: pyproject's `torch` extra asks for torch>=2.1, which PyPI serves with CUDA."""
    _, requirements = read_requirements()
    others = [Requirement(r) for r in requirements if not is_local(r) and Requirement(r).name != "torch"]
    assert [r for r in others if CUDA_PULLERS.fullmatch(canonicalize_name(r.name))] == []
    extras = [re.fullmatch(r"\.(\[.*\])?", r).group(1) for r in requirements if is_local(r)]
    assert extras == [None], f"install the package without extras, not {requirements}"
    dependencies = [Requirement(d) for d in pyproject()["project"]["dependencies"]]
    assert [d for d in dependencies if CUDA_PULLERS.fullmatch(canonicalize_name(d.name))] == []
    assert any(CUDA_PULLERS.fullmatch(canonicalize_name(Requirement(d).name))
               for d in pyproject()["project"]["optional-dependencies"]["torch"])  # why no extra


def test_the_package_itself_is_installed_from_the_repository_root():
    """pip reads a local path in a requirements file from its working directory, which is the
    repository's root under repo2docker; a local reference makes repo2docker copy the whole
    repository in before it runs pip."""
    _, requirements = read_requirements()
    assert "." in requirements
    assert pyproject()["project"]["name"] == "infra-lab"
    assert "infra_lab*" in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]


def test_the_python_is_the_one_ci_tests_and_the_package_allows():
    runtime = (BINDER / "runtime.txt").read_text(encoding="utf-8").strip()
    match = re.fullmatch(r"python-(\d+\.\d+)", runtime)
    assert match, f"runtime.txt: {runtime!r} is not python-X.Y"
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text(encoding="utf-8"))
    assert match.group(1) == workflow["env"]["PYTHON_VERSION"]
    assert Version(match.group(1)) in SpecifierSet(pyproject()["project"]["requires-python"])


def test_post_build_pulls_the_pretrained_model_into_the_image():
    from infra_lab.model import pretrained

    script = BINDER / "postBuild"
    assert os.access(script, os.X_OK), "repo2docker runs postBuild only when it is executable"
    staged = subprocess.run(["git", "ls-files", "-s", str(script)], cwd=ROOT, capture_output=True, text=True)
    assert staged.stdout == "" or staged.stdout.startswith("100755"), "git must keep postBuild executable"
    text = script.read_text(encoding="utf-8")
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text
    pulled = re.findall(r"^infra-lab models pull (\S+)$", text, re.M)
    assert pulled and set(pulled) <= set(pretrained.MODELS)
