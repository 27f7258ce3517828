"""Typed configuration: one dataclass per Hydra config group, composed into TrainConfig.

Hydra merges YAML into these dataclasses, so unknown keys and wrong types fail at compose time;
library code only ever sees these objects (via OmegaConf.to_object), never a DictConfig.
Cross-field rules live in validate.py.
"""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional


def _user_name() -> str:
    """This user's login name (the uid where a container has no passwd entry or USER for it)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@dataclass
class MoEConfig:
    """Mixture-of-Experts MLPs (model.moe); num_experts=0 keeps every block dense."""

    num_experts: int = 0  # routed experts per MoE block (0 = a dense model)
    top_k: int = 2  # experts each token is sent to
    ffn_hidden_size: Optional[int] = None  # one expert's MLP width; None = model.ffn_hidden_size
    layer_freq: int = 1  # every layer_freq-th block (after the first dense ones) is MoE
    first_dense_layers: int = 0  # the first blocks stay dense (DeepSeek keeps 1-3)
    shared_experts: int = 0  # experts every token goes through (one MLP shared_experts times as wide)
    capacity_factor: Optional[float] = None  # None = dropless; else each expert takes at most this x its even share
    aux_loss_coeff: float = 0.01  # load-balancing loss (Switch / GShard): coeff * E * sum_i f_i * P_i
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE): coeff * mean(logsumexp(logits)^2)
    router_score: str = "softmax"  # softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k chosen scores to sum to 1 (Mixtral, Qwen3 do)
    bias_update_rate: float = 0.0  # aux-loss-free balancing (DeepSeek-V3): per-step expert-bias step; 0 = off


@dataclass
class ModelConfig:
    """Shape and flavour of the GPT (Megatron key names)."""

    arch: str = "gpt2"  # gpt2 | llama: only a label; the fields below decide the blocks
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: Optional[int] = None  # None = num_attention_heads (no grouped-query attention)
    ffn_hidden_size: Optional[int] = None  # None = 4h (gelu) or 8h/3 rounded up to 64 (swiglu)
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary
    # rows of the embedding and head are padded to a multiple of this x tp; null: 128 on a GPU (tensor-core
    # tiles, Megatron's default), 1 on a CPU, where padding only adds work (a 257-byte vocabulary to 384 rows
    # made the head 1.5x wider); checkpoints hold the unpadded rows, so a change of padding resumes
    make_vocab_size_divisible_by: Optional[int] = None
    seq_length: int = 128
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    # gelu: tanh-approximated (GPT-2's gelu_new) | gelu_exact: erf (nanoGPT, Megatron's default) | swiglu
    activation: str = "gelu"
    position_embedding: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = True  # biases in linear layers and LayerNorm (GPT-2 yes, Llama no)
    dropout: float = 0.0
    init_std: float = 0.02
    head_dim: Optional[int] = None  # None = hidden_size / num_attention_heads (Qwen3 sets 128)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3, OLMoE)
    # sliding-window attention (Mistral): a query sees the last W tokens, itself included; null = full
    sliding_window: Optional[int] = None
    # which layers skip the window (Megatron's key): N = every N-th layer global; a list of 1 (window)
    # and 0 (global), repeated over the layers (Gemma 3: [1,1,1,1,1,0]); null = every layer windowed
    window_attn_skip_freq: Optional[Any] = None
    # auto | sdpa | flex (docs/attention.md): flex = FlexAttention's block masks, which skip the tiles a
    # document or window mask leaves empty; auto = flex on CUDA without attention dropout, else sdpa
    attention_core: str = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig:
    """Parallel layout and batch sizes."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (zig-zag chunks)
    cp_impl: str = "ring"  # ring (K/V blocks passed around the cp ranks) | ulysses (all-to-all over heads)
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp x cp ranks
    dp: Optional[int] = None  # None = world_size / (tp * cp * pp)
    dp_replicate: int = 1  # HSDP (backend=fsdp2): the dp x cp ranks as this many replicas of a shard group
    micro_batch_size: int = 4
    global_batch_size: int = 16
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    pipeline_partition: str = "uniform"  # uniform | parameters
    # backend=fsdp2's schedules (torch.distributed.pipelining): 1f1b | gpipe | interleaved_1f1b |
    # zero_bubble | zbv | dualpipev; DeepSpeed's pipeline engine runs 1f1b only
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b, zero_bubble); zbv/dualpipev: 2
    auto: bool = False  # parallel=auto: the planner picks tp/pp/dp, ZeRO, offload and recompute before launch


