"""A warm `python -m megaframe.train`: one interpreter per pytest worker that has already imported
what every training run imports, and forks one child per command (tests/support/helpers.py run_cli).

Why: a dp=1 tiny run costs about 8 CPU-s, of which about 6 are imports (torch 2, torch._dynamo 2
through torch's Optimizer, DeepSpeed's Muon module 2 through torch.compile at ZeRO >= 1). The suite
starts a few hundred such runs on a 2-core CI host.

What a child gets is what a fresh `python -m megaframe.train ARGS` in CWD with ENV gets: this
process was itself started as a fresh interpreter with the base environment (no pytest in it), a
request is served only when its environment differs from that base in keys megaframe reads at run
time (helpers.py decides), and the child applies argv, cwd, environment, sys.path[0], stdin from
/dev/null and its own stdout/stderr files before running megaframe.train as __main__. It then exits
as an interpreter does (atexit handlers, non-daemon threads joined, the run's own garbage collected,
the streams flushed), with the code megaframe chose; what it skips is Python's teardown of every
module the zygote imported, which copied most of the zygote's pages into each child: 1.1 of the 1.4
CPU-s a refusal forked here used to cost (0.3 now; a fresh interpreter's refusal is 0.4). The zygote
freezes its imports' objects (gc.freeze) so that no child's collection walks them either.

Protocol (one JSON object a line): request {"argv", "env", "cwd", "stdout", "stderr"} on stdin (with
"code": `python -c CODE ARGV` instead, for a test that patches something before megaframe runs);
replies {"pid"} once forked, then {"pid", "returncode"} (negative: killed by that signal).
EOF on stdin ends this process.
"""
from __future__ import annotations

import io
import json
import os
import random
import runpy
import sys


def import_what_runs_import() -> None:
    """What every training run imports, done once before forking: by this zygote, and by the pytest
    worker before run_ranks forks its ranks (tests/support/ranks.py). Importing this module does nothing else."""
    import torch._dynamo  # noqa: F401  (torch's Optimizer.step imports it)
    import torch.distributed.run  # noqa: F401  (self-launch)

    import megaframe.launch.main  # noqa: F401
    import megaframe.launch.local  # noqa: F401  (its launcher, imported by name when a run starts)
    import megaframe.training.trainer  # noqa: F401
    import megaframe.backends.deepspeed.engine  # noqa: F401
    from megaframe.backends.deepspeed.muon_import import import_muon_lazily
    import_muon_lazily()  # as every ZeRO rank does before deepspeed.initialize


# What this interpreter's start did to the environment it was given (main fills it in): a fresh interpreter
# started with a request's environment does the same to that, so each child does too. The device tier's
# sitecustomize removes DS_ACCELERATOR once DeepSpeed has its device accelerator (fakecuda/__init__.py).
_START_UP_CHANGES: tuple[dict[str, str], set[str]] = ({}, set())


def _environment_changes_since_start() -> tuple[dict[str, str], set[str]]:
    """(keys set or changed, keys removed) between the environment this process was started with (Linux
    keeps it in /proc/self/environ, whatever os.environ did since) and os.environ now."""
    with open("/proc/self/environ", "rb") as f:
        entries = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
    started = {os.fsdecode(key): os.fsdecode(value) for key, value in entries}
    now = dict(os.environ)
    return {k: v for k, v in now.items() if started.get(k) != v}, set(started) - set(now)


def _text_stream(fd: int, line_buffering: bool) -> io.TextIOWrapper:
    """What a fresh interpreter makes of a non-tty fd: stdout block-buffered, stderr by line."""
    raw = io.FileIO(fd, "w", closefd=False)
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=line_buffering)


def _become_the_command(request: dict, protocol: tuple[io.TextIOWrapper, io.TextIOWrapper]) -> None:
    """In the forked child: turn into `python -m megaframe.train ARGV` and never return."""
    for stream in protocol:
        stream.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = _text_stream(1, line_buffering=False)
    sys.stderr = sys.__stderr__ = _text_stream(2, line_buffering=True)
    os.environ.clear()
    os.environ.update(request["env"])
    set_at_start, removed_at_start = _START_UP_CHANGES
    os.environ.update(set_at_start)
    for key in removed_at_start:
        os.environ.pop(key, None)
    os.chdir(request["cwd"])
    from tests.support.warm_ranks import install_in_launcher

    install_in_launcher(import_what_runs_import)  # a self-launch's ranks fork from a copy of this one
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    random.seed()  # a fresh interpreter's state, not the zygote's copied one
    _exit_like_an_interpreter(_run(request))


def _run(request: dict) -> int:
    """The command's exit code as the interpreter would give it (negative: the signal it ends by)."""
    import signal

    try:
        if "code" in request:  # `python -c CODE ARGV`: its sys.path[0] is '' and its sys.argv[0] '-c'
            sys.path[0] = ""
            sys.argv = ["-c", *request["argv"]]
            try:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            except Exception:  # as the interpreter reports it: the traceback from the code's own frames, exit 1
                import traceback

                kind, err, frames = sys.exc_info()
                traceback.print_exception(kind, err, frames.tb_next)
                return 1
            return 0
        # `python -m` leaves the module's path in sys.argv[0] for the life of the process (what an exit
        # handler reads: the device tier's report); run_module would restore whatever was there before
        import importlib.util

        sys.argv = [importlib.util.find_spec("megaframe.train").origin, *request["argv"]]
        runpy.run_module("megaframe.train", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the traceback, then death by SIGINT, as Python >= 3.8 ends
        sys.excepthook(*sys.exc_info())
        return -int(signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _exit_like_an_interpreter(code: int) -> None:
    """Py_FinalizeEx's order for what a run can observe (warm_ranks' exit, with the run's own garbage
    collected: the zygote's objects are frozen), without tearing down the zygote's modules."""
    from tests.support.warm_ranks import _exit_like_an_interpreter as exit_warm

    exit_warm(code, collect=True)


def main() -> None:
    protocol_in = os.dup(0)
    protocol_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # nothing an import prints (DeepSpeed's accelerator warning) may reach the protocol pipe
    os.close(devnull)
    import_what_runs_import()
    global _START_UP_CHANGES
    _START_UP_CHANGES = _environment_changes_since_start()
    import gc

    gc.collect()
    gc.freeze()  # no child's collection (nor its exit) walks, and so copies, what the imports made
    requests = os.fdopen(protocol_in, "r", encoding="utf-8")
    replies = os.fdopen(protocol_out, "w", encoding="utf-8")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _become_the_command(request, (requests, replies))
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)  # never back into the zygote's loop (it exits above; here only if it failed)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
