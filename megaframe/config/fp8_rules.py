"""precision.fp8's rules (parallel/fp8/), which validate() runs with precision's: the config's own
before launch everywhere; what the machine must have (torchao, the GPU's fp8 tensor cores) where
the device is asked (validate's fp8_device: the launching host, not the planner away from the GPUs)."""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

from megaframe.config.choices import choice_problem, unread_key
from megaframe.config.schema import TrainConfig
from megaframe.parallel.fp8 import EMULATE_CHOICES, FP8_RECIPES, emulate_choice, emulated

# the first compute capability with fp8 tensor cores (Ada, Hopper: sm89) and with MXFP8's
# block-scaled ones (Blackwell: sm100)
FP8_SM, MXFP8_SM = (8, 9), (10, 0)
MX_BLOCK = 32  # MXFP8 scales blocks of 32 along each GEMM's reduction dimension


def cuda_capability(device_type: str) -> Optional[tuple[int, int]]:
    """This machine's GPU's compute capability, or None where the run trains on the CPU."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def fp8_config_problem(cfg: TrainConfig, ffn_width: int) -> Optional[str]:
    """precision.fp8's keys against each other and the model (ffn_width: the resolved MLP width);
    their values are refused even with fp8 off (a typo waits for the day it is switched on)."""
    fp8 = cfg.precision.fp8
    if err := choice_problem("precision.fp8.recipe", fp8.recipe, list(FP8_RECIPES)):
        return err
    if err := choice_problem("precision.fp8.emulate", emulate_choice(fp8.emulate), list(EMULATE_CHOICES)):
        return err
    layers = cfg.model.num_layers
    if fp8.bf16_layers < 0:
        return f"precision.fp8.bf16_layers={fp8.bf16_layers} must be >= 0 (blocks kept in bf16 at each end)"
    if not fp8.enabled:
        return unread_key(fp8, "precision.fp8", "enabled", "precision=fp8 (precision.fp8.enabled=true)")
    if cfg.precision.dtype == "fp16":
        return ("precision.fp8 with precision.dtype=fp16: fp8 recipes scale each tensor themselves and compute "
                "beside bf16, not under fp16's loss scaling; use precision=fp8 (bf16 elsewhere)")
    if 2 * fp8.bf16_layers >= layers:
        return (f"precision.fp8.bf16_layers={fp8.bf16_layers} keeps the first and last that many of the "
                f"{layers} blocks in bf16, leaving none in fp8; use 0 <= bf16_layers < {(layers + 1) // 2}")
    if fp8.recipe == "mxfp8":
        return _mx_shape_problem(cfg, ffn_width)
    return None


def _local_widths(cfg: TrainConfig, ffn_width: Optional[int]) -> dict[str, int]:
    """The dense linears' widths on one TP rank, by the name a refusal gives them (ffn_width: the
    resolved MLP width; None leaves the MLP out)."""
    m, tp = cfg.model, cfg.parallel.tp
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    widths = {"model.hidden_size": m.hidden_size,
              "model.num_attention_heads x head_dim / parallel.tp": m.num_attention_heads * head_dim // tp}
    moe = m.moe
    if ffn_width and (not moe.num_experts or moe.first_dense_layers or moe.layer_freq > 1):  # a dense MLP
        widths["the MLP width / parallel.tp"] = ffn_width // tp
    return widths


def _mx_shape_problem(cfg: TrainConfig, ffn_width: int) -> Optional[str]:
    """MXFP8's 32-element blocks along every local GEMM dimension that a GEMM reduces over."""
    m, tp = cfg.model, cfg.parallel.tp
    widths = _local_widths(cfg, ffn_width)
    moe = m.moe
    if moe.num_experts:  # whole experts on their ranks; the shared experts' MLP split over TP
        expert = moe.ffn_hidden_size or ffn_width
        widths["the expert MLP width"] = expert
        if moe.shared_experts:
            widths["the shared experts' MLP width / parallel.tp"] = moe.shared_experts * expert // tp
    for name, width in widths.items():
        if width % MX_BLOCK:
            return (f"precision.fp8.recipe=mxfp8 scales blocks of {MX_BLOCK} along each matmul's reduction "
                    f"dimension, and {name} is {width}; make it a multiple of {MX_BLOCK} or use recipe=tensorwise")
    return None


