"""The processes of one Ray cluster that a test started (`ray start --temp-dir=DIR`), found by that
directory and killed by pid: `ray stop` kills every Ray process on the host, also the clusters of
other test files running beside it (CI runs three files at once)."""
from __future__ import annotations

from pathlib import Path

import psutil


def processes_of(folder: Path) -> list[psutil.Process]:
    """The processes a `ray start --temp-dir=FOLDER` started (each names the folder on its command
    line: the GCS, the raylet, the monitors) and everything under them (the raylet's agents and
    workers, whose command lines Ray rewrites to ray::NAME)."""
    name = str(folder)
    roots = []
    for process in psutil.process_iter(["cmdline"]):
        if any(arg.endswith(name) or f"{name}/" in arg for arg in process.info["cmdline"] or []):
            roots.append(process)
    return list({p.pid: p for root in roots for p in process_tree(root.pid)}.values())


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_processes(processes: list[psutil.Process]) -> list[str]:
    """SIGKILL every process (found before any dies: a raylet's orphans would leave its tree);
    their command lines."""
    names = []
    for process in processes:
        try:
            names.append(" ".join(process.cmdline()))
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)
    return names
