"""Cross-field rules, checked before any process group, model or engine exists.

Each rule is a function that returns None or a one-line message naming the key(s) and the fix.
An engine's own rules (DeepSpeed's ZeRO x offload x pipeline table, its knobs) live in its folder
and come in through validate()'s engine_problem; engines enforce several of them late (or silently
ignore them), so they are refused up front.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from megaframe.config.attention_rules import check_attention, core_device_problem
from megaframe.config.dataset_meta import SidecarError, recorded_vocab_size
from megaframe.config.empty_values import empty_value_problem
from megaframe.config.fp8_rules import fp8_problem
from megaframe.config.choices import choice_problem, unread_key
from megaframe.config.gpus import DENSE_PEAK_TFLOPS, known_gpu
from megaframe.config.optim_rules import optim_problem
from megaframe.config.launcher_rules import check_launcher, check_slurm_nodes, timeout_warning
from megaframe.config.size_limits import absurd_size_problem
from megaframe.config.schema import TrainConfig
from megaframe.parallel.dims import LAYOUT_AXES, RANK_AXES, OnGrid, ParallelDims

# latest-run is chosen once, by megaframe-train before it starts any rank (the ranks it starts get
# the run dir it chose: resume_hint.py); where that does not happen, refused rather than read as a directory
UNRESOLVED = ("train.resume=latest-run is chosen by a plain megaframe-train command before it starts its "
              "ranks (not in a -m sweep, not under torchrun, srun or Ray, where each rank would choose on its "
              "own); name the run with hydra.run.dir=DIR and train.resume=auto")


class ConfigError(ValueError):
    """A configuration the run cannot honour; str(err) is a single line for the user."""


@dataclass(frozen=True)
class Layout(OnGrid):
    """The rank grid resolved against the world size, plus the step shape. The degrees are the
    grid's (ParallelDims); tp, pp, dp and world_size read them from there."""

    grid: ParallelDims
    micro_batch_size: int
    global_batch_size: int

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step (pipeline micro-batches when pp > 1)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) (n may be a typo's 10**9)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


# The grid's axes besides dp that own ranks (tp, pp, cp), in the order messages name them; the
# ranks of one data-parallel replica are their product.
MODEL_AXES = tuple(axis for axis in LAYOUT_AXES if axis in RANK_AXES and axis != "dp")


def model_parallel_size(p) -> int:
    """Ranks of one data-parallel replica: the product of the degrees parallel.<MODEL_AXES> sets."""
    return math.prod(getattr(p, axis) for axis in MODEL_AXES)


def requested_world_size(cfg: TrainConfig) -> int:
    """World size the config asks for when no launcher dictates one (dp=None means 1 replica)."""
    return model_parallel_size(cfg.parallel) * (cfg.parallel.dp or 1)


def resolve_layout(cfg: TrainConfig, world_size: int) -> Layout:
    """Degrees for this world; raises ConfigError when tp*cp*pp*dp cannot equal world_size."""
    p = cfg.parallel
    for axis in (axis for axis in LAYOUT_AXES if axis != "dp"):
        if getattr(p, axis) < 1:
            raise ConfigError(f"parallel.{axis}={getattr(p, axis)} must be >= 1")
    if p.dp is not None and p.dp < 1:
        raise ConfigError(f"parallel.dp={p.dp} must be >= 1 (or null to fill the world)")
    model_parallel = model_parallel_size(p)
    # tp and pp always, the other axes when used
    named_axes = [axis for axis in MODEL_AXES if axis in ("tp", "pp") or getattr(p, axis) > 1]
    named = "*".join(f"parallel.{axis}" for axis in named_axes)
    degrees = "*".join(str(getattr(p, axis)) for axis in named_axes)
    if p.dp is None:
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by {named}={model_parallel}; "
                f"launch a multiple of {model_parallel} ranks")
        dp = world_size // model_parallel
    else:
        dp = p.dp
        if model_parallel * dp != world_size:
            raise ConfigError(
                f"{named}*parallel.dp={degrees}*{dp}={model_parallel * dp} but the world "
                f"size is {world_size}; set parallel.dp={world_size // model_parallel if world_size % model_parallel == 0 else 'null'} "
                f"or launch {model_parallel * dp} ranks")
    if (dp * p.cp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide dp*cp={dp * p.cp} (experts are split over the data- and "
                          f"context-parallel ranks); launch a multiple of {p.ep * model_parallel} ranks or lower parallel.ep")
    if err := replicas_problem(p.dp_replicate, dp * p.cp):
        raise ConfigError(err)
    # parallel.<axis> for every layout axis (dp resolved above) and HSDP's replicas
    grid = ParallelDims(**{axis: getattr(p, axis) for axis in LAYOUT_AXES if axis != "dp"}, dp=dp,
                        dp_replicate=p.dp_replicate)
    return Layout(grid, p.micro_batch_size, p.global_batch_size)


def replicas_problem(replicas: int, ranks: int) -> Optional[str]:
    """parallel.dp_replicate (HSDP): whole replicas of an equal shard group of the `ranks` dp x cp ranks
    (the grid's own rule, worded with the values that fit)."""
    if replicas < 1 or ranks % replicas:
        return (f"parallel.dp_replicate={replicas} must divide the {ranks} data-parallel ranks (dp x cp) into "
                f"equal shard groups; pick it in {_divisors(ranks)}")
    return None


# ---- rules on single groups -------------------------------------------------------------------

def check_finite(cfg: TrainConfig) -> Optional[str]:
    """No float key takes nan or inf: nan passes every `<`/`<=` test a range rule can write, and an
    infinite timeout, rate or threshold is a wait or a guard that never ends or never fires."""
    def walk(node, prefix: str) -> Optional[str]:
        for f in fields(node):
            value, key = getattr(node, f.name), prefix + f.name
            if is_dataclass(value):
                if err := walk(value, key + "."):
                    return err
            elif isinstance(value, float) and not math.isfinite(value):
                return f"{key}={value} must be a finite number"
        return None

    return walk(cfg, "")


def check_model(cfg: TrainConfig) -> Optional[str]:
    m = cfg.model
    for key, value, allowed in (("model.arch", m.arch, ["gpt2", "llama"]),
                                ("model.norm", m.norm, ["layernorm", "rmsnorm"]),
                                ("model.activation", m.activation, ["gelu", "gelu_exact", "swiglu"]),
                                ("model.position_embedding", m.position_embedding, ["learned", "rope"])):
        if err := choice_problem(key, value, allowed):
            return err
    for key, value in (("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                       ("model.num_attention_heads", m.num_attention_heads),
                       ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)):
        if value is not None and value < 1:
            return f"{key}={value} must be >= 1"
    if m.seq_length < 1:
        return f"model.seq_length={m.seq_length} must be >= 1"
    if m.hidden_size % m.num_attention_heads:
        heads = [h for h in _divisors(m.hidden_size) if h <= 4 * m.num_attention_heads]
        return (f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                f"{m.num_attention_heads}; pick heads in {heads[-6:]}")
    kv = m.num_kv_heads if m.num_kv_heads is not None else m.num_attention_heads
    if kv < 1 or m.num_attention_heads % kv:
        return (f"model.num_kv_heads={m.num_kv_heads} must divide model.num_attention_heads="
                f"{m.num_attention_heads}; pick one of {_divisors(m.num_attention_heads)}")
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    if m.head_dim is not None and m.head_dim < 1:
        return f"model.head_dim={m.head_dim} must be >= 1 (or null for hidden_size/heads)"
    if m.position_embedding == "rope" and head_dim % 2:
        return f"model.position_embedding=rope needs an even head size, got {head_dim}"
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        return f"model.ffn_hidden_size={m.ffn_hidden_size} must be >= 1 (or null for the default)"
    if m.vocab_size is not None and m.vocab_size < 1:
        return f"model.vocab_size={m.vocab_size} must be >= 1 (or null to take the tokenizer's)"
    if not 0.0 <= m.dropout < 1.0:
        return f"model.dropout={m.dropout} must be in [0, 1)"
    # each of these otherwise made every step non-finite and ended the run after launch
    for key, value in (("model.init_std", m.init_std), ("model.norm_eps", m.norm_eps),
                       ("model.rope_theta", m.rope_theta)):
        if not (math.isfinite(value) and value > 0):
            return f"{key}={value} must be a finite number > 0"
    return None


def check_optim(cfg: TrainConfig) -> Optional[str]:
    o = cfg.optim
    if err := choice_problem("optim.lr_decay", o.lr_decay, ["cosine", "linear", "constant"]):
        return err
    for key, value in (("optim.lr", o.lr), ("optim.eps", o.eps)):
        if not (math.isfinite(value) and value > 0):  # nan fails every comparison: test what is allowed
            return f"{key}={value} must be a finite number > 0"
    if not 0 <= o.min_lr <= o.lr:
        return f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]"
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        return f"optim.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9,0.95]"
    for key, value in (("optim.warmup_steps", o.warmup_steps), ("optim.grad_clip", o.grad_clip),
                       ("optim.weight_decay", o.weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            return f"{key}={value} must be a finite number >= 0"
    return optim_problem(cfg)  # optim.name and its optimizer's own keys (optim.muon.*)


def resume_path_problem(resume: str) -> str:
    """train.resume=PATH that is not a directory: none there, or a file (state.json, a shard) where its
    checkpoint's directory was meant."""
    path = Path(resume)
    if not path.exists():
        return f"train.resume={resume!r}: no such checkpoint directory; use auto, none, latest-run or an existing path"
    holder = next((folder for folder in path.parents if (folder / "state.json").is_file()), None)  # shards/X too
    fix = f"its checkpoint, train.resume={holder}" if holder else \
        "a checkpoint's directory (global_stepN) or a run's checkpoints directory"
    return f"train.resume={resume!r}: a file, not a checkpoint directory; pass {fix}"


def check_train(cfg: TrainConfig) -> Optional[str]:
    t = cfg.train
    if t.max_steps < 1:
        return f"train.max_steps={t.max_steps} must be >= 1"
    for key, value in (("train.log_interval", t.log_interval),):
        if value < 1:
            return f"{key}={value} must be >= 1"
    for key, value in (("train.eval_interval", t.eval_interval), ("train.save_interval", t.save_interval),
                       ("train.eval_steps", t.eval_steps), ("train.keep_checkpoints", t.keep_checkpoints)):
        if value < 0:
            zero = "0 keeps every checkpoint" if key == "train.keep_checkpoints" else "0 disables it"
            return f"{key}={value} must be >= 0 ({zero})"
    if t.exit_at_step is not None and not 1 <= t.exit_at_step <= t.max_steps:
        return f"train.exit_at_step={t.exit_at_step} must be in [1, train.max_steps={t.max_steps}] or null"
    # a plain megaframe-train replaces latest-run (resume_hint.latest_run) before composing: one left
    # here is unresolved (a -m sweep), and the trainer would read it as the directory ./latest-run
    if t.resume == "latest-run":
        return UNRESOLVED
    if t.resume not in ("auto", "none") and not Path(t.resume).is_dir():
        return resume_path_problem(t.resume)
    if cfg.logging.wandb.mode is not None and (err := choice_problem("logging.wandb.mode", cfg.logging.wandb.mode,
                                                                        ["offline", "online", "disabled"])):
        return err
    if t.max_consecutive_skips < 1:
        return f"train.max_consecutive_skips={t.max_consecutive_skips} must be >= 1 (skipped steps in a row that stop the run)"
    if not (math.isfinite(t.collective_timeout_s) and t.collective_timeout_s > 0):
        return f"train.collective_timeout_s={t.collective_timeout_s} must be a finite number of seconds > 0"
    if not (math.isfinite(t.join_timeout_s) and t.join_timeout_s > 0):
        return f"train.join_timeout_s={t.join_timeout_s} must be a finite number of seconds > 0"
    if not 0 <= t.seed < 2**32:  # numpy's generators take no other seed
        return f"train.seed={t.seed} must be in [0, 2**32)"
    if t.eval_interval and t.eval_steps == 0:
        return (f"train.eval_steps=0 with train.eval_interval={t.eval_interval}: an evaluation of no batches has no "
                f"loss; set train.eval_steps >= 1, or train.eval_interval=0 to not evaluate")
    if err := choice_problem("train.on_batch_size_change", t.on_batch_size_change, ["refuse", "move_position"]):
        return err
    return check_fast_tier(t) or check_spike(t.spike)


def check_fast_tier(t) -> Optional[str]:
    """train.fast_save_interval (checkpoint/fast_tier.py): parts of the layout-free checkpoint."""
    if t.fast_save_interval < 0:
        return f"train.fast_save_interval={t.fast_save_interval} must be >= 0 (0 disables the fast tier)"
    if not t.fast_save_interval:
        return None
    if not t.universal_checkpoint:
        return ("train.fast_save_interval keeps parts of the layout-free checkpoint in node-local memory; "
                "set train.universal_checkpoint=true")
    if t.async_save:
        return ("train.fast_save_interval with train.async_save=true is not supported yet; set train.async_save=false "
                "(the fast tier writes to node-local memory, which takes milliseconds)")
    if not str(t.fast_save_dir).strip():
        return "train.fast_save_dir is empty; give a node-local directory of your own, e.g. /dev/shm/megaframe-$USER"
    return None


def check_cluster(cfg: TrainConfig) -> Optional[str]:
    """The planner's hardware figures: a negative peak or reservation made every layout 'fit'."""
    c = cfg.cluster
    if c.gpu is not None and not known_gpu(c.gpu):
        return (f"cluster.gpu={c.gpu}: no dense peaks known for it (known: "
                f"{', '.join(key for key, _ in DENSE_PEAK_TFLOPS)}); set cluster.peak_tflops instead")
    for key, value in (("cluster.peak_tflops", c.peak_tflops), ("cluster.memory_gb", c.memory_gb),
                       ("cluster.host_memory_gb", c.host_memory_gb)):
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{key}={value} must be a finite number > 0, or null"
    for key, value in (("cluster.intra_node_gbps", c.intra_node_gbps), ("cluster.inter_node_gbps", c.inter_node_gbps),
                       ("cluster.host_gbps", c.host_gbps)):
        if not (math.isfinite(value) and value > 0):
            return f"{key}={value} must be a finite number > 0"
    if not (math.isfinite(c.reserved_gb) and c.reserved_gb >= 0):
        return f"cluster.reserved_gb={c.reserved_gb} must be a finite number >= 0"
    if c.gpus_per_node is not None and c.gpus_per_node < 1:
        return f"cluster.gpus_per_node={c.gpus_per_node} must be >= 1, or null"
    return None


def check_spike(spike) -> Optional[str]:
    """train.spike: a known action and metric, a window that has a spread, a threshold that can trigger."""
    for key, value, allowed in (("train.spike.action", spike.action, ["skip", "stop", "warn", "off"]),
                                ("train.spike.metric", spike.metric, ["zscore", "ratio"])):
        if err := choice_problem(key, value, allowed):
            return err
    if spike.window < 2:
        return f"train.spike.window={spike.window} must be >= 2 steps (the baseline needs a spread)"
    if spike.metric == "ratio" and not spike.threshold > 1:
        return f"train.spike.threshold={spike.threshold} must be > 1 with train.spike.metric=ratio (loss / recent mean)"
    if not spike.threshold > 0:
        return f"train.spike.threshold={spike.threshold} must be > 0 (a z-score)"
    return None


def _missing_files(key: str, prefix: str) -> Optional[str]:
    missing = next((suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()), None)
    if missing is None:
        return None
    if prefix.endswith("/") or Path(prefix).is_dir():  # newdata/ looked for newdata/.bin
        folder = Path(prefix)
        found = sorted(p.stem for p in folder.glob("*.bin") if p.with_suffix(".idx").is_file())[:3] \
            if folder.is_dir() else []
        example = f"{folder / found[0]}" if found else f"{folder / 'NAME'} for NAME.bin and NAME.idx"
        return (f"{key}: {prefix} names a folder, not a dataset; a dataset is named by the prefix of its files, "
                f"e.g. {example}" + (f" (there: {', '.join(found)})" if found else ""))
    suffix = Path(prefix).suffix
    stem = prefix[:len(prefix) - len(suffix)]
    if suffix in (".bin", ".idx") and Path(stem + ".bin").is_file() and Path(stem + ".idx").is_file():
        return f"{key}: {prefix} is one of a dataset's files; name the dataset by their prefix: {stem}"
    if suffix in (".txt", ".jsonl", ".parquet") and Path(prefix).is_file():  # text, not yet tokenized
        dataset = str(Path("data") / Path(stem).name)
        return (f"{key}: {prefix} is text, not a dataset: tokenize it first with 'megaframe-preprocess --input "
                f"{prefix} --output-prefix {dataset}', then name {dataset}")
    return (f"{key}: {prefix}{missing} not found; build it with "
            f"'megaframe-preprocess --input FILES --output-prefix {prefix}'")


def check_blend(d) -> Optional[str]:
    """data.blend, data.valid_blend and data.blend_schedule: well formed, files present."""
    from megaframe.config.blend_spec import parse_blend

    if d.blend_schedule and not d.blend:
        return "data.blend_schedule needs data.blend (the sources its weights are for)"
    if d.valid_blend and not d.blend:
        return "data.valid_blend needs data.blend; with data.path, data.valid_fraction holds out validation"
    if not d.blend:
        return None
    if d.path is not None:
        return f"data.path={d.path} and data.blend are both set; put the dataset in data.blend and set data.path=null"
    try:
        _, prefixes = parse_blend(list(d.blend))
        valid_prefixes = parse_blend(list(d.valid_blend), "data.valid_blend")[1] if d.valid_blend else []
    except ValueError as err:
        return str(err)
    for key, prefix in [("data.blend", p) for p in prefixes] + [("data.valid_blend", p) for p in valid_prefixes]:
        problem = _missing_files(key, prefix)
        if problem:
            return problem
    last = 0
    example = f"data.blend_schedule='[[1000,[{','.join(['0.5'] * len(prefixes))}]]]'"
    for entry in d.blend_schedule or []:
        ok = not isinstance(entry, str) and hasattr(entry, "__len__")
        weights = entry[1] if ok and len(entry) == 2 else None  # [[5,1]]: a bare number where the weights go
        if not ok or len(entry) != 2 or isinstance(entry[0], bool) or not isinstance(entry[0], int) \
                or isinstance(weights, str) \
                or not hasattr(weights, "__len__") or len(weights) != len(prefixes):
            return (f"data.blend_schedule: {list(entry) if ok else entry} must be [STEP, [{len(prefixes)} weights]], "
                    f"one weight per data.blend source, e.g. {example}")
        if entry[0] <= last:
            return f"data.blend_schedule: steps must increase from 1 (got {entry[0]} after {last}); e.g. {example}"
        if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
               for w in entry[1]) or not 0 < sum(entry[1]) < math.inf:  # nan and inf passed: a meaningless blend
            return (f"data.blend_schedule: the weights at step {entry[0]} must be finite numbers >= 0, not all 0, "
                    f"summing to a finite number")
        last = entry[0]
    return None


def check_data(cfg: TrainConfig) -> Optional[str]:
    d = cfg.data
    if not 0.0 <= d.valid_fraction < 1.0:
        return f"data.valid_fraction={d.valid_fraction} must be in [0, 1)"
    if d.valid_path is not None and d.blend:
        return (f"data.valid_path={d.valid_path} is for data.path; with data.blend name the validation sources "
                f"in data.valid_blend='[1.0,{d.valid_path}]'")
    if d.valid_path is not None and (problem := _missing_files(f"data.valid_path={d.valid_path}", d.valid_path)):
        return problem
    if cfg.train.eval_interval and d.valid_fraction == 0 and not d.valid_blend and d.valid_path is None:
        return ("data.valid_fraction=0 leaves nothing to evaluate; set train.eval_interval=0, a fraction > 0, "
                "or a validation dataset in data.valid_path")
    if d.tokenizer != "byte" and not Path(d.tokenizer).is_dir():
        return f"data.tokenizer={d.tokenizer!r} is neither 'byte' nor a local Hugging Face tokenizer directory"
    if d.cache_dir is not None and Path(d.cache_dir).exists() and not Path(d.cache_dir).is_dir():
        return f"data.cache_dir={d.cache_dir} is a file, not a directory; point it at a directory (or null for the default)"
    problem = check_blend(d)
    if problem or d.path is None:
        return problem
    problem = _missing_files(f"data.path={d.path}", d.path)
    if problem:
        return problem
    if cfg.model.vocab_size is not None:
        try:
            data_vocab = recorded_vocab_size(d.path)
        except SidecarError as err:
            return str(err)
        if data_vocab and cfg.model.vocab_size < data_vocab:
            return (f"model.vocab_size={cfg.model.vocab_size} is smaller than the dataset's vocabulary "
                    f"{data_vocab} ({d.path}.json); set model.vocab_size=null or >= {data_vocab}")
    return None


def check_pipeline(cfg: TrainConfig) -> Optional[str]:
    p = cfg.parallel
    if err := choice_problem("parallel.pipeline_partition", p.pipeline_partition, ["uniform", "parameters"]):
        return err
    if p.pp > cfg.model.num_layers:
        return f"parallel.pp={p.pp} exceeds model.num_layers={cfg.model.num_layers}; use pp <= num_layers"
    return None


def check_batch(cfg: TrainConfig, layout: Layout) -> Optional[str]:
    p = cfg.parallel
    if p.micro_batch_size < 1 or p.global_batch_size < 1:
        return "parallel.micro_batch_size and parallel.global_batch_size must be >= 1"
    per_step = p.micro_batch_size * layout.dp
    if p.global_batch_size % per_step:
        ok = list(range(per_step, 4 * p.global_batch_size + per_step, per_step)[:4])  # not a list of gbs/per_step
        return (f"parallel.global_batch_size={p.global_batch_size} is not divisible by "
                f"parallel.micro_batch_size*dp={p.micro_batch_size}*{layout.dp}={per_step}; "
                f"use a global batch in {ok} or change micro_batch_size")
    return None


def check_tensor_parallel(cfg: TrainConfig) -> Optional[str]:
    """tp must split the query heads and the MLP; the padded vocabulary is a multiple of tp by construction."""
    p, m = cfg.parallel, cfg.model
    tp = p.tp
    if tp == 1:
        if p.sequence_parallel:
            return "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence over TP ranks)"
        return None
    heads = m.num_attention_heads
    if heads % tp:
        return (f"parallel.tp={tp} does not divide model.num_attention_heads={heads}; "
                f"pick tp in {_divisors(heads)}")
    # kv heads: split when tp divides them, else replicated on every TP rank (see model/gpt.py)
    ffn = ffn_hidden_size(m)
    if ffn % tp:
        return f"parallel.tp={tp} does not divide model.ffn_hidden_size={ffn}; pick tp in {_divisors(ffn)[:8]}"
    if p.sequence_parallel and m.seq_length % tp:
        return (f"parallel.sequence_parallel=true needs model.seq_length={m.seq_length} divisible by "
                f"parallel.tp={tp}")
    return None


def check_context_parallel(cfg: TrainConfig) -> Optional[str]:
    """parallel.cp: the sequence must cut into 2*cp zig-zag chunks; Ulysses must split the heads
    each TP rank holds; sequence parallelism must split each rank's tokens."""
    p, m = cfg.parallel, cfg.model
    if err := choice_problem("parallel.cp_impl", p.cp_impl, ["ring", "ulysses"]):
        return err
    if p.cp == 1:
        return None
    if m.seq_length % (2 * p.cp):
        return (f"model.seq_length={m.seq_length} must be divisible by 2*parallel.cp={2 * p.cp} (each sequence is cut "
                f"into 2*cp zig-zag chunks); pick cp in "
                f"{[c for c in _divisors(m.seq_length // 2) if c > 1][:8]}")
    if p.cp_impl == "ulysses":
        kv = m.num_kv_heads or m.num_attention_heads
        local_kv = kv // p.tp if kv % p.tp == 0 else kv
        if local_kv % p.cp or (m.num_attention_heads // p.tp) % p.cp:
            return (f"parallel.cp_impl=ulysses needs parallel.cp={p.cp} to divide the {local_kv} kv heads and "
                    f"{m.num_attention_heads // p.tp} query heads of each TP rank; use parallel.cp_impl=ring")
    if p.sequence_parallel and (m.seq_length // p.cp) % p.tp:
        return (f"parallel.sequence_parallel=true with parallel.cp={p.cp} needs each rank's {m.seq_length // p.cp} "
                f"tokens (model.seq_length/cp) divisible by parallel.tp={p.tp}")
    return None


def check_moe(cfg: TrainConfig) -> Optional[str]:
    """model.moe and parallel.ep: the router's shape, and the layouts expert parallelism takes."""
    m, p = cfg.model.moe, cfg.parallel  # parallel.ep >= 1: resolve_layout refused it before this runs
    if m.num_experts < 0:
        return f"model.moe.num_experts={m.num_experts} must be >= 0 (0 = dense)"
    if m.top_k < 1:
        return f"model.moe.top_k={m.top_k} must be >= 1"
    if m.layer_freq < 1 or m.first_dense_layers < 0:
        return (f"model.moe.layer_freq={m.layer_freq} must be >= 1 and model.moe.first_dense_layers="
                f"{m.first_dense_layers} >= 0")
    for key, value in (("model.moe.ffn_hidden_size", m.ffn_hidden_size), ("model.moe.capacity_factor", m.capacity_factor)):
        if value is not None and value <= 0:
            return f"{key}={value} must be > 0 (or null)"
    for key, value in (("model.moe.shared_experts", m.shared_experts), ("model.moe.aux_loss_coeff", m.aux_loss_coeff),
                       ("model.moe.z_loss_coeff", m.z_loss_coeff), ("model.moe.bias_update_rate", m.bias_update_rate)):
        if value < 0:
            return f"{key}={value} must be >= 0"
    if err := choice_problem("model.moe.router_score", m.router_score, ["softmax", "sigmoid"]):
        return err
    if m.num_experts == 0:
        if p.ep > 1:
            return f"parallel.ep={p.ep} needs experts to split; set model.moe.num_experts"
        return unread_key(m, "model.moe", "num_experts", "experts (model.moe.num_experts > 0)")
    if m.top_k > m.num_experts:
        return f"model.moe.top_k={m.top_k} must be between 1 and model.moe.num_experts={m.num_experts}"
    if m.first_dense_layers >= cfg.model.num_layers:
        return (f"model.moe.first_dense_layers={m.first_dense_layers} must be below model.num_layers="
                f"{cfg.model.num_layers} (no block would hold experts)")
    if m.num_experts % p.ep:
        return (f"parallel.ep={p.ep} must divide model.moe.num_experts={m.num_experts}; pick ep in "
                f"{[d for d in _divisors(m.num_experts) if d <= 64]}")
    if p.pp > 1 and cfg.precision.dtype == "fp16":
        return ("parallel.pp > 1 with model.moe does not take precision=fp16 yet (a stage's router losses would need "
                "the loss scale); use precision=bf16")
    if p.tp > 1 and ((cfg.model.seq_length // p.cp) * p.micro_batch_size) % p.tp:
        return (f"model.moe with parallel.tp={p.tp} splits each rank's tokens over the TP ranks; make "
                f"micro_batch_size*seq_length/cp divisible by {p.tp}")
    return None


def check_plan(cfg: TrainConfig) -> Optional[str]:
    """The planner's assumed utilisation is a fraction of the peak."""
    if not 0 < cfg.plan.mfu <= 1:
        return f"plan.mfu={cfg.plan.mfu} must be in (0, 1] (a fraction of the peak; 0.4 is typical)"
    return None


def warnings(cfg: TrainConfig, layout: Layout,
             engine_warnings: Optional[Callable[[TrainConfig, Layout], list[str]]] = None) -> list[str]:
    """Legal but wasteful settings, printed once before launch; engine_warnings adds the engine's own
    (its plug's config_warnings)."""
    found = []
    if layout.pp > 1 and layout.grad_accum_steps < layout.pp:
        found.append(f"parallel.pp={layout.pp} with {layout.grad_accum_steps} micro-batches per step leaves stages "
                     f"idle; raise parallel.global_batch_size to >= {layout.pp * layout.micro_batch_size * layout.dp} "
                     f"(bubble (p-1)/(m+p-1) = {(layout.pp - 1) / (layout.grad_accum_steps + layout.pp - 1):.0%})")
    if elastic := timeout_warning(cfg):
        found.append(elastic)
    return found + (engine_warnings(cfg, layout) if engine_warnings else [])


def check_precision(cfg: TrainConfig, fp16_supported: Optional[Callable[[], bool]],
                    bf16_supported: Optional[Callable[[], bool]] = None,
                    fp8_device: Optional[Callable[[], Optional[tuple[int, int]]]] = None) -> Optional[str]:
    dtype = cfg.precision.dtype
    if err := choice_problem("precision.dtype", dtype, ["fp32", "bf16", "fp16"]):
        return err
    p = cfg.precision
    for key, value, low in (("precision.initial_scale_power", p.initial_scale_power, 0),
                            ("precision.loss_scale_window", p.loss_scale_window, 1),
                            ("precision.hysteresis", p.hysteresis, 1)):
        if value < low:
            return f"{key}={value} must be >= {low}"
    if p.min_loss_scale <= 0:
        return f"precision.min_loss_scale={p.min_loss_scale} must be > 0"
    if dtype == "fp16" and fp16_supported is not None and not fp16_supported():
        return ("precision=fp16: this device has no fp16 support (DeepSpeed refuses it); "
                "use precision=bf16 or precision=fp32")
    if dtype == "bf16" and bf16_supported is not None and not bf16_supported():
        return ("precision=bf16: this device has no native bf16 (on NVIDIA GPUs it starts with Ampere, sm80); "
                "use precision=fp16 or precision=fp32")
    return fp8_problem(cfg, ffn_hidden_size(cfg.model), fp8_device)  # config/fp8_rules.py


def validate(cfg: TrainConfig, world_size: int,
             fp16_supported: Optional[Callable[[], bool]] = None,
             bf16_supported: Optional[Callable[[], bool]] = None,
             engine_problem: Optional[Callable[[TrainConfig], Optional[str]]] = None,
             engine_layout_problem: Optional[Callable[[TrainConfig, Layout], Optional[str]]] = None,
             per_module_gather_stages: Sequence[int] = (3,),
             fp8_device: Optional[Callable[[], Optional[tuple[int, int]]]] = None) -> Layout:
    """Run every rule; raise ConfigError with the first message, else return the resolved layout.

    The engine's part comes from its plug (backends/registry.py), which callers hand over:
    fp16_supported / bf16_supported ask the device whether it computes that precision, and
    engine_problem holds the engine's own rules (its ZeRO stages, offload and knobs) and
    engine_layout_problem those that need the resolved layout (a pipeline schedule's micro-batch
    count). None leaves that part to the engine itself, after launch. per_module_gather_stages: the
    ZeRO stages at which the engine gathers parameters module by module (its facts; ZeRO-3's own);
    fp8_device: this machine's GPU capability (None on the CPU) for precision.fp8's device rules."""
    engine_rule = engine_problem or (lambda _: None)
    # check_finite last: the rules before it say a key's range, which helps more than "finite";
    # empty values and absurd sizes first: the others would word an empty key's cause as something
    # else, and walk a typo's 10**12 (its divisors, a list of batch sizes) before refusing it
    for rule in (empty_value_problem, absurd_size_problem,
                 check_model, check_optim, check_train, check_cluster, check_data, check_attention, engine_rule,
                 check_pipeline,
                 check_launcher, check_plan, check_finite):
        if err := rule(cfg):
            raise ConfigError(err)
    layout = resolve_layout(cfg, world_size)
    for rule in (check_tensor_parallel, check_context_parallel, check_moe):
        if err := rule(cfg):
            raise ConfigError(err)
    for err in (check_batch(cfg, layout), check_slurm_nodes(cfg, layout.world_size),
                check_compile_scope(cfg, layout, per_module_gather_stages),
                engine_layout_problem(cfg, layout) if engine_layout_problem else None):
        if err:
            raise ConfigError(err)
    if err := check_precision(cfg, fp16_supported, bf16_supported, fp8_device):
        raise ConfigError(err)
    # fp8_device answers (its GPU's capability, None on the CPU) only where this host's device decides
    if fp8_device is not None and (err := core_device_problem(cfg, lambda: fp8_device() is not None)):
        raise ConfigError(err)
    return layout


def check_compile_scope(cfg: TrainConfig, layout: Layout,
                        per_module_gather_stages: Sequence[int] = (3,)) -> Optional[str]:
    """train.compile_scope=model: one graph over the whole forward, so nothing in it may leave the
    process or hook each module: no tp/cp/pp/ep collectives, no MoE routing (its graph breaks), no
    engine gathering parameters per module (ZeRO-3, FSDP2 at any stage: per_module_gather_stages)."""
    t = cfg.train
    if err := choice_problem("train.compile_scope", t.compile_scope, ["blocks", "model"]):
        return err
    if t.compile_scope != "model":
        return None
    if not t.compile:
        return "train.compile_scope=model says what train.compile compiles; set train.compile=true"
    blockers = [f"{axis}={getattr(layout.grid, axis)}" for axis in ("tp", "cp", "pp", "ep")
                if getattr(layout.grid, axis) > 1]
    if cfg.model.moe.num_experts:
        blockers.append("an MoE model")
    if cfg.zero.stage in per_module_gather_stages:
        blockers.append(f"backend={cfg.backend.name} zero={cfg.zero.stage}")
    if blockers:
        return (f"train.compile_scope=model compiles the whole forward as one graph, which {', '.join(blockers)} "
                f"cannot run in; use train.compile_scope=blocks")
    return None


def ffn_hidden_size(cfg_model) -> int:
    """The MLP width: configured, or 4h for GELU / 8h/3 rounded up to a multiple of 64 for SwiGLU."""
    if cfg_model.ffn_hidden_size is not None:
        return cfg_model.ffn_hidden_size
    if cfg_model.activation == "swiglu":
        return 64 * math.ceil(8 * cfg_model.hidden_size / 3 / 64)
    return 4 * cfg_model.hidden_size


# model.make_vocab_size_divisible_by=null on a GPU: Megatron's default; a multiple of 128 rows keeps the
# head's and the embedding's matmuls on whole tensor-core tiles
GPU_VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, divisible_by: Optional[int], tp: int, device_type: str = "cuda") -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by * tp. divisible_by
    None: GPU_VOCAB_MULTIPLE on a GPU, 1 elsewhere (a CPU gains nothing from padded rows), so only
    TP's equal shards remain. device_type: where the model trains ("cuda" where the planner plans
    for a cluster)."""
    if divisible_by is None:
        divisible_by = GPU_VOCAB_MULTIPLE if device_type == "cuda" else 1
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)