@dataclass
class ZeroConfig:
    """ZeRO stage and the DeepSpeed knobs users tune."""

    # None (zero=engine_default): the engine's own default, set by TrainConfig (ENGINE_ZERO_STAGE)
    stage: Optional[int] = None
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000


@dataclass
class OffloadConfig:
    """ZeRO-Offload (cpu) and ZeRO-Infinity (nvme) targets."""

    optimizer: str = "none"  # none | cpu | nvme (nvme needs ZeRO-3)
    param: str = "none"  # none | cpu | nvme (needs ZeRO-3)
    nvme_path: Optional[str] = None  # swap files go to NVME_PATH/megaframe-swap/HOST-PID, removed at exit
    # page-locked host buffers: copies to and from a GPU run asynchronously, overlapping compute (torch's
    # FSDP2 default). null: pinned on a GPU, never on the CPU (a CPU build has no pinned allocator)
    pin_memory: Optional[bool] = None
    optimizer_buffer_count: int = 4  # nvme: optimizer-state swap buffers
    param_buffer_count: int = 5  # nvme: parameter swap buffers ...
    param_buffer_size: int = 100_000_000  # ... of this many elements each; >= the largest parameter
    param_max_in_cpu: int = 1_000_000_000  # nvme: parameter elements also kept in CPU memory
    # DeepSpeed's async-IO engine for nvme (its "aio" section)
    aio_block_size: int = 1_048_576
    aio_queue_depth: int = 8
    aio_intra_op_parallelism: int = 1  # I/O threads per rank
    aio_single_submit: bool = False
    aio_overlap_events: bool = True


@dataclass
class Fp8Config:
    """fp8 matmuls (precision=fp8; torchao: pip install 'megaframe[fp8]'), parallel/fp8/."""

    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp | mxfp8
    bf16_layers: int = 0  # the first and the last this many blocks stay in bf16
    head: bool = False  # the LM head in fp8 too (bf16 unless asked)
    emulate: str = "auto"  # auto (emulated on the CPU, fp8 kernels on a GPU) | true | false


@dataclass
class PrecisionConfig:
    """Training dtype; fp16 settings apply only to dtype=fp16."""

    dtype: str = "fp32"  # fp32 | bf16 | fp16
    # fp32 matmuls on TF32 tensor cores (Ampere and later; 10-bit mantissa inputs, fp32 sums): 7.4x
    # the fp32 peak on an H100. False leaves torch's setting alone (off by default: exact fp32)
    tf32: bool = False
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    fp8: Fp8Config = field(default_factory=Fp8Config)


