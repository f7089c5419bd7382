"""Start `infra-lab serve` or `infra-lab route` as a process of its own and stop it: what the
tests, the benchmarks, the chapter and a rolling update do.

A command started with `--port 0` binds a free port and, once it answers requests, prints one
line: `listening on http://HOST:PORT` (`announce`). `start` waits for that line, so there is no
race for a port and no polling. `stop` sends SIGTERM (the server drains what is in flight) and
waits; a process that does not stop in time is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

ANNOUNCE = "listening on "


def announce(host: str, port: int) -> None:
    """The line `start` waits for: printed by the server or router once it takes requests."""
    print(f"{ANNOUNCE}http://{host}:{port}", flush=True)


class Launched:
    """A running `infra-lab` server or router: its `url`, its recent output, and `stop`."""

    def __init__(self, process: subprocess.Popen, url: str, lines: deque):
        self.process, self.url, self.lines = process, url, lines

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed worker does."""
        if self.alive:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait; killed if it has not stopped within `timeout_s`. Its exit status."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start(command: str, args: list[str], timeout_s: float = 120.0, env: dict | None = None,
          threads: int | None = None) -> Launched:
    """Run `infra-lab COMMAND ARGS... --port 0` and wait until it listens. `threads` caps its
    kernels' CPU threads (numba, BLAS, torch). Raises RuntimeError with its output if it exits
    or stays silent for `timeout_s`."""
    return begin(command, args, env, threads).wait(timeout_s)


def start_together(commands: list[tuple[str, list[str]]], timeout_s: float = 120.0,
                   threads: int | None = None) -> list[Launched]:
    """Start several commands at once and wait for all (the workers of a disaggregated deployment
    wait for each other before they listen); if one fails, the others are stopped."""
    pending = [begin(command, args, threads=threads) for command, args in commands]
    started = []
    try:
        for each in pending:
            started.append(each.wait(timeout_s))
    except RuntimeError:
        for each in pending:
            each.launched.kill()
        raise
    return started


class Starting:
    """A command started, not yet listening: `wait` for its address."""

    def __init__(self, command: str, args: list[str], process: subprocess.Popen):
        self.command, self.args, self.process = command, args, process
        self.lines: deque[str] = deque(maxlen=400)
        self.found: list[str] = []
        self.listening = threading.Event()
        self.launched = Launched(process, "", self.lines)
        threading.Thread(target=self._read, daemon=True, name=f"infra-lab-{command}-output").start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if not self.found and line.startswith(ANNOUNCE):
                self.found.append(line[len(ANNOUNCE):].strip())
                self.listening.set()
        self.listening.set()  # the process closed its output: it has exited

    def wait(self, timeout_s: float = 120.0) -> Launched:
        deadline = time.monotonic() + timeout_s
        self.listening.wait(timeout_s)
        if not self.found:
            if self.process.poll() is None and time.monotonic() >= deadline:
                self.process.kill()
            self.process.wait()
            raise RuntimeError(f"`infra-lab {self.command} {' '.join(self.args)}` did not start "
                               f"(exit {self.process.returncode}):\n" + "".join(self.lines)[-4000:])
        self.launched.url = self.found[0]
        return self.launched


def begin(command: str, args: list[str], env: dict | None = None, threads: int | None = None) -> Starting:
    """Run `infra-lab COMMAND ARGS... --port 0` without waiting for it."""
    if command not in ("serve", "route"):
        raise ValueError(f"command must be 'serve' or 'route'; got {command!r}")
    environment = dict(os.environ if env is None else env)
    environment["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            environment[name] = str(threads)
    process = subprocess.Popen([sys.executable, "-m", "infra_lab.cli", command, *args, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    return Starting(command, args, process)


class InThread:
    """A FastAPI app served by uvicorn from a thread of this process (a notebook's router with a
    policy of one's own, say): its `url`, and `stop`."""

    def __init__(self, app, host: str = "127.0.0.1", timeout_s: float = 30.0):
        import socket

        import uvicorn

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self.url = f"http://{host}:{self._listener.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._listener]},
                                        daemon=True, name="infra-lab-in-thread")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the app did not start serving on {self.url} within {timeout_s} s")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
