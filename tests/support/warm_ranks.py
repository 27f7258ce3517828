"""Warm ranks for megaframe-train's self-launch, in the tests only: torch's elastic agent starts each
rank as a fresh `python -u -m megaframe.train ...` (about 5.6 CPU-s of imports each, over a hundred
ranks per CI run on two cores); here a copy of the launcher forks them instead.

How (install_in_launcher, called in a megaframe-train launcher process by tests/support/cli_zygote.py or a
test sitecustomize):
- torch.distributed.run.run is wrapped: before the agent starts (while the launcher has one thread),
  the launcher makes itself a child subreaper and forks a zygote, which imports what every run
  imports (cli_zygote.import_what_runs_import) and waits for requests on a pipe.
- SubprocessHandler._popen is wrapped: a `python -u -m megaframe.train` rank is requested from the
  zygote, which double-forks it. The middle process exits at once, so the rank is re-parented to
  the launcher (the subreaper): its parent is the launcher, as a Popen child's is, so the agent can
  wait for it and megaframe's die_with_launcher sees the launcher as its parent.
- The rank then makes itself what Popen(start_new_session=True) would start: a new session, the
  request's environment, -u's unbuffered stdio, Python's default signal handlers, no descriptor a
  fresh exec would have closed, argv and sys.path[0] as `python -m` sets them; it runs
  megaframe.train as __main__ and exits as an interpreter does (non-daemon threads joined, atexit
  handlers, streams flushed) with the code the run chose.
- Anything else (redirected streams, another entry point, a launcher that already runs threads)
  goes through torch's own Popen, as does everything with MEGAFRAME_TESTS_FRESH_RANKS=1.
- torchrun itself (`python -m torch.distributed.run ... -m megaframe.train`: the elastic tests' nodes,
  --max-restarts jobs) runs its own copy of torch.distributed.run as __main__, whose `run` no wrap
  reaches: install_in_agent wraps the agent's entry below it instead (launcher.api.launch_agent), so
  every restart of that agent's workers forks its ranks warm as well. The rank zygote is named
  ZYGOTE_NAME (its /proc comm), so a test that picks ranks among the agent's children can tell it
  from them; each rank takes back the name a fresh exec would have.
"""
from __future__ import annotations

import ctypes
import gc
import io
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import types

FRESH_RANKS = "MEGAFRAME_TESTS_FRESH_RANKS"
SPAWN_LOG = "MEGAFRAME_TESTS_WARM_RANKS_LOG"  # a file: one line per rank forked warm (the self-test's)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_MODULE = "megaframe.train"
# what a fresh interpreter's Python-level handlers are; everything else is SIG_DFL
_PYTHON_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                    signal.SIGXFSZ: signal.SIG_IGN}
_ZYGOTE: dict[str, "_RankZygote | None"] = {"current": None}
ZYGOTE_NAME = "mf-rank-zygote"  # the rank zygote's process name (psutil's name(), /proc/PID/comm)
_PR_SET_NAME = 15
_TORCHRUN = "torch.distributed.run"
_LAUNCHER_API = "torch.distributed.launcher.api"  # where torchrun's __main__ finds launch_agent


def _wanted() -> bool:
    """Not switched off, and this process is not a rank itself (a rank launches nothing)."""
    return os.environ.get(FRESH_RANKS) != "1" and "LOCAL_RANK" not in os.environ and "RANK" not in os.environ


def is_megaframe_launcher() -> bool:
    """This process was started as `megaframe-train` / `python -m megaframe.train`."""
    argv = list(getattr(sys, "orig_argv", []))
    return (_MODULE in argv and argv[argv.index(_MODULE) - 1] == "-m") or any(
        a.endswith("/megaframe-train") for a in argv[:2])


def is_torchrun_of_megaframe() -> bool:
    """This process is torchrun's agent for megaframe ranks: `python -m torch.distributed.run ...
    -m megaframe.train ...` (or the `torchrun` script)."""
    argv = list(getattr(sys, "orig_argv", []))
    return is_megaframe_launcher() and (argv[1:3] == ["-m", _TORCHRUN] or
                                        (len(argv) > 1 and os.path.basename(argv[1]) == "torchrun"))


def _after_import(module_name: str, then) -> None:
    """then() once `module_name` is imported (executed as a module, not run as __main__)."""
    import importlib.abc
    import importlib.util

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                then()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())


