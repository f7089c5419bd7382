"""What a submission's run may touch, and what stops it.

Everywhere ("limits"): resource limits on CPU seconds, address space, open files, the size of a
file it writes, and processes (not for root: Linux exempts it), in a scratch folder of its own.

On Linux where util-linux's `unshare` and `setpriv` work ("namespaces"), also namespaces of its own:
- network: its own loopback only, so the servers it starts answer it and nothing else is reachable;
- mounts: a size-limited /tmp (its scratch and working folder), /dev/shm and /var/tmp; every other
  mount read-only; the submissions' and the grades' folders hidden under empty ones;
- processes: its own PID namespace and /proc, so it sees no other submission, and every process it
  starts dies with it;
then it runs with no capabilities; a grader running as root runs it as a user of its own
(uid FIRST_UID + the grading slot), so that the process limit binds and no file of root's is writable.

`python -m infra_lab.grading.contain SPEC.json` is the namespaces' first process: it sets up the
mounts as the namespaces' root, then becomes the runner (infra_lab.grading.runner).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

LEVELS = ("namespaces", "limits")
FIRST_UID = 61000  # submissions graded side by side run as 61000, 61001, ... (root graders only)
SCRATCH = Path("/tmp/submission")  # the working folder inside the namespaces


@dataclass(frozen=True)
class Budget:
    """The limits every submission's process runs under (each process it starts inherits them)."""
    cpu_s: int = 600  # CPU seconds (all threads); the wall-clock limit usually comes first
    memory_mb: int = 8192  # address space; a larger allocation raises MemoryError
    open_files: int = 512
    file_mb: int = 256  # the largest file it may write
    processes: int = 512  # processes and threads of its user (namespaces: its own user)
    scratch_mb: int = 512  # /tmp inside the namespaces

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"the {name} limit must be a whole number >= 1; got {value!r}")


def describe(level: str, budget: Budget) -> str:
    """One line for the CLI and the report: what contained the submissions."""
    limits = (f"{budget.cpu_s} CPU s, {budget.memory_mb} MB of address space, {budget.open_files} open files, "
              f"files up to {budget.file_mb} MB")
    if level == "namespaces":
        return (f"namespaces (loopback-only network, read-only files but a {budget.scratch_mb} MB /tmp, other "
                f"submissions hidden, own processes, no capabilities) and limits ({limits}, "
                f"{budget.processes} processes)")
    root = os.geteuid() == 0
    return f"limits only ({limits}" + (", processes not limited for root)" if root else f", {budget.processes} "
                                       "processes of this user)")


