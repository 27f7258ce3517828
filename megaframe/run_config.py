"""The configuration a run trained with, read back from RUN_DIR/config.yaml beside its checkpoints.

megaframe-train writes the resolved config of every run to RUN_DIR/config.yaml (launch/hydra_run.py); a
checkpoint of that run lives in RUN_DIR/checkpoints/global_stepN. Tools that act on a checkpoint
(megaframe-eval) take the run's own data, tokenizer and batch settings from there, so that they
never score another dataset silently. Overrides in Hydra's syntax change single keys of it
(`data.valid_path=PREFIX`), or replace the whole data section with an option of conf/data
(`data=demo`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError

CONFIG_FILE = "config.yaml"
CONFIG_CAP = 16 << 20  # a run's config.yaml is KBs: a larger file is not one megaframe-train wrote
HYDRA_RECORD_CAP = 1 << 20  # .hydra/hydra.yaml, likewise


def run_dir_of(checkpoint: Path) -> Optional[Path]:
    """The run directory a checkpoint directory (RUN/checkpoints/global_stepN) belongs to, or None
    for a checkpoint copied elsewhere."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


def named_checkpoint(argument: Path, resolved: Path) -> Path:
    """The checkpoint `resolved` as the user named it: ARG/global_stepN when ARG is a run's
    checkpoints/ directory (its `latest` named it), else ARG; made absolute without following links.
    The run dir is taken from this path, never from `resolved`: resolving `latest` follows links,
    and with RUN/checkpoints linked to /shared/x its parent is /shared, whose config.yaml is not
    this run's (a missing one, or another run's, scoring other data in silence). A run dir recorded
    in state.json at save time would name the run's old place after the run dir is copied or
    moved, and another run may have taken that place since; what the user typed moves with it."""
    argument = Path(os.path.normpath(Path(_logical_cwd()) / argument))  # lexical: no link followed
    # resolve_checkpoint's rule: a `latest` there names the checkpoint
    return argument / resolved.name if os.path.lexists(argument / "latest") else argument


def _logical_cwd() -> str:
    """The current directory as the shell names it ($PWD, as `pwd -L`): `cd RUN/checkpoints;
    megaframe-eval .` names RUN even when RUN/checkpoints is a link (os.getcwd() gives its target)."""
    logical = os.environ.get("PWD", "")
    try:
        if os.path.isabs(logical) and os.path.samefile(logical, "."):
            return logical
    except OSError:
        pass
    return os.getcwd()


def run_config_file(checkpoint: Path) -> Optional[Path]:
    """RUN/config.yaml of the run that wrote `checkpoint`, or None when the checkpoint is not in a
    run directory."""
    run_dir = run_dir_of(checkpoint)
    return None if run_dir is None else run_dir / CONFIG_FILE


