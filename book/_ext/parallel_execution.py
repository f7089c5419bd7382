"""Execute the book's notebooks several at a time before Sphinx reads them.

myst-nb executes a notebook when Sphinx reads it, one after another, and most cells use one
core: a build of the whole book on a 2-core machine keeps one core idle for most of its seven
minutes. With INFRA_LAB_BOOK_JOBS=N (N > 1), this extension executes, on Sphinx's
`env-before-read-docs`, every notebook about to be read that has no match in the jupyter-cache,
N at a time, each kernel on one thread, and caches each one as myst-nb's cache mode would (same
hash, same bundle); myst-nb then finds it in the cache. A notebook that fails here is not
cached: myst-nb runs it again and fails the build with its traceback. On this 2-core machine
the whole book's build went from 441 s to 205 s with N = 2.

The default is 1, so `make book` takes every live timing on a page with the machine to itself
and its usual threads; `make test` builds with 2, since the tests need pages that build, not
undisturbed timings (a page of such a build shows one-thread timings taken beside another
notebook; its verdicts, which come from stored benchmark runs, are the same).
Before a pool starts, this machine's hardware probe (infra_lab.hardware.measure, cached per
machine for every later run) runs alone, so a probe taken beside another notebook never lands
in that cache.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from unittest import mock

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from nbclient.exceptions import CellExecutionError, CellTimeoutError
from patient_client import PatientClient  # book/_ext is on the path for the local extensions
from sphinx.util import logging

logger = logging.getLogger(__name__)
ENVIRONMENT = "INFRA_LAB_BOOK_JOBS"
THREADS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PROBE = "from infra_lab import hardware; hardware.measure('cpu', progress=False)"


def jobs() -> int:
    """Notebooks executed at once: INFRA_LAB_BOOK_JOBS, a whole number of at least 1 (default 1)."""
    value = os.environ.get(ENVIRONMENT, "").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENVIRONMENT}={value!r}: allowed is a whole number of at least 1 "
                         "(notebooks executed at once; 1 executes them one after another)")
    return int(value)


def execute_ahead(app, env, docnames) -> None:
    n_jobs = jobs()
    if n_jobs < 2 or app.config.nb_execution_mode != "cache":
        return
    cache = get_cache(app.config.nb_execution_cache_path or ".jupyter_cache")
    waiting = []  # (path, notebook): to be read, and not in the cache
    for docname in sorted(docnames):
        path = Path(env.doc2path(docname))
        if path.suffix != ".ipynb":
            continue
        notebook = nbformat.read(path, as_version=4)
        if notebook.metadata.get("mystnb", {}).get("execution_mode", "cache") != "cache":
            continue  # myst-nb executes it as its own metadata says (intro: force)
        try:
            cache.match_cache_notebook(notebook)
        except KeyError:
            waiting.append((path, notebook))
    if len(waiting) < 2:
        return
    subprocess.run([sys.executable, "-c", PROBE], check=False)  # alone, before the pool
    logger.info(f"executing {len(waiting)} notebooks, {n_jobs} at a time ({ENVIRONMENT})")
    with one_thread_each(), ThreadPoolExecutor(n_jobs) as pool:  # a kernel is a process
        running = {pool.submit(execute, path, notebook, app.config): path
                   for path, notebook in waiting}
        for done in as_completed(running):
            path, (error, seconds, late) = running[done], done.result()
            if error is not None:
                logger.info(f"{path.name} failed ahead of the read; myst-nb runs it again")
                continue
            notebook = next(nb for p, nb in waiting if p == path)  # executed in place
            record = cache.add_nb_to_project(str(path))
            cache.cache_notebook_bundle(
                CacheBundleIn(notebook, record.uri, data={"execution_seconds": seconds}),
                check_validity=False, overwrite=True)
            logger.info(f"{path.name}: executed ahead in {seconds:.1f} s and cached"
                        + (f" ({late} replies found late)" if late else ""))


def one_thread_each():
    """The kernels started inside run one thread each (numba's prange, BLAS, torch): two
    notebooks of two threads on two cores wait at every parallel region for a thread the other
    one holds (chapter 02 took 148 s beside another notebook, 46 s alone). The environment is
    put back on leaving."""
    return mock.patch.dict(os.environ, {name: "1" for name in THREADS})


def execute(path: Path, notebook, config) -> tuple[BaseException | None, float, int]:
    """What myst-nb's cache mode runs for one notebook (in its folder, with its timeout), through
    a client that cannot miss a reply (patient_client): its error, seconds, and replies found late."""
    own = notebook.metadata.get("execution", {})  # a notebook's own limits win, as in myst-nb
    client = PatientClient(notebook, timeout=own.get("timeout", config.nb_execution_timeout),
                           allow_errors=own.get("allow_errors", config.nb_execution_allow_errors),
                           resources={"metadata": {"path": str(path.parent.absolute())}},
                           record_timing=False)  # timings in the cells' metadata would change its hash
    started, error = time.perf_counter(), None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as failed:
        error = failed
    return error, time.perf_counter() - started, client.late


def setup(app):
    app.connect("env-before-read-docs", execute_ahead)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