@dataclass
class MuonConfig:
    """optim=muon (megaframe/optim/muon.py): torch.optim.Muon's keys for the hidden matrices; the
    embeddings, LM head, router, norms and biases step by AdamW (optim.betas, optim.eps, adamw_*)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    eps: float = 1e-7  # floor of the norm the update is divided by before Newton-Schulz
    # lr scale by a matrix's (rows, cols): spectral sqrt(max(1, rows/cols)) (torch's "original"),
    # match_rms_adamw 0.2*sqrt(max(rows, cols)) (Moonlight/MuonClip: AdamW's lr and decay carry over)
    adjust_lr: str = "spectral"
    adamw_lr: Optional[float] = None  # the AdamW part's peak lr (the schedule scales it alike); null = optim.lr
    adamw_weight_decay: Optional[float] = None  # null = optim.weight_decay
    # the most elements of whole matrices one rank assembles per exchange where matrices are split over
    # ranks (optim/owners.py, sharded.py): each rank's exchange buffers then hold at most about 8 bytes x
    # max(this, the largest matrix) at once; 0: all of a group's matrices in one exchange (most memory)
    exchange_bucket_size: int = 1_000_000_000


@dataclass
class OptimConfig:
    """The optimizer (optim.name) and the learning-rate schedule (linear warmup from 0, then decay
    to min_lr). lr and weight_decay are AdamW's, or under optim=muon Muon's (optim.muon.adamw_*)."""

    name: str = "adamw"  # adamw | muon (conf/optim/*.yaml)
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    lr_decay: str = "cosine"  # cosine | linear | constant
    grad_clip: float = 1.0  # 0 disables clipping
    muon: MuonConfig = field(default_factory=MuonConfig)  # read only under optim.name=muon


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: Optional[str] = None  # prefix of a .bin/.idx pair; None = the built-in demo corpus
    # prefix of a validation dataset (nanoGPT's val.bin); then data.path trains whole, nothing held out
    valid_path: Optional[str] = None
    # weights and prefixes in Megatron's order, [w1, prefix1, w2, prefix2, ...]; replaces data.path
    blend: Optional[List[Any]] = None
    # [[step, [w1, w2, ...]], ...]: data.blend's sources with other weights from that step on
    blend_schedule: Optional[List[Any]] = None
    # validation sources, as data.blend; then data.blend's sources train whole (no held-out part)
    valid_blend: Optional[List[Any]] = None
    tokenizer: str = "byte"  # byte | a local Hugging Face tokenizer directory
    valid_fraction: float = 0.05
    cache_dir: Optional[str] = None  # None = $XDG_CACHE_HOME/megaframe or ~/.cache/megaframe
    # attention stops at each end-of-document token of a packed sample and positions restart
    # (Megatron's reset_attention_mask + reset_position_ids); the dataset's eod_id marks the ends
    document_mask: bool = False
    eod_mask_loss: bool = False  # leave the target after each end-of-document token out; loss per target


@dataclass
class SpikeConfig:
    """Loss-spike guard (train.spike): a step whose loss stands out from the recent applied steps."""

    action: str = "skip"  # skip (no update, like a non-finite step) | stop | warn | off
    window: int = 50  # applied steps the baseline is computed over; the guard arms once it is full
    metric: str = "zscore"  # zscore: (loss - mean) / std of the window | ratio: loss / mean of the window
    threshold: float = 6.0  # a step whose metric exceeds this is a spike


@dataclass
class LoopConfig:
    """The training loop: length, cadence of logs/evals/checkpoints, resumption."""

    max_steps: int = 300
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50  # 0 disables periodic eval
    eval_steps: int = 4
    save_interval: int = 100  # 0 = save only at the end
    resume: str = "auto"  # auto | none | a checkpoint directory | latest-run (megaframe-train: resume_hint.py)
    exit_at_step: Optional[int] = None  # stop early (saving a checkpoint) without changing the schedule
    keep_checkpoints: int = 0  # keep the newest K checkpoints (0 = keep all)
    universal_checkpoint: bool = True  # write layout-free safetensors (resume into any tp/pp/dp/ZeRO)
    native_checkpoint: bool = False  # also write DeepSpeed's own files (always when there is no layout-free copy)
    # resume from DeepSpeed's own files, which load by unpickling: code a crafted file holds would run
    trust_pickled_checkpoint: bool = False
    # SIGINT/SIGTERM/SIGHUP/SIGUSR1 (Ctrl-C, SLURM preemption, --signal=USR1@90): every rank stops at the
    # same step boundary and, when this is on, saves there before exiting 128 + the signal's number
    # (130/143/129/138; training/stop_signal.py)
    save_on_signal: bool = True
    # a resume whose parallel.global_batch_size differs from the checkpoint's: `refuse`, or
    # `move_position` (the data position becomes step x the new global batch size, as every step's
    # samples are a function of (seed, step, global batch): samples in between are skipped when it
    # grew, seen twice when it shrank)
    on_batch_size_change: str = "refuse"
    # a resume that changes the data order (model.seq_length, train.seed, data.blend's sources or
    # weights, data.path's samples) is refused; true accepts it and says in one line what changes
    resume_accept_data_change: bool = False
    # a resume with another tokenizer than the checkpoint records (its vocabulary files' hash or its
    # ids) is refused; true accepts it with one warning line (the same tokenizer saved otherwise)
    resume_accept_tokenizer_change: bool = False
    # a resume under another optim.name than the checkpoint's is refused; true starts the new
    # optimizer's state fresh from the checkpoint's weights, with one warning line
    resume_accept_optimizer_change: bool = False
    async_save: bool = False  # write checkpoints on a background thread while training goes on (rank 0)
    # the fast tier (checkpoint/fast_tier.py): every this many steps each rank keeps its part of a
    # checkpoint in node-local memory and a buddy rank's copy on the next node; an attempt restores
    # from them when they are newer than the shared checkpoint (0: off)
    fast_save_interval: int = 0
    # node-local; a directory per run under it. One folder per user by default: the tier refuses a folder
    # another user owns (they could swap a run's parts), so a shared default failed every second user
    fast_save_dir: str = field(default_factory=lambda: f"/dev/shm/megaframe-{_user_name()}")
    compile: bool = False  # torch.compile each transformer block (inductor); the first step pays the compile
    # blocks: each block, and the final norm, head and loss, as graphs that every block shares (compile
    # time flat in depth; any layout) | model: the whole forward as one graph, which fuses across blocks
    # and pays fewer graph calls per micro-batch (small, launch-bound models), where one process runs the
    # whole forward without collectives: tp = cp = pp = ep = 1, dense, DeepSpeed ZeRO <= 2
    compile_scope: str = "blocks"
    max_consecutive_skips: int = 5  # this many skipped steps in a row (non-finite or spike) stop the run (exit 3)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    collective_timeout_s: float = 1800.0  # a rank that does not reach a collective within this ends the job (exit 7)
    # at start-up, how long each rank waits for all ranks to join the process group (one "waiting for N of
    # M ranks" line meanwhile) before it ends with exit 7 (parallel/rendezvous.py)
    join_timeout_s: float = 600.0


@dataclass
class WandbConfig:
    """Weights & Biases run settings."""

    # offline | online | disabled; null: WANDB_MODE from the environment as W&B reads it (dryrun is
    # offline, run and shared online), else offline (tracking/wandb_run.py wandb_mode)
    mode: Optional[str] = None
    project: str = "megaframe"
    name: Optional[str] = None
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class LoggingConfig:
    """Where metrics go."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    # null: a tqdm bar when rank 0's stderr is a terminal, plain "step N: ..." lines otherwise (a log
    # file gets no carriage-return redraws); true or false forces the choice
    progress_bar: Optional[bool] = None