def available() -> str:
    """"namespaces" where a trial run of unshare and setpriv works here, else "limits"."""
    if sys.platform != "linux" or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "limits"
    trial = [*unshare_prefix(), "setpriv", "--inh-caps=-all", "--bounding-set=-all", "true"]
    try:
        done = subprocess.run(trial, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "limits"
    return "namespaces" if done.returncode == 0 else "limits"


def unshare_prefix() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--map-root-user"]  # a user namespace lets a non-root grader mount
    return ["unshare", *user, "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]


def process_limit(budget: Budget, own_user: bool) -> int | None:
    """RLIMIT_NPROC for a submission: it counts every process and thread of the user, so a run as
    the grader's own user gets what that user runs now plus the budget; None for root's own runs
    (Linux does not apply the limit to root) and where the count cannot be read."""
    if own_user:
        return budget.processes
    if os.geteuid() == 0 or not Path("/proc/self/task").is_dir():
        return None
    uid, tasks = os.geteuid(), 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                tasks += len(os.listdir(entry / "task"))
        except OSError:  # ended meanwhile
            continue
    return tasks + budget.processes


def set_limits(budget: Budget, processes: int | None) -> None:
    """The budget's resource limits on this process, soft and hard (a child inherits them)."""
    mb = 1 << 20
    pairs = [(resource.RLIMIT_CPU, budget.cpu_s), (resource.RLIMIT_AS, budget.memory_mb * mb),
             (resource.RLIMIT_NOFILE, budget.open_files), (resource.RLIMIT_FSIZE, budget.file_mb * mb),
             (resource.RLIMIT_CORE, 0)]
    if processes is not None:
        pairs.append((resource.RLIMIT_NPROC, processes))
    for kind, value in pairs:
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def command(level: str, runner_args: list[str], spec: dict, workdir: Path) -> tuple[list[str], dict]:
    """The argv that runs `python -m infra_lab.grading.runner *runner_args` under `level`, and its
    environment. `spec` (namespaces): {"hide": [folders], "slot": int, "budget": asdict(Budget)}."""
    environment = {**os.environ, "MPLBACKEND": "Agg", "HOME": str(workdir), "MPLCONFIGDIR": str(workdir)}
    runner = [sys.executable, "-m", "infra_lab.grading.runner", *runner_args]
    if level == "limits":
        return runner, environment
    if level != "namespaces":
        raise ValueError(f"unknown containment {level!r}; choose one of {', '.join(LEVELS)}")
    spec_path = workdir / "contain.json"
    root = os.geteuid() == 0
    processes = process_limit(Budget(**spec["budget"]), own_user=root)
    spec_path.write_text(json.dumps(spec | {"runner": runner_args, "root": root, "processes": processes}))
    return [*unshare_prefix(), sys.executable, "-m", "infra_lab.grading.contain", str(spec_path)], environment


# ---- inside the namespaces --------------------------------------------------------------------------------

def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _mount_points() -> list[tuple[str, str]]:
    """(mount point, its options) of every mount here, from /proc/self/mountinfo."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")  # "\040" is a space
        points.append((point, fields[5]))
    return points


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(handle, 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS


def _reachable_by_others(path: Path) -> Path | None:
    """The first folder on the way to `path` that other users cannot enter, or None."""
    walked = Path("/")
    for part in path.parts[1:]:
        walked = walked / part
        mode = walked.stat().st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return walked
    return None


def _needed(paths: list[str]) -> list[Path]:
    """The folders the runner reads its code from (the interpreter, the packages on sys.path), each
    once: none inside another, and not the working folder (the grader's scratch, on sys.path as '')."""
    found = {Path(p).resolve() for p in paths if p and Path(p).is_dir()}
    found = {p for p in found if p != Path("/tmp") and not p.is_relative_to(Path(os.getcwd()).resolve())}
    return sorted(p for p in found if not any(p != q and p.is_relative_to(q) for q in found))


def _open_up(needed: list[Path]) -> None:
    """Make each needed path (the interpreter, the package) reachable to another user: a folder on
    the way that others cannot enter (root's home) is replaced by an empty one holding only them."""
    blocked: dict[Path, list[Path]] = {}
    for path in needed:
        wall = _reachable_by_others(path)
        if wall is not None:
            blocked.setdefault(wall, []).append(path)
    for wall, paths in blocked.items():
        kept = [Path(f"/tmp/.grader/keep{i}") for i in range(len(paths))]
        for path, keep in zip(paths, kept):
            keep.mkdir(parents=True)
            _mount("--rbind", str(path), str(keep))
        _mount("-t", "tmpfs", "-o", "mode=755,size=1m", "tmpfs", str(wall))
        for path, keep in zip(paths, kept):
            path.mkdir(parents=True, exist_ok=True)
            _mount("--move", str(keep), str(path))


def _fresh_tmp(size_mb: int, staging: Path, needed: list[Path]) -> None:
    """An empty, size-limited /tmp over the grader's, holding only the folders of `needed` that
    live under /tmp (a clone there): built at `staging` (a folder of the grader's under /tmp),
    then moved onto /tmp."""
    staging.mkdir()
    _mount("-t", "tmpfs", "-o", f"mode=1777,size={size_mb}m", "tmpfs", str(staging))
    for path in needed:
        if path.is_relative_to("/tmp"):
            inside = staging / path.relative_to("/tmp")
            inside.mkdir(parents=True)
            _mount("--rbind", str(path), str(inside))
    _mount("--move", str(staging), "/tmp")


def _numba_cache(into: Path) -> None:
    """The package's compiled kernels, copied where NUMBA_CACHE_DIR points: numba writes beside
    what it reads, and the package's own folders are read-only here."""
    from numba.core.caching import _CacheLocator

    package = Path(__file__).resolve().parent.parent
    for index in package.rglob("__pycache__/*.nbi"):
        source_dir = index.parent.parent
        target = into / _CacheLocator.get_suitable_cache_subpath(str(source_dir / "x.py"))
        target.mkdir(parents=True, exist_ok=True)
        stem = index.name[:-4]
        for cached in [index, *index.parent.glob(stem + ".*.nbc")]:
            shutil.copy2(cached, target / cached.name)


def enter(spec: dict) -> None:
    """Set up the mounts, drop to the submission's user, and become the runner."""
    budget = Budget(**spec["budget"])
    results = os.open(spec["results"], os.O_WRONLY | os.O_APPEND)
    os.set_inheritable(results, True)
    plan = Path(spec["plan"]).read_bytes()
    _loopback_up()
    uid = FIRST_UID + int(spec["slot"]) if spec["root"] else None
    package = Path(__file__).resolve().parent.parent
    needed = _needed([sys.prefix, sys.base_prefix, sys.exec_prefix, str(package), *sys.path])
    _fresh_tmp(budget.scratch_mb, Path(spec["plan"]).parent / "tmp", needed)
    if uid is not None:
        _open_up(needed)
    for folder, size in (("/dev/shm", budget.scratch_mb), ("/var/tmp", 16)):
        if Path(folder).is_dir():
            _mount("-t", "tmpfs", "-o", f"mode=1777,size={size}m", "tmpfs", folder)
    for folder in spec["hide"]:  # one under /tmp is gone already, unless it holds code the runner needs
        if Path(folder).is_dir():
            _mount("-t", "tmpfs", "-o", "ro,mode=755,size=4k", "tmpfs", folder)
    writable = ("/tmp", "/dev/shm", "/var/tmp", "/proc")
    for point, options in _mount_points():
        code = any(Path(point).is_relative_to(path) for path in needed)  # the repository may live in /tmp
        if point == "/" or code or not any(point == w or point.startswith(w + "/") for w in writable):
            kept = [o for o in options.split(",") if o not in ("rw", "ro")]
            subprocess.run(["mount", "-o", ",".join(["remount", "bind", "ro", *kept]), point], capture_output=True)
    SCRATCH.mkdir()
    (SCRATCH / "plan.json").write_bytes(plan)
    _numba_cache(SCRATCH / ".numba")
    if uid is not None:
        for path in [SCRATCH, *SCRATCH.rglob("*")]:
            os.chown(path, uid, uid)
    set_limits(budget, budget.processes if uid is not None else spec["processes"])
    os.chdir(SCRATCH)
    os.environ.update(HOME=str(SCRATCH), MPLCONFIGDIR=str(SCRATCH), NUMBA_CACHE_DIR=str(SCRATCH / ".numba"),
                      TMPDIR="/tmp")
    user = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    runner = [sys.executable, "-m", "infra_lab.grading.runner", str(SCRATCH / "plan.json"),
              f"fd:{results}", *spec["runner"][2:]]
    os.execvp("setpriv", ["setpriv", *user, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                          *runner])


if __name__ == "__main__":
    enter(json.loads(Path(sys.argv[1]).read_text()))
