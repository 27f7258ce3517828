"""The configuration a run trained with, read back from RUN_DIR/config.yaml beside its checkpoints.

megaframe-train writes the resolved config of every run to RUN_DIR/config.yaml (cli._task); a
checkpoint of that run lives in RUN_DIR/checkpoints/global_stepN. Tools that act on a checkpoint
(megaframe-eval) take the run's own data, tokenizer and batch settings from there, so that they
never score another dataset silently. Overrides in Hydra's syntax change single keys of it
(`data.valid_path=PREFIX`), or replace the whole data section with an option of conf/data
(`data=demo`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError

CONFIG_FILE = "config.yaml"


def run_dir_of(checkpoint: Path) -> Optional[Path]:
    """The run directory a checkpoint directory (RUN/checkpoints/global_stepN) belongs to, or None
    for a checkpoint copied elsewhere."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


def run_config_file(checkpoint: Path) -> Optional[Path]:
    """RUN/config.yaml of the run that wrote `checkpoint`, or None when the checkpoint is not in a
    run directory."""
    run_dir = run_dir_of(checkpoint)
    return None if run_dir is None else run_dir / CONFIG_FILE


def load_run_config(path: Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The typed config of RUN/config.yaml with `overrides` applied; ConfigError (one line) when
    the file is missing, unreadable, or does not fit the schema."""
    from omegaconf import OmegaConf

    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path}: the run's config is missing, so the data it trained on is unknown")
    try:
        saved = OmegaConf.load(path)
    except Exception as ex:  # YAML or OmegaConf errors of every kind: a damaged file
        raise ConfigError(f"{path}: not a readable run config ({' '.join(str(ex).split())[:200]})") from None
    _from_training_directory(saved, path.parent)
    _apply(saved, overrides)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))
    except Exception as ex:  # a key this version does not know, a value of the wrong type
        raise ConfigError(f"{path}: does not fit this megaframe's config schema "
                          f"({' '.join(str(ex).split())[:200]})") from None


def training_directory(run_dir: Path) -> Optional[Path]:
    """The directory the run was started in (Hydra's hydra.runtime.cwd in RUN/.hydra/hydra.yaml),
    against which its relative data paths were read; None when not recorded."""
    import yaml

    record = run_dir / ".hydra" / "hydra.yaml"
    if record.is_symlink() or not record.is_file() or record.stat().st_size > 1 << 20:
        return None
    try:
        cwd = yaml.safe_load(record.read_text())["hydra"]["runtime"]["cwd"]
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


def _apply(saved, overrides: Sequence[str]) -> None:
    """Hydra-syntax overrides onto the saved config: `KEY=VALUE` sets one key; `data=NAME` replaces
    the data section with conf/data/NAME.yaml composed as megaframe-train would."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as ex:
        raise ConfigError(" ".join(str(ex).split())) from None
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


_MISSING = object()
