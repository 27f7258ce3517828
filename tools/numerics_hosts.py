"""Run the numerics-sensitive tests (`pytest -m numerics`) under every CPU capability this host can
run (ATEN_CPU_CAPABILITY default, avx2, avx512 where the CPU has it, and the host's own) at 1 and 2
threads in the test process (forked ranks run one thread each, as in the suite), and print the worst ratio of a tested fp32 error to its fp32 reference's own rounding
(tests/support/numerics.py). Exit 1 when any combination fails.

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


def main(pytest_args: list[str]) -> int:
    failed, worst, weakest = [], {}, {}
    files = _marked_files()
    for effective, capability in _capabilities():
        for threads in (1, 2):
            with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as report:
                pass
            env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
            # the threads of the test process (the references, the one-process tests); forked
            # ranks keep one thread each (tests/support/ranks.py): libgomp's pool does not survive a fork
            env.update(OMP_NUM_THREADS=str(threads), MEGAFRAME_NUMERICS_REPORT=report.name)
            if capability:
                env["ATEN_CPU_CAPABILITY"] = capability
            label = f"{effective} ({capability or 'host'}), {threads} thread{'s' if threads > 1 else ''}"
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "numerics", "-p", "no:cacheprovider",
                                  *files, *pytest_args], cwd=REPO, env=env, capture_output=True, text=True)
            rows = [json.loads(line) for line in Path(report.name).read_text().splitlines() if line.strip()]
            os.unlink(report.name)
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
            summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "no output"
            top = max(rows, key=lambda row: row["ratio"]) if rows else None
            if top:
                worst[label] = top
            print(f"{label}: {summary}; worst ratio {top['ratio']:.2f} ({top['what']})" if top else
                  f"{label}: {summary}", flush=True)
            if run.returncode != 0:
                failed.append(label)
                print(run.stdout[-4000:], run.stderr[-2000:], sep="\n", file=sys.stderr)
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
    sys.exit(main(sys.argv[1:]))
