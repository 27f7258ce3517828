"""`python -m megaframe.launch.node_agent TORCHRUN_FLAGS -m megaframe.train OVERRIDES`: what every node of
an elastic job runs (launch/elastic.py torchrun_args, the node script and the SLURM script).

It is torchrun's elastic agent with torchrun's own flags, run in this process as megaframe-train's
self-launch runs it (launch/local.py run_agent), for two reasons:
- The node ends with the job's exit code (3 for a divergence, 4-7 for the other documented causes:
  docs/failures.md), which a scheduler can act on. torchrun's is 1 for every failure.
- torchrun ends a failed job with its failure report, a Python traceback, on every node's terminal.
  The failing rank has already printed its one line, and its traceback is in RUN_DIR/logs.
The agent's log lines (an attempt that failed, a restart, a node that left) stay, since on an elastic
job they say what happened."""
from __future__ import annotations

import sys

from megaframe.launch.local import run_agent


def main() -> None:
    sys.exit(run_agent(sys.argv[1:]))


if __name__ == "__main__":
    main()