def install_when_torch_run_is_imported() -> None:
    """For a sitecustomize: install_in_launcher once megaframe imports torch.distributed.run (its
    self-launch), so that runs which never launch ranks do not import torch for it; in torchrun's
    own process, install_in_agent once torchrun imports its launcher API."""
    if not _wanted() or not is_megaframe_launcher():
        return
    if is_torchrun_of_megaframe():
        if _LAUNCHER_API in sys.modules:  # imported already (the CUDA-shaped device's set-up)
            install_in_agent()
        else:
            _after_import(_LAUNCHER_API, install_in_agent)
    elif _TORCHRUN in sys.modules:  # imported already (the CUDA-shaped device's set-up)
        install_in_launcher()
    else:
        _after_import(_TORCHRUN, install_in_launcher)


def install_in_launcher(prepare=None) -> None:
    """Wrap torch's launcher entry and its rank Popen (idempotent). `prepare` imports what every rank
    imports (cli_zygote.import_what_runs_import unless given). Nothing in a rank or with
    MEGAFRAME_TESTS_FRESH_RANKS=1."""
    if not _wanted():
        return
    import torch.distributed.run as torch_run

    if prepare is None:
        from tests.support.cli_zygote import import_what_runs_import as prepare

    if getattr(torch_run.run, "_warm_ranks", False):
        return
    original_run = torch_run.run

    def run(args):
        return _with_zygote(prepare if _runs_megaframe(args) else None, lambda: original_run(args))

    run._warm_ranks = True
    torch_run.run = run
    _wrap_rank_popen()


def install_in_agent(prepare=None) -> None:
    """In torchrun's own process (is_torchrun_of_megaframe): wrap launch_agent, which its __main__
    reaches through elastic_launch (looked up by name at each call), and the rank Popen (idempotent).
    The zygote lives as long as the agent, over every restart of its workers."""
    if not _wanted():
        return
    import torch.distributed.launcher.api as api

    if prepare is None:
        from tests.support.cli_zygote import import_what_runs_import as prepare

    if getattr(api.launch_agent, "_warm_ranks", False):
        return
    original_launch = api.launch_agent

    def launch_agent(config, entrypoint, args, *more, **options):
        runs = isinstance(entrypoint, str) and _megaframe_args((entrypoint, *map(str, args))) is not None
        return _with_zygote(prepare if runs else None,
                            lambda: original_launch(config, entrypoint, args, *more, **options))

    launch_agent._warm_ranks = True
    api.launch_agent = launch_agent
    _wrap_rank_popen()


def _with_zygote(prepare, launch):
    """launch() with a rank zygote serving the agent's Popen of megaframe ranks (prepare None: none)."""
    zygote = _RankZygote.start(prepare) if prepare is not None else None
    _ZYGOTE["current"] = zygote
    try:
        return launch()
    finally:
        _ZYGOTE["current"] = None
        if zygote is not None:
            zygote.stop()


def _wrap_rank_popen() -> None:
    """The agent's Popen of a `python -u -m megaframe.train` rank asks the current zygote instead."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    if getattr(subprocess_handler.SubprocessHandler._popen, "_warm_ranks", False):
        return
    original_popen = subprocess_handler.SubprocessHandler._popen

    def _popen(self, args, env):
        zygote = _ZYGOTE["current"]
        module_args = _megaframe_args(args)
        if zygote is None or module_args is None or self._stdout is not None or self._stderr is not None:
            return original_popen(self, args, env)
        return zygote.spawn(list(args), module_args, env)

    _popen._warm_ranks = True
    subprocess_handler.SubprocessHandler._popen = _popen


def _runs_megaframe(args) -> bool:
    return bool(getattr(args, "module", False)) and getattr(args, "training_script", None) == _MODULE


def _megaframe_args(args: tuple) -> list[str] | None:
    """ARGS of (python, [-u], -m, megaframe.train, ARGS...), else None."""
    args = [str(a) for a in args]
    if len(args) < 3 or args[0] != sys.executable:
        return None
    flags = args[1:args.index("-m")] if "-m" in args else None
    if flags is None or set(flags) - {"-u"} or args[len(flags) + 2] != _MODULE:
        return None
    return args[len(flags) + 3:]


def _prctl(option: int, value) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


def _set_name(name: str) -> None:
    """This process's name (/proc/self/comm, 15 bytes at most)."""
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:15]))