@dataclass
class ClusterConfig:
    """The machines the job runs on: what one node and one device of them hold and do. The planner
    (megaframe-plan, parallel=auto, the pre-launch check) plans for them, launcher=slurm and elastic
    jobs start cluster.gpus_per_node ranks a node, MFU divides by peak_tflops. How many nodes the
    job takes is launcher.nodes."""

    name: str = "local"
    gpus_per_node: Optional[int] = None  # None (local) = the ranks launched on this host
    memory_gb: Optional[float] = None  # per device, GiB; None (local) = this host's GPU, else its RAM / ranks
    # the GPU model (H100, H100 PCIe, H200, B200, A100): MFU and the planner's step time divide by its dense
    # peak in the run's matmul precision (bf16 989 on an H100, fp32 66.9: tracking/flops.py)
    gpu: Optional[str] = None
    # dense peak per device, used as given in every precision (replaces gpu's); None = gpu's, else
    # a run looks its own GPU up (none on a CPU), and a local plan this host's
    peak_tflops: Optional[float] = None
    intra_node_gbps: float = 10.0  # GB/s per device and direction inside a node (NVLink)
    inter_node_gbps: float = 10.0  # GB/s per device and direction between nodes (InfiniBand)
    host_gbps: float = 10.0  # GB/s device <-> host memory per device (PCIe), for offload
    reserved_gb: float = 0.5  # per device, outside the model's plan: runtime context, comm buffers, allocator slack
    # per node, GiB: the RAM the planner checks offloaded states and checkpoint copies against
    # (plan/host.py); None = this host's RAM on cluster=local, unchecked on a named cluster
    host_memory_gb: Optional[float] = None


