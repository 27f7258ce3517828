"""Compose conf/ (and recipes/) with command-line overrides into the typed TrainConfig.

The one place Hydra's composition runs: the CLI, the planner and the tests all call compose().
Every Hydra/OmegaConf error becomes a one-line ConfigError naming the key and the fix.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from megaframe.config.empty_values import empty_override_problem, run_dir_problem
from megaframe.config.schema import TrainConfig
from megaframe.config.store import register_configs, unknown_recipe
from megaframe.config.validate import ConfigError
from megaframe.common.paths import conf_dir


def _one_line(ex: BaseException) -> str:
    """Hydra/OmegaConf errors are multi-line; users get the key, the problem and the fix in one line."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = ex.__cause__ if isinstance(ex.__cause__, OmegaConfBaseException) else ex
    if isinstance(ex, RecursionError):  # "maximum recursion depth exceeded in comparison", naming nothing
        return ("the configs' defaults lists include one another in a loop (Python's recursion limit ended the "
                "composition); check the defaults: of the files in your --config-dir folders")
    if isinstance(ex, MissingConfigException) and ex.options:
        parts = (ex.missing_cfg_file or "?/?").split("/")
        # the group is the path up to its last name, or up to a `..` the option held (data=../../etc
        # read as "data/../..=etc": review)
        cut = parts.index("..") if ".." in parts else len(parts) - 1
        group, name = "/".join(parts[:cut]) or "?", "/".join(parts[cut:])
        hint = ("; megaframe submits SLURM jobs itself: launcher=slurm (docs/scaling.md)"
                if group == "hydra/launcher" and name.startswith("submitit") else "")
        return f"{group}={name}: no such option; available: {', '.join(sorted(ex.options))}{hint}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        full_key = getattr(cause, "full_key", None) or getattr(cause, "key", "?")
        known = _known_keys(str(full_key))
        hint = f"; known keys there: {', '.join(known)}" if known else ""
        return f"unknown key '{full_key}'{hint}"
    if isinstance(cause, ValidationError):
        full_key = getattr(cause, "full_key", "?")
        msg = str(getattr(cause, "msg", cause)).splitlines()[0]
        fix = _conversion_fix(full_key, msg) or _shape_fix(full_key, msg)
        return f"{full_key}: {msg.rstrip('.') if fix else msg}{fix}"
    if isinstance(ex, OverrideParseException):  # Hydra's lexer: the override, and the quoting that reads it
        override = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(ex.override))  # one line: \n shown
        key = override.split("=", 1)[0]
        message = str(ex.message).splitlines()[0]
        return (f"{override}: Hydra's override grammar cannot read it ({message}); "
                f"quote a value with ; = , or spaces in it, the override in double quotes for the shell: "
                f"\"{key}='VALUE'\" (a list: \"{key}=['VALUE']\")")
    text = " ".join(part.strip() for part in str(ex).splitlines() if part.strip())
    if found := _KEY_IN_A_FILE.match(text):  # a key a config file sets that the schema lacks
        known = _known_keys(found[2])
        return f"{found[1]}.yaml: unknown key '{found[2]}'" + \
            (f"; known keys there: {', '.join(known)}" if known else "")
    return text


_KEY_IN_A_FILE = re.compile(r"In '([^']+)': ConfigKeyError raised while composing config: .*?full_key: (\S+)")


def _shape_fix(full_key: str, msg: str) -> str:
    """The fix for OmegaConf's lines that name the key but not what to write."""
    if "is not Optional" in msg:
        return f"; give {full_key} a value (null is not one it takes)"
    if found := re.match(r"Cannot convert '(list|dict)' to string", msg):
        return (f"; {full_key} takes one string, not a {'list' if found[1] == 'list' else 'mapping'}"
                f" (quote a value with brackets in it: \"{full_key}='VALUE'\")")
    if "is not a ListConfig, list or tuple" in msg:
        return f"; write a list in brackets, the override in double quotes for the shell: \"{full_key}=[...]\""
    return ""


_NOT_CONVERTED = re.compile(r"Value '(.*)' (?:of type '\w+' could not be converted to (Integer|Float)|is not a valid (bool))\b.*")