class _ForkedRank:
    """What the agent uses of a Popen (poll, wait, pid; it signals the rank's process group itself)
    for a rank this process did not exec."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


class _RankZygote:
    """The launcher's forked copy that forks its ranks; it ends when the launcher closes the pipe
    or dies."""

    @classmethod
    def start(cls, prepare) -> "_RankZygote | None":
        if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
            return None  # a fork would copy a thread's locks without the thread: fresh ranks instead
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        return cls(prepare)

    def __init__(self, prepare):
        self.launcher = os.getpid()
        self.lock = threading.Lock()
        requests_r, self.requests = os.pipe()
        self.replies, replies_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self.requests)
                os.close(self.replies)
                _serve(requests_r, replies_w, self.launcher, prepare)
            finally:
                os._exit(0)  # never back into the launcher's frames
        os.close(requests_r)
        os.close(replies_w)
        self.replies_file = os.fdopen(self.replies, "rb", buffering=0)

    def spawn(self, args: list[str], module_args: list[str], env: dict[str, str]) -> _ForkedRank:
        request = json.dumps({"argv": module_args, "env": dict(env), "unbuffered": "-u" in args[1:3]}) + "\n"
        with self.lock:
            view = memoryview(request.encode())
            while view:
                view = view[os.write(self.requests, view):]
            line = self.replies_file.readline()
        if not line:
            raise RuntimeError("tests/support/warm_ranks.py: the rank zygote exited")
        pid = int(json.loads(line)["pid"])
        if log := os.environ.get(SPAWN_LOG):
            with open(log, "a", encoding="utf-8") as spawned:
                spawned.write(json.dumps({"pid": pid, "launcher": self.launcher, "rank": env.get("RANK")}) + "\n")
        return _ForkedRank(pid, args)

    def stop(self) -> None:
        os.close(self.requests)
        self.replies_file.close()
        os.waitpid(self.pid, 0)


def _serve(requests_fd: int, replies_fd: int, launcher: int, prepare) -> None:
    """The zygote: dies with the launcher, ignores the signals meant for it, imports, forks ranks."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != launcher:
        return
    fresh_name = os.path.basename(sys.executable)  # an exec'd rank's name, which each rank takes back
    _set_name(ZYGOTE_NAME)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the launcher's group
    prepare()  # what every rank imports, once
    gc.collect()
    gc.freeze()  # the launcher's objects are never finalised here (their descriptors are closed below)
    requests = os.fdopen(requests_fd, "r", encoding="utf-8")
    for line in requests:
        request = json.loads(line)
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(pid_r)
            rank = os.fork()
            if rank == 0:
                os.close(pid_w)
                _set_name(fresh_name)
                _become_the_rank(request, launcher)
            os.write(pid_w, str(rank).encode())
            os._exit(0)  # the rank is re-parented to the launcher, the subreaper
        os.close(pid_w)
        os.waitpid(middle, 0)  # after this the rank's parent is the launcher
        with os.fdopen(pid_r, "rb") as pid_file:
            rank_pid = int(pid_file.read())
        os.write(replies_fd, (json.dumps({"pid": rank_pid}) + "\n").encode())


def _become_the_rank(request: dict, launcher: int) -> None:
    """In the forked rank: become `python -u -m megaframe.train ARGV` started by the launcher's Popen,
    run it, and exit with its code. Never returns."""
    code = 1
    try:
        while os.getppid() != launcher:  # the middle process is exiting
            time.sleep(0.001)
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, _PYTHON_DEFAULTS.get(sig, signal.SIG_DFL))
        _close_what_exec_closes()
        if request["unbuffered"]:
            sys.stdout = sys.__stdout__ = _unbuffered(1)
            sys.stderr = sys.__stderr__ = _unbuffered(2)
        os.environ.clear()
        os.environ.update(request["env"])
        if "OMP_NUM_THREADS" in os.environ:  # read once at import by a fresh interpreter's OpenMP
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
        random.seed()
        sys.argv = ["-m", *request["argv"]]
        code = _run_as_main()
    finally:
        _exit_like_an_interpreter(code)


def _close_what_exec_closes() -> None:
    """Descriptors other than 0-2 that a fresh exec would not have (Python opens them close-on-exec)."""
    import fcntl

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                if fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                    os.close(fd)
            except OSError:
                pass  # the listing's own descriptor


def _unbuffered(fd: int) -> io.TextIOWrapper:
    """What `python -u` makes of a standard stream: text written straight through to the descriptor."""
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors,
                            write_through=True)


def _run_as_main() -> int:
    """megaframe.train as `python -m` runs it (in a new __main__, argv[0] its file for good); the exit
    code the interpreter would give."""
    try:
        sys.modules["__main__"] = types.ModuleType("__main__")
        runpy._run_module_as_main(_MODULE, alter_argv=True)
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return -int(signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _exit_like_an_interpreter(code: int, collect: bool = False) -> None:
    """Py_FinalizeEx's order: non-daemon threads, atexit handlers, (collect: the run's own garbage,
    so a __del__ that prints still prints), the standard streams; then the exit, without tearing
    down the warm process's modules."""
    try:
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
        if collect:
            gc.collect()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code < 0:  # killed by a signal it did not handle (Ctrl-C): end the same way
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)
