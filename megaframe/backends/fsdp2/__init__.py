"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) as megaframe's second engine: `backend=fsdp2`.

Each transformer block is one FSDP group and the root (embedding, final norm, head) another, sharded
over the data-parallel ranks (dp x cp) built from megaframe's own process groups (experts split over
ep ranks: over their expert-data-parallel ranks, in a group of their own); tensor, context and
expert parallelism stay megaframe's hand-written ones inside each group. The model is built on the
meta device and every rank initialises only its own shard, so no rank ever holds the whole model.
Checkpoints are the layout-free ones DeepSpeed writes too, each rank writing and reading only its
local shard. Nothing here imports DeepSpeed.
"""
