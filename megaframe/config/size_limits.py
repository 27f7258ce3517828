"""Sizes beyond any machine are refused before anything is sized by them.

A typo such as model.num_layers=100000000 or hidden_size=10**12 used to reach rules and plans that
walk the value (a divisor list of hidden_size, a Python object per layer): 3.5 GB and minutes with no
output. The bound is the one the hardware sets: every model dimension, the tokens of a micro-batch
and the batch sizes are GEMM dimensions or element counts that cuBLAS (its m, n, k and leading
dimensions), NCCL (its ranks) and CUDA's kernels take as 32-bit C ints, so nothing above
2**31 - 1 can run on any GPU. (The whole model's parameter count, which needs the tokenizer's
vocabulary, is bounded by the planner: plan/estimate.py MAX_PARAMETERS.)
"""
from __future__ import annotations

from typing import Any, Optional

INT32_MAX = 2**31 - 1
_WHY = "beyond the 32-bit sizes cuBLAS, NCCL and CUDA kernels take (2**31-1)"

# the keys that size the model, a micro-batch or the rank grid
SIZE_KEYS = ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_kv_heads",
             "model.ffn_hidden_size", "model.vocab_size", "model.make_vocab_size_divisible_by",
             "model.seq_length", "model.head_dim", "model.moe.num_experts", "model.moe.top_k",
             "model.moe.ffn_hidden_size", "model.moe.shared_experts", "model.moe.first_dense_layers",
             "model.moe.layer_freq", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.dp",
             "parallel.dp_replicate", "parallel.virtual_stages", "parallel.micro_batch_size",
             "parallel.global_batch_size", "launcher.nodes", "cluster.gpus_per_node")


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def absurd_size_problem(cfg: Any) -> Optional[str]:
    """The first size key above INT32_MAX, or a micro-batch of more tokens, or a world of more
    ranks, in one line naming the key(s); None when every size could run somewhere."""
    for key in SIZE_KEYS:
        value = _get(cfg, key)
        if isinstance(value, int) and value > INT32_MAX:
            return f"{key}={value} is {_WHY}; check the value for a typo"
    p, m = cfg.parallel, cfg.model
    if p.micro_batch_size * m.seq_length > INT32_MAX:  # the rows of every GEMM of a micro-batch
        return (f"parallel.micro_batch_size*model.seq_length={p.micro_batch_size}*{m.seq_length} tokens per "
                f"micro-batch is {_WHY}; lower one of them")
    world = p.tp * p.pp * p.cp * (p.dp or 1)
    if world > INT32_MAX:
        return f"parallel.tp*pp*cp*dp={world} ranks is {_WHY}; check the degrees for a typo"
    nodes, per_node = cfg.launcher.nodes, cfg.cluster.gpus_per_node
    if nodes and per_node and nodes * per_node > INT32_MAX:
        return f"launcher.nodes*cluster.gpus_per_node={nodes}*{per_node} ranks is {_WHY}; check them for a typo"
    return None
