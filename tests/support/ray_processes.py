"""The processes of one Ray cluster that a test started (`ray start --temp-dir=DIR`), found by that
directory and killed by pid: `ray stop` kills every Ray process on the host, also the clusters of
other test files running beside it (CI runs three files at once)."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import psutil

# Ray's own side services that no test of megaframe reads, off in the environment of every Ray cluster
# and job the tests start (cluster and driver both read them; the driver passes the RAY_TRAIN_ ones to
# Ray Train's controller and workers): each is CPU on CI's two cores, and some a process per job.
# - the usage-stats report (ray start's --disable-usage-stats; the driver's ray.init reads the variable)
# - Ray core's metrics: each Ray process records and exports them every few seconds to its node's agent
# - Ray Train's metrics callbacks (in the controller and every worker)
# - Ray Train's preemption watcher: one more actor, a fresh Python process, per worker group started,
#   polling the nodes' drain state every 5 s (a spot-instance feature: nothing here is preempted)
# - the raylet's idle workers, prestarted for the first job that connects: here none of Ray Train's
#   actors took one (measured: a ray::IDLE process's ~1 CPU-s per cluster, for nothing)
# Not off but slower: the log monitor (it forwards the ranks' output to the driver, which the tests
# read) globbed the node's log folder every 0.1 s while it holds under 1,000 files, and every 0.5 s
# above (measured in test_elastic_ray: 8.6 CPU-s of log monitors before, under 0.2 after). With the
# threshold at 0 it looks for new files every 0.5 s; a new file is still read from its start, so no
# line is lost.
LEAN_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_metrics_collection": "0", "RAY_TRAIN_METRICS_ENABLED": "0",
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_prestart_worker_first_driver": "0",
            "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


def actors_started(folder: Path) -> Counter:
    """How many actors of each class the cluster of `ray start --temp-dir=FOLDER` has started so far:
    each actor's worker writes `:actor_name:CLASS` into its session log worker-*.out as it starts."""
    names = Counter()
    logs = [Path(where, name) for where, _, files in os.walk(folder)  # not through the session_latest links
            for name in files if name.startswith("worker-") and name.endswith(".out")]
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(":actor_name:"):
                names[line.removeprefix(":actor_name:").strip()] += 1
    return names


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
