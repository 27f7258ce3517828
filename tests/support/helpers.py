"""Helpers shared by the tests (tests.support.helpers; pytest puts the repository on sys.path)."""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARM_RANKS_SITE = REPO / "tests" / "support" / "warm_ranks_site"
# for tests of the process tree itself (signals, parent death, finding a rank by its command line or
# environment): the ranks torch's agent execs, not tests/support/warm_ranks.py's forked copies
FRESH_RANKS = {"MEGAFRAME_TESTS_FRESH_RANKS": "1"}

# A model and schedule small enough for multi-rank runs on two cores; every run logs every step.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
    "model.seq_length=32", "parallel.micro_batch_size=2", "parallel.global_batch_size=8",
    "train.log_interval=1", "train.eval_interval=3", "train.eval_steps=1", "train.save_interval=0",
    "optim.warmup_steps=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous, a cluster head, a listener)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a subprocess run gets: no inherited launcher variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "LOCAL_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    # a fresh megaframe-train forks its self-launched ranks from a warm copy (tests/support/warm_ranks.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WARM_RANKS_SITE), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_cli(args: list[str], *, launcher: list[str] | None = None, cwd: Path | None = None,
            env: dict[str, str] | None = None, timeout: int = 600,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m megaframe.train ARGS` (optionally under a launcher command), capturing output.

    Without a launcher the command runs in a child forked from this worker's warm interpreter
    (tests/support/cli_zygote.py) when its environment allows it, saving the imports' 6 CPU-s; `fresh=True`
    (or an environment that differs in what is read at import) starts a new interpreter instead.
    """
    cmd = [sys.executable, *(launcher or []), "-m", "megaframe.train", *args]
    env = env or cli_env()
    if not launcher and not fresh and (zygote := _zygote_for(env)) is not None:
        return zygote.run(cmd, args, env, cwd or REPO, timeout)
    return subprocess.run(cmd, cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_code(code: str, args: list[str], *, env: dict[str, str] | None = None,
             timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in the repository, forked from the warm interpreter as run_cli's runs are
    (the imports' 6 CPU-s saved) when its environment allows it, else a new interpreter."""
    cmd = [sys.executable, "-c", code, *args]
    env = env or cli_env()
    if (zygote := _zygote_for(env)) is not None:
        return zygote.run(cmd, args, env, REPO, timeout, code=code)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_module(module: str, args: list[str], *, env: dict[str, str] | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in the repository (megaframe.plan, megaframe.eval_cli, ...: the other
    commands), forked from the warm interpreter as run_cli's runs are (their torch and DeepSpeed
    imports saved) when its environment allows it, else a new interpreter."""
    cmd = [sys.executable, "-m", module, *args]
    env = env or cli_env()
    if (zygote := _zygote_for(env)) is not None:
        # what `python -m` does: the module as __main__, sys.argv[0] its file, the directory first on sys.path
        code = f"import runpy, sys; sys.path[0] = {str(REPO)!r}; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
        return zygote.run(cmd, args, env, REPO, timeout, code=code)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# Keys a run reads only once it runs (megaframe reads no environment at import): a request whose
# environment differs from a zygote's in any other key gets a fresh interpreter.
# PYTEST_CURRENT_TEST changes with every test and nothing imports it; tests/support/warm_ranks.py reads its
# MEGAFRAME_TESTS_* switches when the launcher starts its ranks. Ray reads its RAY_* variables when a
# run imports it to launch (the zygote never imports Ray): a launcher=ray driver forks warm too. The
# device tier's report folder is read when a process exits (tests/support/fakecuda/ledger.py).
_READ_AT_RUN_TIME = ("MEGAFRAME_FAULTS", "PYTEST_CURRENT_TEST", "MEGAFRAME_TESTS_", "RAY_",
                     "MEGAFRAME_FAKE_CUDA_REPORT")
_ZYGOTES: dict[tuple[int, str], "_Zygote"] = {}  # (worker pid, kind) -> its warm interpreter


def _start_up_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_READ_AT_RUN_TIME)}


def _warm_kinds() -> dict[str, dict[str, str]]:
    """The environments a warm interpreter serves, by kind: a plain run's, and the CUDA-shaped device's
    (tests/support/fakecuda/env.py: its sitecustomize puts an interpreter on the device as it starts, so
    that zygote is on the device before it forks; each of the tier's runs would import for ~6 CPU-s)."""
    from tests.support.fakecuda.env import fake_cuda_env

    return {"cpu": _start_up_environment(cli_env()), "device": _start_up_environment(fake_cuda_env(""))}


def _zygote_for(env: dict[str, str]) -> "_Zygote | None":
    if os.environ.get("MEGAFRAME_TESTS_FRESH_CLI") == "1":
        return None
    wanted = _start_up_environment(env)
    kind = next((kind for kind, base in _warm_kinds().items() if base == wanted), None)
    if kind is None:  # any other start-up environment (a seeded mutant, another device count): a fresh one
        return None
    zygote = _ZYGOTES.get((os.getpid(), kind))
    if zygote is None or zygote.base != wanted or not zygote.alive():
        if zygote is not None:
            zygote.stop()
        zygote = _ZYGOTES[(os.getpid(), kind)] = _Zygote(wanted)
    return zygote


@atexit.register
def _stop_zygotes() -> None:
    for (pid, _), zygote in list(_ZYGOTES.items()):
        if pid == os.getpid():  # not a forked rank's copy of the parent's
            zygote.stop()


class _Zygote:
    """One of this worker's warm interpreters (tests/support/cli_zygote.py; one per kind, _warm_kinds) and
    the runs it forks, one at a time."""

    def __init__(self, base: dict[str, str]):
        self.base = base
        # unbuffered bytes: select() waits on the pipe, so no reply may sit read-ahead in a buffer
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.cli_zygote"], cwd=REPO, env=base,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """End of input ends it (it holds no run between requests)."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()

    def _reply(self, deadline: float) -> dict:
        import json
        import select

        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
            raise TimeoutError
        line = self.process.stdout.readline()  # unbuffered: reads up to this reply's newline only
        if not line:
            raise RuntimeError(f"the warm interpreter tests/support/cli_zygote.py exited ({self.process.wait()})")
        return json.loads(line)

    def run(self, cmd: list[str], args: list[str], env: dict[str, str], cwd: Path,
            timeout: float, code: str | None = None) -> subprocess.CompletedProcess:
        import json
        import signal
        import tempfile

        with tempfile.TemporaryDirectory(prefix="megaframe-cli-") as out:
            request = {"argv": list(args), "env": env, "cwd": str(cwd), "stdout": f"{out}/stdout",
                       "stderr": f"{out}/stderr", **({"code": code} if code is not None else {})}
            pending = memoryview((json.dumps(request) + "\n").encode())
            while pending:  # a raw pipe may take part of a write
                pending = pending[self.process.stdin.write(pending):]
            deadline = time.monotonic() + timeout
            pid = self._reply(time.monotonic() + 120)["pid"]
            try:
                returncode = self._reply(deadline)["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout; the zygote reaps it
                self._reply(time.monotonic() + 60)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            stdout, stderr = (Path(out, name).read_text(errors="replace") for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def read_metrics(run_dir: Path) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl."""
    from megaframe.tracking.metrics import read_metrics as read_file

    return read_file(Path(run_dir) / "metrics.jsonl")


def curve(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for every record that carries `key`."""
    return [(r["step"], r[key]) for r in records if key in r]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    """Fail with the run's output when it did not exit 0."""
    assert result.returncode == 0, f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"


def console_script(name: str) -> str:
    """The path of an installed console script (megaframe-train, megaframe-preprocess, ...) beside
    this interpreter, as `pip install -e .` puts it."""
    return str(Path(sys.executable).with_name(name))


def run_preprocess_tool(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run megaframe-preprocess as a user would: the installed console script, in a fresh interpreter
    that must find megaframe on its own."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    environment.pop("PYTHONPATH", None)
    return subprocess.run([console_script("megaframe-preprocess"), *map(str, args)],
                          cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)