def _conversion_fix(full_key: str, msg: str) -> str:
    """The fix for OmegaConf's "could not be converted" line, which names the key but not what to write:
    `optim.muon.exchange_bucket_size=1e9` reaches an int key as the float 1e9 (Hydra's grammar)."""
    found = _NOT_CONVERTED.fullmatch(msg)
    if not found:
        return ""
    value, kind, boolean = found.groups()
    if boolean:
        return f"; {full_key} takes true or false"
    if kind == "Integer":
        try:
            whole = float(value)
        except ValueError:
            whole = None
        if whole is not None and whole.is_integer():
            return f"; write it as a whole number: {full_key}={int(whole)}"
        return f"; {full_key} takes a whole number"
    return f"; {full_key} takes a number"


def _known_keys(full_key: str) -> list[str]:
    """Field names of the config node that would hold full_key (for 'did you mean' hints)."""
    node = OmegaConf.structured(TrainConfig)
    for part in full_key.split(".")[:-1]:
        node = node.get(part) if OmegaConf.is_dict(node) else None
        if node is None:
            return []
    return list(node.keys()) if OmegaConf.is_dict(node) else []


def _extra_keys(obj, prefix: str = "") -> list[str]:
    """Keys present on the typed config that its dataclass does not declare (added with `+key=`)."""
    declared = {f.name for f in dataclasses.fields(obj)}
    extra = [f"{prefix}{name}" for name in vars(obj) if name not in declared]
    for name in declared:
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            extra += _extra_keys(value, f"{prefix}{name}.")
    return extra


# keys merged into one place (issue 34): the old name is refused with the new one, not a bare "unknown key"
RENAMED_KEYS = {
    "launcher.gpus_per_node": ("cluster.gpus_per_node", "a node's GPUs are the cluster's; cluster=h100_80g and "
                               "cluster=a100_80g set 8"),
    "cluster.nodes": ("launcher.nodes", "how many nodes the job takes is the launcher's"),
    "hardware.peak_tflops": ("cluster.peak_tflops", "one peak for MFU and the planner"),
}


# Hydra's own flags (help, --cfg job, multirun, ...), as hydra-core 1.3's argument parser has them
# (tests/unit/test_printed_config.py reads them from it): Hydra handles them (launch/ routes them to it)
HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package",
               "--resolve", "-m", "--multirun", "-r", "--run", "-cp", "--config-path", "-cn", "--config-name",
               "-cd", "--config-dir", "--shell-completion", "-sc", "--version", "--experimental-rerun")


def unknown_flag(overrides: Sequence[str]) -> str | None:
    """A dashed argument that is none of Hydra's flags (--foo, --max-steps=10) among what reaches the
    composition (each command has taken its own flags first): Hydra's parser answered with its
    lexer's exception text."""
    for arg in overrides:
        if arg.startswith("-") and arg.split("=", 1)[0] not in HYDRA_FLAGS:
            return (f"{arg}: not an option of this command; settings are overrides KEY=VALUE (e.g. "
                    f"train.max_steps=100): see --help for its options")
    return None


def override_problem(overrides: Sequence[str]) -> str | None:
    """One line for an override that names a recipe that does not exist or sets a key of
    RENAMED_KEYS, or None: both would otherwise reach Hydra, which reports the first in many lines
    and passes the second over in silence."""
    if problem := unknown_flag(overrides) or unknown_recipe(overrides) or empty_override_problem(overrides):
        return problem
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in RENAMED_KEYS:
            new, why = RENAMED_KEYS[key]
            value = override.split("=", 1)[1] if "=" in override else "..."
            return f"{key} is now {new} ({why}): use {new}={value}"
    return None


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
# Hydra lists a help's option groups before it reads hydra.searchpath: with these the flag stays a flag
_LISTING_FLAGS = ("-h", "--help", "--hydra-help", "-i", "--info")


