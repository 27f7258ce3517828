"""Warm console scripts for shell commands: `megaframe-train`, `-eval`, `-convert`, `-plan`, `-preprocess`
and `-sample` typed in a bash script (a guide's run block, tests/e2e/test_doc_commands.py), each forked
from one warm interpreter instead of starting a new one (about 6 CPU-s of imports: torch, torch._dynamo,
DeepSpeed; over fifty commands in the guides).

How: `console_scripts(env, directory)` starts this module as a server on a Unix socket, with ENV as
its environment, and writes one small shim per console script into DIRECTORY; the environment it
returns has DIRECTORY first on PATH. bash runs a command line as written and finds the shim, which
sends its argv, environment and working directory and passes its own stdin, stdout and stderr (the
descriptors, SCM_RIGHTS) to the server. The server forks; the child becomes the console script as a
fresh interpreter would run it (the entry point named in the installed package's metadata, argv[0] the
real script, the request's environment and directory, Python's default signal handlers, its output
written straight to the shim's descriptors) and exits as an interpreter does; the shim exits with its
code (or the signal that killed it). Signals sent to the shim are passed on; a shim that dies takes
its command with it.

What still starts a fresh interpreter (the shim execs the real script): an environment that differs
from the server's in a key read at import (only the shell's own PWD/OLDPWD/SHLVL/_/PS1/PS2 and the keys
megaframe reads at run time may differ: helpers._READ_AT_RUN_TIME), a server that is gone, and every
command with MEGAFRAME_TESTS_FRESH_CLI=1. A self-launched megaframe-train forks its ranks warm as under
tests/support/warm_ranks_site (tests/support/warm_ranks.py), and a sweep's (`megaframe-train -m`) points,
each a `python -m megaframe.train POINT` of the sweep launcher (hydra_plugins/megaframe_launcher), are
forked here too, with the sweep's descriptors, environment and directory (warm_sweep_points): about 6
CPU-s of imports saved per point.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

SCRIPTS = ("megaframe-train", "megaframe-eval", "megaframe-convert", "megaframe-plan", "megaframe-preprocess",
           "megaframe-sample")
# set (or unset) by a shell, never read by megaframe at import
_SHELL_KEYS = ("PWD", "OLDPWD", "SHLVL", "_", "PS1", "PS2")  # bash unsets PS1 and PS2 when not interactive
_RUN_TIME_PREFIXES = ("MEGAFRAME_FAULTS", "PYTEST_CURRENT_TEST", "MEGAFRAME_TESTS_", "RAY_")
SWEEP_POINT = "python -m megaframe.train"  # a request's name for a sweep point (warm_sweep_points)
_SERVER: dict[str, str] = {}  # this server's address, for the sweep points its children ask for
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

# the shim: `python -S -E` (no site, no environment: about 15 ms) and the standard library only
_SHIM = '''#!{python} -SE
import json, os, signal, socket, sys
REAL, SERVER, NAME = {real!r}, {server!r}, {name!r}
def fresh():
    os.execv(REAL, [REAL, *sys.argv[1:]])
if os.environ.get("MEGAFRAME_TESTS_FRESH_CLI") == "1":
    fresh()
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(SERVER)
except OSError:
    fresh()
request = json.dumps({{"name": NAME, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode() + b"\\n"
socket.send_fds(server, [request[:1]], [0, 1, 2])
server.sendall(request[1:])
for number in {forwarded}:
    signal.signal(number, lambda number, frame: server.sendall(b'{{"signal": %d}}\\n' % number))
reply = b""
while not reply.endswith(b"\\n"):
    try:
        chunk = server.recv(4096)
    except InterruptedError:
        continue
    if not chunk:
        sys.exit("{name}: the warm interpreter tests/support/console_zygote.py went away")
    reply += chunk
answer = json.loads(reply)
if answer.get("fresh"):
    server.close()
    fresh()
code = answer["returncode"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


@contextlib.contextmanager
def console_scripts(env: dict[str, str], directory: Path) -> Iterator[dict[str, str]]:
    """ENV with DIRECTORY first on PATH, where shims of the console scripts beside this interpreter
    send each command to a warm server started here with ENV (module docstring). Without
    MEGAFRAME_TESTS_FRESH_CLI=1 in ENV; with it, ENV unchanged (every command starts fresh)."""
    if env.get("MEGAFRAME_TESTS_FRESH_CLI") == "1" or os.environ.get("MEGAFRAME_TESTS_FRESH_CLI") == "1":
        yield env
        return
    directory.mkdir(parents=True, exist_ok=True)
    # a Unix socket's path is at most 107 bytes: a short directory of its own, not pytest's tmp_path
    with tempfile.TemporaryDirectory(prefix="mf-cs-") as sockets:
        address = os.path.join(sockets, "server")
        env = {**env, "PATH": os.pathsep.join([str(directory), env.get("PATH", "")])}  # the commands' PATH
        server = subprocess.Popen([sys.executable, "-m", "tests.support.console_zygote", address],
                                  cwd=Path(__file__).resolve().parents[2], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
        try:
            if server.stdout.readline() != b"ready\n":
                raise RuntimeError(f"tests/support/console_zygote.py did not start (exit {server.wait()})")
            bin_dir = Path(sys.executable).parent
            for name in SCRIPTS:
                real = bin_dir / name
                if not real.exists():  # not installed: bash says so, as it would without the shim
                    continue
                shim = directory / name
                shim.write_text(_SHIM.format(python=sys.executable, real=str(real), server=address, name=name,
                                             forwarded=tuple(int(s) for s in _FORWARDED)))
                shim.chmod(0o755)
            yield env
        finally:
            server.stdin.close()  # end of input ends it
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


_STARTED_WITH: dict[str, str] = {}  # this server's environment before its imports
_IMPORTS_SET: dict[str, str] = {}  # what those imports added to it (torch: PYTORCH_NVML_BASED_CUDA_CHECK)


def _request_is_warm(request_env: dict[str, str]) -> bool:
    """The request's environment differs from the one this server started with only in keys nothing
    reads at import."""
    keys = set(request_env) | set(_STARTED_WITH)
    return all(request_env.get(k) == _STARTED_WITH.get(k) for k in keys
               if k not in _SHELL_KEYS and not k.startswith(_RUN_TIME_PREFIXES)
               and not (k in _IMPORTS_SET and request_env.get(k) == _IMPORTS_SET[k]))  # a forked sweep's own


def _entry_point(name: str):
    """The function the installed console script NAME calls (the package's metadata, as pip wrote the
    script), or None where the installed package has none of that name."""
    if name == SWEEP_POINT:
        return _run_module_as_main
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="console_scripts") if e.name == name]
    return found[0].load() if found else None


def _run_module_as_main() -> None:
    """What `python -m megaframe.train` runs (sys.argv set as that command has it)."""
    import runpy

    runpy.run_module("megaframe.train", run_name="__main__", alter_sys=True)


def warm_sweep_points() -> None:
    """In a sweep forked here: the sweep launcher's `python -m megaframe.train POINT` (its
    subprocess.call with that command line and no other argument) is asked of this server instead, with
    this process's descriptors, environment and directory, as the shims ask; it answers with the
    point's exit code (negative: the signal that ended it). A signal this process receives while a
    point runs is passed on to the point, as a terminal's Ctrl-C reaches both. Where the server would
    start it fresh (another environment) or is gone, subprocess.call runs it as before."""
    real_call = subprocess.call

    def call(cmd, *args, **kwargs):
        if not args and not kwargs and list(cmd[:3]) == [sys.executable, "-m", "megaframe.train"]:
            code = _ask_for_point(list(cmd[3:]))
            if code is not None:
                return code
        return real_call(cmd, *args, **kwargs)

    # this process's subprocess.call: Hydra's plugin scan re-executes the launcher's module, which
    # takes `subprocess` afresh; only the sweep's own command line is served here
    subprocess.call = call


def _ask_for_point(argv: list[str]) -> int | None:
    """The exit code of SWEEP_POINT ARGV forked by the server, or None where it must start fresh."""
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.connect(_SERVER["address"])
    except (KeyError, OSError):
        return None
    with server:
        sys.stdout.flush()
        sys.stderr.flush()
        request = json.dumps({"name": SWEEP_POINT, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(server, [request[:1]], [0, 1, 2])
        server.sendall(request[1:] + b"\n")
        reply, interrupted = b"", False
        while not reply.endswith(b"\n"):
            try:
                chunk = server.recv(4096)
            except KeyboardInterrupt:  # Ctrl-C: the point gets it too; the sweep ends once the point has
                server.sendall(b'{"signal": %d}\n' % int(signal.SIGINT))
                interrupted = True
                continue
            if not chunk:
                return None
            reply += chunk
    answer = json.loads(reply)
    if interrupted and not answer.get("fresh"):
        raise KeyboardInterrupt
    return None if answer.get("fresh") else answer["returncode"]


def _prepare() -> None:
    """What the console scripts import, once, before forking (their output kept off the protocol)."""
    from tests.support.cli_zygote import import_what_runs_import

    import_what_runs_import()
    for name in SCRIPTS:
        _entry_point(name)


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while not message.endswith(b"\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the shim went away mid-request")
        message += chunk
    return json.loads(message), fds


def _stream(fd: int, mode: str) -> io.TextIOWrapper:
    """What a fresh interpreter makes of a standard descriptor: stdout line-buffered only on a
    terminal, stderr always by line (Python >= 3.9), stdin buffered."""
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(io.FileIO(fd, "r", closefd=False)), encoding="utf-8")
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding="utf-8",
                            errors=errors, line_buffering=fd == 2 or os.isatty(fd))


def _become_the_script(request: dict, fds: list[int]) -> None:
    """In the forked child: run the console script as its fresh interpreter would, then exit. Never returns."""
    from tests.support.warm_ranks import _exit_like_an_interpreter, install_in_launcher

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGINT, *_FORWARDED):
            signal.signal(number, {signal.SIGINT: signal.default_int_handler}.get(number, signal.SIG_DFL))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = sys.__stdin__ = _stream(0, "r")
        sys.stdout = sys.__stdout__ = _stream(1, "w")
        sys.stderr = sys.__stderr__ = _stream(2, "w")
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(_IMPORTS_SET)  # as the fresh interpreter's own imports would set them
        os.chdir(request["cwd"])
        if request["name"] == SWEEP_POINT:  # `python -m`: the working directory first (argv[0]: runpy's)
            sys.argv, sys.path[0] = ["-m", *request["argv"]], os.getcwd()
        else:
            real = str(Path(sys.executable).with_name(request["name"]))
            sys.argv = [real, *request["argv"]]
            sys.path[0] = os.path.dirname(real)  # a script's directory comes first
        repo = str(Path(__file__).resolve().parents[2])
        import random

        random.seed()  # a fresh interpreter's state, not the server's copied one
        warm_site = str(Path(__file__).resolve().parent / "warm_ranks_site")
        if request["name"] in ("megaframe-train", SWEEP_POINT) and warm_site in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            from tests.support.cli_zygote import import_what_runs_import

            install_in_launcher(import_what_runs_import)  # as the sitecustomize there does for a launcher
            if {"-m", "--multirun"} & set(request["argv"]):
                warm_sweep_points()
        if warm_site in os.environ.get("PYTHONPATH", "").split(os.pathsep) and repo not in sys.path:
            sys.path.append(repo)  # that sitecustomize's own addition
        main = _entry_point(request["name"])
        try:
            code = main() or 0  # the script's sys.exit(main())
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            code = -int(signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
    finally:
        _exit_like_an_interpreter(code)


def main(address: str) -> None:
    """Serve requests on ADDRESS until stdin closes: one child per command, many at once."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: dies with its test worker
    protocol = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # nothing an import prints may reach the test's pipe
    os.close(devnull)
    _SERVER["address"] = address
    _STARTED_WITH.update(os.environ)
    _prepare()
    _IMPORTS_SET.update({k: v for k, v in os.environ.items() if _STARTED_WITH.get(k) != v})
    gc.collect()
    gc.freeze()  # a child's collections skip what the imports made (and leave those pages shared)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the pipe
    os.write(protocol, b"ready\n")
    os.close(protocol)
    children: dict[int, socket.socket | None] = {}  # None: its shim is gone, the command killed
    while True:
        watched = [listener, wake_r, sys.stdin.fileno(), *(c for c in children.values() if c is not None)]
        try:
            readable, _, _ = select.select(watched, [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(children)
        if sys.stdin.fileno() in readable and not os.read(sys.stdin.fileno(), 4096):
            break
        for pid, connection in list(children.items()):
            if connection is not None and connection in readable:
                _from_shim(pid, connection, children)
        if listener in readable:
            connection, _ = listener.accept()
            try:
                request, fds = _read_request(connection)
            except (OSError, ValueError):
                connection.close()
                continue
            if not _request_is_warm(request["env"]) or _entry_point(request["name"]) is None:
                for fd in fds:
                    os.close(fd)
                connection.sendall(b'{"fresh": true}\n')
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    if other is not None:
                        other.close()
                connection.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                _become_the_script(request, fds)
            for fd in fds:
                os.close(fd)
            children[pid] = connection
    for pid in children:  # the test worker closed the server: nothing it started outlives it
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


def _reap(children: dict[int, socket.socket | None]) -> None:
    """Reply to the shim of every command that ended."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            return
        if (connection := children.pop(pid, None)) is not None:
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()


def _from_shim(pid: int, connection: socket.socket, children: dict[int, socket.socket | None]) -> None:
    """A signal the shim received, passed on; or the shim's end (killed): its command ends too."""
    try:
        data = connection.recv(4096)
    except OSError:
        data = b""
    if not data:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        connection.close()
        children[pid] = None
        return
    for line in data.splitlines():
        with contextlib.suppress(ValueError, KeyError, ProcessLookupError):
            os.kill(pid, int(json.loads(line)["signal"]))


if __name__ == "__main__":
    main(sys.argv[1])
