"""Helpers for the functions the tests run on gloo ranks (infra_lab.processes.run_on_ranks). A
plain module, not conftest.py: the spawned processes import it by name, and importing conftest
there would load the engine's test helpers into every rank."""
from __future__ import annotations


def error_of(function, *args) -> str | None:
    """The message of the ValueError function(*args) raises on this rank, or None."""
    try:
        function(*args)
    except ValueError as error:
        return str(error)
    return None