@dataclass
class PlanConfig:
    """Assumptions of the memory/time planner (megaframe/plan)."""

    mfu: float = 0.4  # model FLOPs utilisation assumed for step-time estimates
    check: bool = True  # megaframe-train refuses, before launch, a layout the planner says does not fit
    json: bool = False  # megaframe-plan prints JSON instead of the table (same as --json)
    # parallel=auto: the engines it may choose between, e.g. plan.engines=[deepspeed,fsdp2] (empty:
    # backend.name's layouts only)
    engines: list[str] = field(default_factory=list)


@dataclass
class LauncherConfig:
    """How the ranks start (the `launcher` group); `parallel` still says how many."""

    name: str = "local"  # local: this host (or under any torchrun) | slurm: an sbatch job of srun tasks | ray: Ray Train
    # the job's nodes, of cluster.gpus_per_node ranks each (slurm; elastic: the most; megaframe-plan:
    # the world is nodes * cluster.gpus_per_node); None = as many as the layout needs
    nodes: Optional[int] = None
    cpus_per_task: Optional[int] = None  # slurm: --cpus-per-task (None: SLURM's default)
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None  # slurm: --time, e.g. 24:00:00
    job_name: str = "megaframe"
    sbatch_extra: List[str] = field(default_factory=list)  # more #SBATCH lines, e.g. ["--qos=high"]
    dry_run: bool = False  # write and print the sbatch script, do not submit it
    ray_address: Optional[str] = None  # ray: a running cluster (ray://HOST:10001 or auto); None = start a local one
    cpus_per_worker: float = 1.0  # ray: CPUs each rank's worker reserves
    gpus_per_worker: float = 0.0  # ray: GPUs each rank's worker reserves (1 on a GPU cluster)
    max_failures: int = 0  # ray: FailureConfig: restarts of the worker group; each resumes from the last checkpoint
    connect_timeout_s: float = 120.0  # ray: how long joining the cluster may take before the job gives up (exit 2)
    # elastic (launch/elastic.py): set, the job goes on at any node count from min_nodes to
    # launcher.nodes, losing and regaining nodes (torchrun --nnodes=MIN:MAX; Ray: min to max workers)
    min_nodes: Optional[int] = None
    max_restarts: int = 3  # elastic torchrun: failures a node's agent restarts after (node joins and losses are free)
    rdzv_endpoint: Optional[str] = None  # elastic torchrun: HOST[:PORT] of the c10d rendezvous (None: this host / the job's first node)
    # elastic torchrun, the waits of a rendezvous round (torchrun's own defaults): once launcher.min_nodes
    # have joined, how long it waits for more before starting with those present (its last_call_timeout)
    rdzv_last_call_s: int = 30
    # how often each node's agent tells the rendezvous it is alive; a node silent for 3 of these is
    # dropped, and the survivors' next round starts only then (its keep_alive_interval)
    rdzv_keep_alive_s: int = 5
    resize_interval_s: float = 60.0  # elastic ray: how often a healthy worker group looks for room to grow


@dataclass
class BackendConfig:
    """The engine that shards and steps the model (the `backend` group; backends/registry.py)."""

    name: str = "deepspeed"
    # deepspeed, one process, ZeRO-0, fp32, no offload: step with plain torch instead of importing
    # DeepSpeed's engine, which adds nothing there (the same bits, ~0.5 s sooner; backends/plain/)
    plain_one_process: bool = True


@dataclass
class TrainConfig:
    """The whole run: what every entry point receives after composition."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self) -> None:
        """An unset ZeRO stage becomes the engine's default, so every reader sees an int."""
        if self.zero.stage is None:
            self.zero.stage = ENGINE_ZERO_STAGE.get(self.backend.name, 0)


# The ZeRO stage an engine runs when the command names none: DeepSpeed's own default (0), and full
# sharding under FSDP2, as torchtitan's fully_shard does (its rules refuse stages 0 and 1). Chosen
# here, not in YAML: a config group's default cannot depend on another group's choice there.
ENGINE_ZERO_STAGE = {"deepspeed": 0, "fsdp2": 3}
