"""DeepSpeed's config rules: which ZeRO stage x offload x pipeline combinations it runs, its knobs'
ranges, and what its checkpoints can hold. Pure config (no DeepSpeed import): the CLI and the
planner hand them to config/validate.py through the plug, before anything launches."""
from __future__ import annotations

from typing import Optional

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout, choice_problem


def combination_problem(stage: int, optimizer: str, param: str, pp: int) -> Optional[str]:
    """Why DeepSpeed cannot run this ZeRO stage x offload x pipeline combination (None: it can)."""
    if param != "none" and stage != 3:
        return f"offload.param={param} needs zero=stage3 (zero.stage={stage})"
    if optimizer == "nvme" and stage != 3:
        # at ZeRO-1/2 DeepSpeed silently treats device nvme as cpu
        return (f"offload.optimizer=nvme: NVMe offload needs zero=stage3 (zero.stage={stage}); below it DeepSpeed "
                f"would silently use CPU memory instead")
    if optimizer == "cpu" and stage == 0:
        return "offload.optimizer=cpu needs ZeRO (zero.stage=0)"
    if pp > 1 and stage >= 2:
        return (f"parallel.pp={pp} with zero.stage={stage}: DeepSpeed's pipeline engine supports ZeRO stage 0 "
                f"or 1 only")
    return None


def combination_alternatives(stage: int, optimizer: str, param: str, pp: int, most: int = 2) -> list[str]:
    """The nearest legal settings of zero.stage / offload.optimizer / offload.param, as CLI overrides.

    Only those that change the fewest keys; among them, ones that keep the user's offload (raise
    the stage) before ones that drop it, then the nearest stage.
    """
    current = (stage, optimizer, param)
    found = []
    for s in range(4):
        for o in ("none", "cpu", "nvme"):
            for p in ("none", "cpu", "nvme"):
                if (s, o, p) == current or combination_problem(s, o, p, pp):
                    continue
                changed = [(key, new) for key, old, new in (("zero", stage, s), ("offload.optimizer", optimizer, o),
                                                            ("offload.param", param, p)) if old != new]
                dropped = sum(old != "none" and new == "none" for old, new in ((optimizer, o), (param, p)))
                found.append(((len(changed), dropped, abs(s - stage)),
                              " ".join(f"zero=stage{v}" if k == "zero" else f"{k}={v}" for k, v in changed)))
    found.sort()
    return [text for rank, text in found if rank[0] == found[0][0][0]][:most]


def _either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def config_problem(cfg: TrainConfig) -> Optional[str]:
    """Why DeepSpeed cannot run this config (None: it can): ZeRO stage, offload and their knobs."""
    stage, off = cfg.zero.stage, cfg.offload
    if err := choice_problem("zero.stage", stage, [0, 1, 2, 3]):
        return err
    for key, value in (("offload.optimizer", off.optimizer), ("offload.param", off.param)):
        if err := choice_problem(key, value, ["none", "cpu", "nvme"]):
            return err
    if problem := combination_problem(stage, off.optimizer, off.param, cfg.parallel.pp):
        return f"{problem}; use {_either(combination_alternatives(stage, off.optimizer, off.param, cfg.parallel.pp))}"
    if cfg.parallel.pipeline_schedule != "1f1b" or cfg.parallel.virtual_stages != 1:
        return (f"parallel.pipeline_schedule={cfg.parallel.pipeline_schedule} parallel.virtual_stages="
                f"{cfg.parallel.virtual_stages}: DeepSpeed's pipeline engine runs 1f1b with one stage per rank; use "
                "backend=fsdp2 zero=stage2 for torch's schedules, or parallel.pipeline_schedule=1f1b "
                "parallel.virtual_stages=1")
    if cfg.parallel.dp_replicate != 1:
        return (f"parallel.dp_replicate={cfg.parallel.dp_replicate} (HSDP: shard within groups, replicate across them) "
                f"is backend=fsdp2's; use backend=fsdp2 zero=stage3, or parallel.dp_replicate=1")
    if "nvme" in (off.optimizer, off.param) and not off.nvme_path:
        return "offload=nvme needs offload.nvme_path=/a/fast/local/dir for the swap files"
    return _knobs_problem(cfg) or _experts_problem(cfg)


