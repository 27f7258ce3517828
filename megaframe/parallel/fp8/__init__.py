"""fp8 recipes at the matmul seam (parallel/matmul.py), on torchao's float8 training primitives:
`scaled` (tensorwise, rowwise, rowwise_with_gw_hp: torchao's Float8LinearConfig recipes, with the
amax of every scale that spans the TP ranks reduced over the TP group) and `mx` (MXFP8, 1x32
blocks). Those two import torchao, an optional extra (pip install 'megaframe[fp8]'); this module
does not (nor torch), so the config rules and the start-up line can ask it what a run will do."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from megaframe.parallel.matmul import MatmulRecipe

EMULATE_CHOICES = ("auto", "true", "false")

# precision.fp8.recipe -> the module here whose build() makes it, imported only when a run asks for
# it (torchao is an optional extra: megaframe imports and runs without it)
FP8_RECIPES = {"tensorwise": "scaled", "rowwise": "scaled", "rowwise_with_gw_hp": "scaled", "mxfp8": "mx"}


def recipe_for(precision: Any, num_layers: int, device_type: str) -> MatmulRecipe:
    """The matmul recipe a run's config asks for (precision: a PrecisionConfig): the default unless
    precision.fp8 is on, else its recipe for a model of num_layers blocks training on device_type."""
    from megaframe.parallel.matmul import DEFAULT  # here: the config rules import this module without torch

    fp8 = precision.fp8
    if not fp8.enabled:
        return DEFAULT
    module = importlib.import_module(f"{__name__}.{FP8_RECIPES[fp8.recipe]}")
    return module.build(fp8.recipe, emulate=emulated(fp8.emulate, device_type), head=fp8.head,
                        bf16_layers=fp8.bf16_layers, num_layers=num_layers)


def emulate_choice(emulate: Union[str, bool]) -> str:
    """precision.fp8.emulate as one of EMULATE_CHOICES (a YAML or CLI true/false arrives as a bool
    or as OmegaConf's "True"/"False")."""
    return str(emulate).lower()


def emulated(emulate: Union[str, bool], device_type: str) -> bool:
    """Whether the fp8 matmuls are emulated (dequantised to the model's dtype and multiplied there)
    rather than run by fp8 kernels: as asked, or with "auto" on the CPU only (fp8 tensor cores are
    the point on a GPU)."""
    choice = emulate_choice(emulate)
    return choice == "true" or (choice == "auto" and device_type != "cuda")


def describe(fp8, device_type: str) -> str:
    """What the start-up line says of fp8 (fp8: a precision.fp8 config): '' when it is off, else
    e.g. ' fp8=tensorwise (emulated)' or ' fp8=rowwise (fp8 kernels, head fp8, bf16_layers=1)'."""
    if not fp8.enabled:
        return ""
    extras = ["emulated" if emulated(fp8.emulate, device_type) else "fp8 kernels"]
    if fp8.head:
        extras.append("head fp8")
    if fp8.bf16_layers:
        extras.append(f"bf16_layers={fp8.bf16_layers}")
    return f" fp8={fp8.recipe} ({', '.join(extras)})"
