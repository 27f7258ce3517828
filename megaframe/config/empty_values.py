"""Empty values are refused before launch: an unset shell variable (`data.path=$DATA`) or a stray
`key=` must not select something else in silence.

Without this rule `data.blend=[]` trained on the built-in demo corpus (an empty blend reads as
"no blend"), `data.tokenizer=` and `train.resume=` resolved to the current directory (Path("") is
"."), `data.cache_dir=` and `offload.nvme_path=` wrote there, and `hydra.run.dir=` trained and
checkpointed in the current directory, where the next command resumed from it.

The class: every string key of TrainConfig (none has a meaning when empty or blank: each is a
choice, a name or a path), every string entry of a list key, and the list keys whose empty list
falls back to something else (EMPTY_LIST_KEYS). The walk reads the schema, so a key added later is
covered without an entry here; FIXES only words the fix for the keys users set most.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

# list keys whose empty list means "fall back to something else": an empty data.blend trains on
# the built-in demo corpus, an empty data.valid_blend evaluates on a held-out part of the training
# data. (plan.engines=[] and launcher.sbatch_extra=[] say "none" and mean it; data.blend_schedule=[]
# is no schedule, as null is.)
EMPTY_LIST_KEYS = {
    "data.blend": "give weights and dataset prefixes, e.g. data.blend='[0.7,/data/a,0.3,/data/b]', or null "
                  "(and data.path) for one dataset",
    "data.valid_blend": "give weights and validation prefixes, e.g. data.valid_blend='[1.0,/data/val]', or null "
                        "to hold out data.valid_fraction of the training data",
}

# how to fix the keys users set most; others get "give a value, or leave the key out (default: ...)"
FIXES = {
    "data.path": "give the prefix of a .bin/.idx pair, or null for the built-in demo corpus",
    "data.valid_path": "give the prefix of a validation .bin/.idx pair, or null to hold out data.valid_fraction",
    "data.tokenizer": "give byte or a local Hugging Face tokenizer directory",
    "data.cache_dir": "give a directory, or null for $XDG_CACHE_HOME/megaframe",
    "data.blend": "give a dataset prefix after each weight, e.g. data.blend='[0.7,/data/a,0.3,/data/b]'",
    "data.valid_blend": "give a dataset prefix after each weight, e.g. data.valid_blend='[1.0,/data/val]'",
    "train.resume": "give auto, none or a checkpoint directory",
    "offload.nvme_path": "give a directory on a local NVMe drive",
    "launcher.ray_address": "give ray://HOST:10001 or auto, or null to start a local Ray cluster",
}

RUN_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def _run_dir_fix(key: str) -> str:
    return f"give a directory, e.g. {key}=runs/exp1, or leave the key out (outputs/DATE/TIME)"


_UNSET = "(an unset shell variable?)"


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _fix(key: str, default: Any) -> str:
    if key in FIXES:
        return FIXES[key]
    if default is None:
        return "give a value, or null (the default)"
    return f"give a value, or leave the key out (default: {default})"


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def empty_value_problem(cfg: Any) -> Optional[str]:
    """The first string key that is empty or blank, list key whose empty list means something else,
    or list entry that is a blank string, as one line naming the key and the fix; None if none."""
    def walk(node: Any, prefix: str) -> Optional[str]:
        for f in dataclasses.fields(node):
            value, key = getattr(node, f.name), prefix + f.name
            if dataclasses.is_dataclass(value):
                if problem := walk(value, key + "."):
                    return problem
            elif _blank(value):
                return f"{key}={value!r} is empty {_UNSET}; {_fix(key, _field_default(f))}"
            elif isinstance(value, (list, tuple)):
                if not value and key in EMPTY_LIST_KEYS:
                    return f"{key}=[] is empty; {EMPTY_LIST_KEYS[key]}"
                for i, entry in enumerate(value):
                    if _blank(entry):
                        return f"{key} entry {i + 1} is empty {_UNSET}; {_fix(key, _field_default(f))}"
        return None

    return walk(cfg, "")


def run_dir_problem(run_dir: str) -> Optional[str]:
    """hydra.run.dir resolved to nothing: Hydra would run in the current directory."""
    if _blank(run_dir):
        return f"hydra.run.dir={run_dir!r} is empty {_UNSET}; {_run_dir_fix('hydra.run.dir')}"
    return None


def empty_override_problem(overrides: Sequence[str]) -> Optional[str]:
    """A run or sweep directory override with no value (`hydra.run.dir=$RUN` with RUN unset): Hydra
    would run, write and resume in the current directory. The overrides are read as given, as
    Hydra's own flags (-m) never reach the composition that run_dir_problem checks."""
    for override in overrides:
        key, has_value, value = override.lstrip("+").partition("=")
        if has_value and key in RUN_DIR_KEYS and _blank(unquoted := value.strip("'\"")):
            return f"{key}={unquoted!r} is empty {_UNSET}; {_run_dir_fix(key)}"
    return None