def config_dirs_as_searchpath(args: Sequence[str]) -> list[str]:
    """Hydra's `--config-dir DIR` (or `-cd DIR`, `--config-dir=DIR`; several are searched in the
    order given) turned into the override it stands for, `hydra.searchpath=['file:///abs/DIR']`.
    As a flag it sent megaframe-train through hydra.main, which skips the pre-launch checks and
    launches no ranks (a dp=2 run died of "needs 2 ranks"), and megaframe-plan, which composes
    through Hydra's compose API, took it for a malformed override. As an override it goes the
    ordinary way, to every rank too. It goes before the first override, where Hydra's own flags
    (--cfg job, -m) may follow it. --help and --info keep the flag: Hydra lists the options of a
    help before it reads the search path. Raises ConfigError for a missing value or directory."""
    if any(a.split("=", 1)[0] in _LISTING_FLAGS for a in args):
        return list(args)
    rest, dirs = [], []
    i = 0
    while i < len(args):
        name, has_value, value = args[i].partition("=")
        if name not in CONFIG_DIR_FLAGS:
            rest.append(args[i])
        else:
            if not has_value:
                if i + 1 == len(args):
                    raise ConfigError(f"{name} needs a directory: {name} DIR (docs/configuration.md)")
                i += 1
                value = args[i]
            if not value.strip():
                raise ConfigError(f"{name} needs a directory: {name} DIR (docs/configuration.md)")
            path = Path(value).expanduser().resolve()
            if not path.is_dir():
                raise ConfigError(f"{name} {value}: no such directory")
            if any(char in str(path) for char in ("'", "\\", "${")):
                raise ConfigError(f"{name} {value}: a path with a quote, a backslash or '${{' cannot go into "
                                  f"hydra.searchpath; link the directory from a plain path")
            dirs.append(path)
        i += 1
    if not dirs:
        return list(args)
    if any(a.lstrip("+~").split("=", 1)[0] == "hydra.searchpath" for a in rest):
        raise ConfigError("hydra.searchpath and --config-dir both given: name the directories once, "
                          "each as --config-dir DIR")
    searchpath = searchpath_override([f"file://{path}" for path in dirs])
    first = next((i for i, a in enumerate(rest) if "=" in a and not a.startswith("-")), len(rest))
    return [*rest[:first], searchpath, *rest[first:]]


def searchpath_override(entries: Sequence[str]) -> str:
    """The override `hydra.searchpath=['ENTRY',...]` (entries free of quotes, as
    config_dirs_as_searchpath checks): how megaframe-train passes a user's config directories on,
    to its ranks and to each point of a sweep."""
    return "hydra.searchpath=[" + ",".join(f"'{entry}'" for entry in entries) + "]"


def compose(overrides: Sequence[str]) -> tuple[TrainConfig, str]:
    """Compose conf/ with the overrides; return the typed config and the resolved hydra.run.dir."""
    typed, run_dir, _ = compose_for_run(overrides)
    return typed, run_dir


CONFIG_FILE_BYTES = 1 << 20  # a config file is a few KB: a larger one in a searched folder is not one
CONFIG_FILE_NODES = 100_000  # the values a file holds once YAML's aliases are expanded (a model config: ~50)


def user_config_files_problem(overrides: Sequence[str]) -> Optional[str]:
    """The YAML files of the folders hydra.searchpath adds (--config-dir's): Hydra reads every one it
    composes whole and expands YAML's aliases, so a 279-byte file of aliases nested five deep (a
    million values) composed for minutes, and a 200 MB file for more than two; refused at once. The
    files where Hydra looks for options are read: DIR/NAME.yaml, DIR/GROUP/NAME.yaml and
    DIR/GROUP/SUB/NAME.yaml (at most CONFIG_FILES_READ of them); one YAML cannot parse is Hydra's to
    name, if the run uses it."""
    import yaml

    dirs = [Path(found) for override in overrides if override.lstrip("+").startswith("hydra.searchpath=")
            for found in re.findall(r"file://([^'\",\]]+)", override)]
    for path in itertools.islice(_option_files(dirs), CONFIG_FILES_READ):
        try:
            size = path.stat().st_size
            nodes = _expanded_nodes(path) if size <= CONFIG_FILE_BYTES else 0
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if size > CONFIG_FILE_BYTES:
            return (f"{path}: {size / 2**20:.1f} MiB, more than a config file holds (at most "
                    f"{CONFIG_FILE_BYTES >> 20} MiB); move it out of the config folder")
        if nodes > CONFIG_FILE_NODES:
            return (f"{path}: its YAML aliases expand to more than {CONFIG_FILE_NODES:,} values (an alias of "
                    f"aliases, nested); write the values out, or drop the aliases")
    return None


CONFIG_FILES_READ = 2000  # a config folder holds tens; a data folder passed by mistake is not walked whole