def load_run_config(path: Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The typed config of RUN/config.yaml with `overrides` applied; ConfigError (one line) when
    the file is missing, unreadable, or does not fit the schema."""
    from omegaconf import OmegaConf

    saved = saved_run_config(path)
    # megaframe-train writes every section, each key in it: an empty or cut file is not the run's,
    # and its gaps would be filled with defaults (the demo corpus scored in silence: review)
    if missing := [key for key in _WRITTEN_KEYS if OmegaConf.select(saved, key, default=_ABSENT) is _ABSENT]:
        raise IncompleteRunConfig(f"{path}: not the whole config megaframe-train wrote ({missing[0]} is missing), "
                                  f"so the data the run trained on is unknown; put the run's config.yaml back, or "
                                  f"name the data with data.path=PREFIX, data.blend=... or data=demo")
    _from_training_directory(saved, path.parent)
    typed = _apply(saved, overrides)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))
    except Exception as ex:  # a key this version does not know, a value of the wrong type
        reason = " ".join(str(ex).split("\n")[0].split())[:200]
        if (key := getattr(ex, "full_key", None)) in typed:  # the value came from the command line, not the file
            raise ConfigError(f"{typed[key]}: {reason}") from None
        raise ConfigError(f"{path}: does not fit this megaframe's config schema "
                          f"({' '.join(str(ex).split())[:200]})") from None


def saved_run_config(path: Path):
    """RUN/config.yaml as saved (an OmegaConf DictConfig, not yet typed): read once, not through a
    link, size-capped (safe_files); ConfigError (one line) when missing, a link, or damaged."""
    from omegaconf import OmegaConf

    text = _read_run_file(path, CONFIG_CAP)
    try:
        saved = OmegaConf.create(text)  # YAML text, parsed as OmegaConf.load parses a file
    except Exception as ex:  # YAML or OmegaConf errors of every kind: a damaged file
        raise ConfigError(f"{path}: not a readable run config ({' '.join(str(ex).split())[:200]})") from None
    if not OmegaConf.is_dict(saved):
        raise ConfigError(f"{path}: not a readable run config (a YAML mapping of config sections expected)")
    return saved


class IncompleteRunConfig(ConfigError):
    """RUN/config.yaml lacks keys every run's file holds: empty, cut, or written by hand."""


_ABSENT = object()
# the keys that name a run's data, which every run's config.yaml holds (a saved null counts): a
# file without them is empty, cut, or not a run's, and the data it trained on is unknown
_WRITTEN_KEYS = ("data.path", "data.tokenizer")


def _read_run_file(path: Path, cap: int) -> str:
    """The text of a file megaframe-train wrote in a run dir: opened once, not through a link (one
    someone else put there), at most `cap` bytes; ConfigError (one line) otherwise."""
    from megaframe.common.safe_files import UnsafeFile, quote, read_capped

    try:
        return read_capped(path, cap).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: the run's config is missing, so the data it trained on is unknown") from None
    except UnsafeFile as err:  # a link, a FIFO, a directory, a huge file: not what megaframe-train wrote
        raise ConfigError(f"{err.strerror}; megaframe reads no link or special file in a run dir: put the run's own "
                          f"{path.name} there as a plain file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not a readable run config ({quote(getattr(err, 'strerror', None) or err, 200)})"
                          ) from None


def training_directory(run_dir: Path) -> Optional[Path]:
    """The directory the run was started in (Hydra's hydra.runtime.cwd in RUN/.hydra/hydra.yaml),
    against which its relative data paths were read; None when not recorded."""
    import yaml

    from megaframe.common.safe_files import read_capped

    try:  # not a link, a FIFO or a huge file (safe_files): unread, it is "not recorded"
        record = yaml.safe_load(read_capped(run_dir / ".hydra" / "hydra.yaml", HYDRA_RECORD_CAP))
        cwd = record["hydra"]["runtime"]["cwd"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None
    return Path(cwd) if isinstance(cwd, str) and Path(cwd).is_absolute() else None


def _from_training_directory(saved, run_dir: Path) -> None:
    """The run's relative data paths (data.path, valid_path, the prefixes of blend and valid_blend,
    a tokenizer directory) made absolute against the directory the run was started in, when that
    is not this one: the run's files, wherever megaframe-eval is started."""
    from omegaconf import OmegaConf

    cwd = training_directory(run_dir)
    data = saved.get("data") if OmegaConf.is_dict(saved) else None
    if cwd is None or data is None or cwd.resolve() == Path.cwd().resolve():
        return

    def absolute(value):
        if not isinstance(value, str) or not value or Path(value).is_absolute() or _is_number(value):
            return value  # a blend's weight stays a weight
        return str(cwd / value)
    for key in ("path", "valid_path"):
        if key in data:
            data[key] = absolute(data[key])
    if data.get("tokenizer") not in (None, "byte"):
        data["tokenizer"] = absolute(data["tokenizer"])
    for key in ("blend", "valid_blend"):
        if OmegaConf.is_list(data.get(key)):
            data[key] = [absolute(item) for item in data[key]]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _apply(saved, overrides: Sequence[str]) -> dict[str, str]:
    """Hydra-syntax overrides onto the saved config: `KEY=VALUE` sets one key; `data=NAME` replaces
    the data section with conf/data/NAME.yaml composed as megaframe-train would. Returns {key: the
    override as typed}, so that a value of the wrong type is blamed on it, not on the file."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as ex:
        raise ConfigError(" ".join(str(ex).split())) from None
    typed: dict[str, str] = {}
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or override.is_add() or override.is_sweep_override():
            raise ConfigError(f"{override.input_line}: give KEY=VALUE, or data=OPTION")
        if key == "data":  # a group option: the whole data section of conf/data/NAME.yaml
            from megaframe.config.compose import compose

            chosen, _ = compose([f"data={override.value()}"])
            OmegaConf.update(saved, "data", OmegaConf.structured(chosen.data), merge=False)
            continue
        if OmegaConf.select(saved, key, default=_MISSING) is _MISSING:
            raise ConfigError(f"unknown key '{key}'")
        OmegaConf.update(saved, key, override.value(), merge=False)
        typed[key] = override.input_line
    return typed


_MISSING = object()
