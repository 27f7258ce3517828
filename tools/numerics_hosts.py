"""Run the numerics-sensitive tests (`pytest -m numerics`) under every CPU capability this host can
run (ATEN_CPU_CAPABILITY default, avx2, avx512 where the CPU has it, and the host's own) at 1 and 2
threads in the test process (forked ranks run one thread each, as in the suite), and print the worst ratio of a tested fp32 error to its fp32 reference's own rounding
(tests/support/numerics.py). Exit 1 when any combination fails. One interpreter per capability
collects the tests once and forks one child per thread count (_per_thread_count).

    python tools/numerics_hosts.py            # the whole matrix
    python tools/numerics_hosts.py -k ring    # extra pytest arguments narrow it

Run it before changing tests/support/numerics.py's FACTOR; tests/e2e/test_numerics_hosts.py runs it in CI.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDER = ("DEFAULT", "AVX2", "AVX512")  # what torch's CPU kernels are built for, narrowest first


def _host_capability() -> str:
    """The widest capability torch picks on this CPU by itself. A wider one forced through
    ATEN_CPU_CAPABILITY is not refused: its kernels die of an illegal instruction."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _capabilities() -> list[tuple[str, str | None]]:
    """(label, ATEN_CPU_CAPABILITY value; None = unset) for every capability up to the host's."""
    host = _host_capability()
    runnable = ORDER[: ORDER.index(host) + 1] if host in ORDER else ("DEFAULT",)
    return [(name, name.lower()) for name in runnable if name != host] + [(host, None)]


def _marked_files() -> list[str]:
    """The test files that mark tests `numerics`: collecting only them, not all of tests/, saves
    about 10 CPU-s of imports per combination."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.numerics" in path.read_text())


_MARK = "@@numerics-hosts"  # the lines the one-capability interpreter puts between its thread counts' outputs
THREADS = (1, 2)


def _per_thread_count(pytest_args: list[str], reports: list[str]) -> None:
    """In one interpreter per capability: pytest collects once (the imports of torch, torch._dynamo,
    torchao and the test files, about 6 CPU-s), then one forked child per thread count runs the
    tests, with that many threads (torch.set_num_threads, what OMP_NUM_THREADS gives at start-up) and
    OMP_NUM_THREADS and its report file in its environment (the processes it starts: forked ranks keep
    one thread each, a `python -c` child reads them). This interpreter itself never starts a thread
    pool (it runs at OMP_NUM_THREADS=1), so each child starts its own, as a fresh interpreter would.
    Its stdout: each child's pytest output between marker lines, with the child's exit code."""
    import pytest

    class ForkPerThreadCount:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(self, session):
            for threads, report in zip(THREADS, reports):
                print(f"{_MARK} threads {threads}", flush=True)
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    import torch

                    os.environ.update(OMP_NUM_THREADS=str(threads), MEGAFRAME_NUMERICS_REPORT=report)
                    torch.set_num_threads(threads)
                    return None  # this child runs the tests: pytest's own loop comes next
                _, status = os.waitpid(pid, 0)
                print(f"\n{_MARK} exit {os.waitstatus_to_exitcode(status)}", flush=True)
            sys.stderr.flush()
            os._exit(0)  # the children reported; nothing of this session is left to run or print

    sys.exit(pytest.main(pytest_args, plugins=[ForkPerThreadCount()]))


def _split(stdout: str) -> dict[int, tuple[str, int]]:
    """Each thread count's (pytest output, exit code) from _per_thread_count's stdout; a thread count
    that never ended (the interpreter died) is missing."""
    found, threads, lines = {}, None, []
    for line in stdout.splitlines():
        if line.startswith(f"{_MARK} threads "):
            threads, lines = int(line.split()[-1]), []
        elif line.startswith(f"{_MARK} exit ") and threads is not None:
            found[threads] = ("\n".join(lines), int(line.split()[-1]))
            threads = None
        elif threads is not None:
            lines.append(line)
    return found


def main(pytest_args: list[str]) -> int:
    failed, worst, weakest = [], {}, {}
    files = _marked_files()
    for effective, capability in _capabilities():
        reports = []
        for _ in THREADS:
            with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as report:
                reports.append(report.name)
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        # the collecting interpreter at one thread (_per_thread_count); each child sets its own count
        env["OMP_NUM_THREADS"] = "1"
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        args = ["-q", "-m", "numerics", "-p", "no:cacheprovider", *files, *pytest_args]
        run = subprocess.run([sys.executable, __file__, "--per-thread-count", ",".join(reports), *args], cwd=REPO,
                             env=env, capture_output=True, text=True)
        outputs = _split(run.stdout)
        for threads, report_name in zip(THREADS, reports):
            label = f"{effective} ({capability or 'host'}), {threads} thread{'s' if threads > 1 else ''}"
            stdout, returncode = outputs.get(threads, (run.stdout, run.returncode or 1))
            rows = [json.loads(line) for line in Path(report_name).read_text().splitlines() if line.strip()]
            os.unlink(report_name)
            # the seeded mutants' comparisons (named "mutant ...") are meant to fail: the smallest
            # ratio among each mutant's tensors says by how much the bound still catches it
            mutants: dict[str, float] = {}
            for row in rows:
                if row["what"].startswith("mutant"):
                    name = row["what"].split()[1]
                    mutants[name] = max(mutants.get(name, 0.0), row["ratio"])
            rows = [row for row in rows if not row["what"].startswith("mutant")]
            if mutants:
                weakest[label] = min(mutants.items(), key=lambda item: item[1])
            summary = stdout.strip().splitlines()[-1] if stdout.strip() else "no output"
            top = max(rows, key=lambda row: row["ratio"]) if rows else None
            if top:
                worst[label] = top
            print(f"{label}: {summary}; worst ratio {top['ratio']:.2f} ({top['what']})" if top else
                  f"{label}: {summary}", flush=True)
            if returncode != 0:
                failed.append(label)
                print(stdout[-4000:], run.stderr[-2000:], sep="\n", file=sys.stderr)
    if worst:
        label, top = max(worst.items(), key=lambda item: item[1]["ratio"])
        print(f"worst over the matrix: {top['ratio']:.2f} x the fp32 reference's rounding, {top['what']}, {label}")
    if weakest:
        label, (name, ratio) = min(weakest.items(), key=lambda item: item[1][1])
        print(f"weakest seeded mutant: {name} at {ratio:.3g} x the fp32 reference's rounding, {label}")
    if failed:
        print(f"failed under: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--per-thread-count"]:
        _per_thread_count(sys.argv[3:], sys.argv[2].split(","))
    sys.exit(main(sys.argv[1:]))