def _option_files(dirs: Sequence[Path]) -> Iterator[Path]:
    """The .yaml files at most two folders below each directory, in a stable order."""
    for directory in dirs:
        for pattern in ("*.yaml", "*/*.yaml", "*/*/*.yaml"):
            yield from sorted(directory.glob(pattern)) if directory.is_dir() else ()


def _expanded_nodes(path: Path) -> int:
    """How many values a YAML file holds once its aliases are expanded, counted from the parser's
    events (nothing is built, so an alias bomb costs its bytes, not its expansion)."""
    import yaml

    sizes: dict[str, int] = {}
    stack: list[list] = [[0, None]]  # [values so far, anchor] of each open collection
    with path.open("rb") as file:
        for event in yaml.parse(file, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                stack[-1][0] += sizes.get(event.anchor, 1)
            elif isinstance(event, yaml.ScalarEvent):
                stack[-1][0] += 1
                if event.anchor:
                    sizes[event.anchor] = 1
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                stack.append([1, event.anchor])
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                count, anchor = stack.pop()
                if anchor:
                    sizes[anchor] = count
                stack[-1][0] += count
    return stack[0][0]


# environment variables that make a process load code: hydra.job.env_set would set them for the run
_CODE_LOADING_ENV = {"PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONBREAKPOINT",
                     "PYTHONEXECUTABLE", "PYTHONPLATLIBDIR", "BASH_ENV", "ENV", "GCONV_PATH", "CUDA_INJECTION64_PATH"}
# what a logging config may name: logging's own sinks and the two plugins Hydra's docs show (rich, colorlog);
# a file only under the run directory (a config's FileHandler with mode w truncated any file it named)
_LOGGING_CLASSES = {"logging.StreamHandler", "logging.NullHandler", "logging.Formatter", "logging.Filter",
                    "rich.logging.RichHandler", "colorlog.ColoredFormatter"}
_LOGGING_FILES = {"logging.FileHandler", "logging.handlers.RotatingFileHandler",
                  "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler"}
_LOGGING_FACTORIES = {"colorlog.ColoredFormatter"}
_RUN_DIR_PREFIXES = ("${hydra.runtime.output_dir}/", "${hydra:runtime.output_dir}/")


def hydra_code_problem(hydra: DictConfig) -> Optional[str]:
    """Code a config file (a --config-dir's, a recipe someone shared) names for Hydra to run: its
    callbacks (functions by _target_), logging handlers, formatters and filters other than logging's
    own sinks (dictConfig imports and calls what a class, a `()` factory or an `ext://` names; a
    SocketHandler sends the logs away), a log file outside the run directory (truncated on open),
    and hydra.job.env_set's variables that load code into the run's processes. A config is data
    (docs/failures.md, "Nothing in your files runs"): one line, before anything runs."""
    if callbacks := hydra.get("callbacks"):
        return (f"hydra.callbacks.{next(iter(callbacks))}: Hydra would call the function a config names, and "
                f"megaframe runs no code from a config; remove hydra.callbacks")
    for section in ("job_logging", "hydra_logging"):
        node = hydra.get(section)
        if node and (where := _code_in_logging(OmegaConf.to_container(node, resolve=False), f"hydra.{section}")):
            return (f"{where}: megaframe runs no code from a config, nor lets one write outside the run; use "
                    f"logging.StreamHandler, logging.NullHandler, a logging.FileHandler under "
                    f"${{hydra.runtime.output_dir}}, rich.logging.RichHandler or colorlog.ColoredFormatter")
    for name in (hydra.get("job") or {}).get("env_set") or {}:
        if name in _CODE_LOADING_ENV or name.startswith("LD_") or name.endswith("_PLUGIN"):
            return (f"hydra.job.env_set.{name}: it makes the run's processes load code, and megaframe runs no code "
                    f"from a config; set it in the environment yourself if you mean to")
    return None


def hydra_plugin_problem(hydra: DictConfig) -> Optional[str]:
    """For a -m sweep, which Hydra runs through its sweeper and launcher plugins: a _target_ Hydra has
    not registered (it refuses to build one, but in a traceback), or an interpolation (read as written,
    not resolved: one Hydra cannot resolve was its traceback too). A single run builds neither."""
    for kind in ("sweeper", "launcher"):
        node = hydra.get(kind)
        target = OmegaConf.to_container(node, resolve=False).get("_target_") if node is not None else None
        if isinstance(target, str) and "${" in target:
            return (f"hydra.{kind}._target_={target}: a plugin is named by its class, not an interpolation; choose "
                    f"one by its option, hydra/{kind}=NAME ({_PLUGIN_EXAMPLES[kind]})")
        if isinstance(target, str) and not _is_plugin(target, kind):
            return (f"hydra.{kind}._target_={target}: not a Hydra {kind} installed here; choose one by its "
                    f"option, hydra/{kind}=NAME ({_PLUGIN_EXAMPLES[kind]})")
    return None


_PLUGIN_EXAMPLES = {"sweeper": "hydra/sweeper=basic, or an installed plugin's option",
                    "launcher": "hydra/launcher=megaframe_local, or an installed plugin's option"}


def _is_plugin(class_name: str, kind: str) -> bool:
    """Whether Hydra has `class_name` registered as a plugin of this kind (what it would build)."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper

    found = Plugins.instance().class_name_to_class.get(class_name)
    return found is not None and issubclass(found, {"sweeper": Sweeper, "launcher": Launcher}[kind])


def _code_in_logging(node: Any, where: str) -> Optional[str]:
    """The first entry of a logging dictConfig outside what a config may name, as KEY.PATH=VALUE."""
    if isinstance(node, dict):
        if "()" in node and str(node["()"]) not in _LOGGING_FACTORIES:
            return f"{where}.()={node['()']}"
        kind = str(node["class"]) if "class" in node else None
        if kind is not None and kind not in _LOGGING_CLASSES | _LOGGING_FILES:
            return f"{where}.class={kind}"
        if kind in _LOGGING_FILES and not str(node.get("filename", "")).startswith(_RUN_DIR_PREFIXES):
            return f"{where}.filename={node.get('filename')}"
        for key, value in node.items():
            if found := _code_in_logging(value, f"{where}.{key}"):
                return found
    elif isinstance(node, list):
        for index, value in enumerate(node):
            if found := _code_in_logging(value, f"{where}[{index}]"):
                return found
    elif isinstance(node, str) and node.startswith("ext://") and node not in ("ext://sys.stdout", "ext://sys.stderr"):
        return f"{where}={node}"
    return None


def compose_for_run(overrides: Sequence[str]) -> tuple[TrainConfig, str, DictConfig]:
    """compose(), and also the whole composition with its `hydra` node, as Hydra's own run composes
    it for the task named "cli" (megaframe-train's): launch/hydra_run.py's run_composed runs it
    instead of composing a second time."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if problem := override_problem(overrides) or user_config_files_problem(overrides):
        raise ConfigError(problem)
    register_configs(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="cli"):
            composed = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
            run_dir = str(composed.hydra.run.dir)
            # typed without the hydra node, whose sweep keys interpolate values only a running job
            # has; a shallow copy, so that the composition the run gets keeps it
            task = copy.copy(composed)
            with open_dict(task):
                del task["hydra"]
            typed = OmegaConf.to_object(task)
    except Exception as ex:  # Hydra / OmegaConf composition errors of every kind
        raise ConfigError(_one_line(ex)) from ex
    if problem := run_dir_problem(run_dir) or hydra_code_problem(composed.hydra):
        raise ConfigError(problem)  # a config file's empty hydra.run.dir, as an override's; code it names
    if extra := _extra_keys(typed):
        # `+key=value` would otherwise attach a key that nothing reads: a typo the user never sees
        known = _known_keys(extra[0])
        raise ConfigError(f"unknown key '{extra[0]}'" + (f"; known keys there: {', '.join(known)}" if known else ""))
    return typed, run_dir, composed


def override_value(override: str) -> str:
    """The value of one KEY=VALUE override as Hydra reads it: unquoted and unescaped (the inverse of
    hydra_quoted: '/scratch/my run' is the folder /scratch/my run)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return str(OverridesParser.create().parse_overrides([override])[0].value())


def hydra_quoted(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar, so ':', '=', ',' or brackets in a
    path stay part of it. Hydra reads a backslash as an escape only in a run of them before a quote
    (or the closing one): those runs are doubled, then each quote escaped."""
    if re.fullmatch(r"[\w./+~@-]+", value):
        return value  # nothing Hydra would read as grammar: the job script stays plain
    doubled = re.sub(r"(\\+)(?='|$)", lambda run: run.group(1) * 2, value)
    return "'" + doubled.replace("'", "\\'") + "'"