def _experts_problem(cfg: TrainConfig) -> Optional[str]:
    """What DeepSpeed's checkpoints cannot hold of experts split over ep ranks."""
    p = cfg.parallel
    if p.ep <= 1 or cfg.model.moe.num_experts == 0:
        return None
    # its own checkpoint files keep experts through its MoE layer class only: they would
    # keep the first ep rank's experts and lose the others
    if (cfg.train.native_checkpoint or not cfg.train.universal_checkpoint):
        return (f"parallel.ep={p.ep} checkpoints only in the layout-free format; drop train.native_checkpoint=true "
                "and keep train.universal_checkpoint=true")
    if cfg.zero.stage == 0 and cfg.precision.dtype != "fp32" and p.pp == 1:
        return (f"parallel.ep={p.ep} with precision={cfg.precision.dtype} at zero=stage0 cannot save its experts (that "
                "optimizer's flat fp32 buffers have only DeepSpeed's own checkpoint); use zero=stage1, 2 or 3")
    return None


def _knobs_problem(cfg: TrainConfig) -> Optional[str]:
    """Sizes and counts DeepSpeed would otherwise reject late (or divide by)."""
    z, off = cfg.zero, cfg.offload
    for key, value in (("zero.reduce_bucket_size", z.reduce_bucket_size),
                       ("zero.allgather_bucket_size", z.allgather_bucket_size),
                       ("zero.stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size),
                       ("zero.stage3_max_live_parameters", z.stage3_max_live_parameters),
                       ("offload.optimizer_buffer_count", off.optimizer_buffer_count),
                       ("offload.param_buffer_count", off.param_buffer_count),
                       ("offload.param_buffer_size", off.param_buffer_size),
                       ("offload.aio_block_size", off.aio_block_size),
                       ("offload.aio_queue_depth", off.aio_queue_depth),
                       ("offload.aio_intra_op_parallelism", off.aio_intra_op_parallelism)):
        if value < 1:
            return f"{key}={value} must be >= 1"
    for key, value in (("zero.stage3_param_persistence_threshold", z.stage3_param_persistence_threshold),
                       ("offload.param_max_in_cpu", off.param_max_in_cpu)):
        if value < 0:
            return f"{key}={value} must be >= 0"
    return None


def layout_free_unsupported(cfg: TrainConfig, layout: Layout) -> bool:
    """Mixed precision at ZeRO-0 without a pipeline runs DeepSpeed's FP16_UnfusedOptimizer (also for bf16),
    whose own fp32 master copies (its fp32_groups) the layout-free checkpoint does not read or write."""
    return cfg.zero.stage == 0 and cfg.precision.dtype != "fp32" and layout.pp == 1


def config_warnings(cfg: TrainConfig, layout: Layout) -> list[str]:
    """What DeepSpeed's checkpoints will not do in this legal config, printed once before launch."""
    found = []
    if layout_free_unsupported(cfg, layout):
        found.append(f"precision={cfg.precision.dtype} with zero=stage0: checkpoints hold DeepSpeed's files only (its "
                     "FP16_UnfusedOptimizer keeps fp32 masters of its own the layout-free writer does not map yet), so "
                     "resume works in this layout only, with train.trust_pickled_checkpoint=true (they load by "
                     "unpickling); use zero=stage1 to resume into any layout")
    elif not cfg.train.universal_checkpoint and not cfg.train.trust_pickled_checkpoint:
        found.append("train.universal_checkpoint=false: checkpoints hold DeepSpeed's pickled files only, and resuming "
                     "them needs train.trust_pickled_checkpoint=true")
    return found


def layout_problem(cfg: TrainConfig, layout: Layout) -> Optional[str]:
    return None  # its pipeline (1F1B) takes any number of micro-batches