def fp8_device_problem(cfg: TrainConfig, capability: Optional[tuple[int, int]],
                       ffn_width: Optional[int] = None) -> Optional[str]:
    """What this machine must have for precision.fp8: torchao, and unless emulated a GPU with fp8
    tensor cores (capability: its (major, minor), None on the CPU, where torch._scaled_mm runs
    tensorwise and rowwise scales but not MXFP8's), and there the kernels' shapes (ffn_width: the
    resolved MLP width; None leaves the MLP out)."""
    fp8 = cfg.precision.fp8
    if importlib.util.find_spec("torchao") is None:
        return "precision=fp8 needs torchao, which is not installed; pip install 'megaframe[fp8]'"
    choice, mx = emulate_choice(fp8.emulate), fp8.recipe == "mxfp8"
    if choice == "true":
        return None
    need = MXFP8_SM if mx else FP8_SM
    if capability is None:
        if mx and choice == "false":
            return ("precision.fp8.recipe=mxfp8 with precision.fp8.emulate=false needs a GPU of SM 10.0 "
                    "(Blackwell); this run trains on the CPU: set precision.fp8.emulate=auto")
        return None
    if tuple(capability) < need:
        return (f"precision.fp8.recipe={fp8.recipe} needs {'MXFP8' if mx else 'fp8'} tensor cores (SM "
                f"{need[0]}.{need[1]} or later) and this GPU is SM {capability[0]}.{capability[1]}; set "
                f"precision.fp8.emulate=true (correct but slower than bf16) or use precision=bf16")
    return kernel_shape_problem(cfg, ffn_width)


KERNEL_MULTIPLE = 16  # torch._scaled_mm's fp8 kernels take operands whose every dimension is a multiple of this


def kernel_shape_problem(cfg: TrainConfig, ffn_width: Optional[int]) -> Optional[str]:
    """On a GPU, the shapes torch._scaled_mm's fp8 kernels take (tensorwise and rowwise; None when the
    run emulates fp8 or uses MXFP8's own rule): each fp8 linear's in and out widths on its rank, and the
    tokens of a micro-batch, which the weight gradient's GEMM reduces over (in fp8 but for
    rowwise_with_gw_hp). hidden_size=72 passed every check and died at step 0 ("mat2 shape (72x72)
    must be divisible by 16", exit 1). The planner asks it for a GPU cluster's layouts too."""
    m, p, fp8 = cfg.model, cfg.parallel, cfg.precision.fp8
    if emulate_choice(fp8.emulate) == "true" or fp8.recipe == "mxfp8":
        return None
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    dims = _local_widths(cfg, ffn_width)
    dims["model.num_kv_heads x head_dim / parallel.tp"] = (m.num_kv_heads or m.num_attention_heads) * head_dim // p.tp
    if fp8.recipe != "rowwise_with_gw_hp":  # that recipe's weight gradient is a bf16 GEMM
        dims["parallel.micro_batch_size x model.seq_length / parallel.cp (the tokens a linear takes)"] = \
            p.micro_batch_size * m.seq_length // p.cp
    if "the MLP width / parallel.tp" in dims:  # named after the attention's and the tokens', as before
        dims["the MLP width / parallel.tp"] = dims.pop("the MLP width / parallel.tp")
    for name, size in dims.items():
        if size % KERNEL_MULTIPLE:
            return (f"precision.fp8.recipe={fp8.recipe} on fp8 kernels needs every dimension of a "
                    f"matmul a multiple of {KERNEL_MULTIPLE}, and {name} is {size}; change it, or set "
                    f"precision.fp8.emulate=true (slower than bf16)")
    return None


def fp8_problem(cfg: TrainConfig, ffn_width: int,
                fp8_device: Optional[Callable[[], Optional[tuple[int, int]]]] = None) -> Optional[str]:
    """All of precision.fp8's rules; fp8_device() gives the GPU's capability (None: the CPU), and
    None skips what the machine must have."""
    if err := fp8_config_problem(cfg, ffn_width):
        return err
    if not cfg.precision.fp8.enabled or fp8_device is None:
        return None
    return fp8_device_problem(cfg, fp8_device(), ffn_width)


def eager_fp8_warning(cfg: TrainConfig, device_type: str) -> Optional[str]:
    """fp8 kernels without train.compile: each linear's amax, scale and cast run as separate eager
    kernels per micro-batch (parallel/fp8/), which torchao measured slower than bf16 GEMMs from
    width 512 to 4096 (torchtitan's float8 guide calls compile required). Said once at start-up, not
    refused: the run is correct, and a first run may want to see eager numbers."""
    fp8 = cfg.precision.fp8
    if not fp8.enabled or cfg.train.compile or emulated(fp8.emulate, device_type):
        return None
    return ("precision.fp8 runs its fp8 casts eagerly without train.compile=true: expect it slower than "
            "precision=bf16; set train.compile=true to fuse them into the matmuls")
