"""Pre-launch rules of the attention masks (issue 54): model.sliding_window and
model.window_attn_skip_freq, data.document_mask and data.eod_mask_loss, the layouts whose
attention core or stages cannot apply them yet, and model.attention_core. One line naming the key
and the fix, or None.

The layout rule mirrors the cores' own `supports(mask)` (model/attention.py, which config may not
import: torch, and the package order): every core applies every mask a key makes, so context
parallelism is refused for correctness nowhere; tests/unit/config/test_attention_rules.py holds the
two together. Ulysses with a restricting mask is refused for memory alone (ulysses_mask_problem).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from megaframe.config.choices import choice_problem
from megaframe.config.dataset_meta import SidecarError, document_ends_problem
from megaframe.config.schema import TrainConfig


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def window_problem(cfg: TrainConfig) -> Optional[str]:
    """model.sliding_window >= 1; model.window_attn_skip_freq an N >= 1 or a 0/1 list no longer than the layers."""
    m = cfg.model
    window, freq = m.sliding_window, m.window_attn_skip_freq
    if window is not None and (not _is_int(window) or window < 1):
        return (f"model.sliding_window={window} must be a whole number >= 1 (the keys each query sees, itself "
                f"included) or null for full attention")
    if freq is None:
        return None
    if window is None:
        return (f"model.window_attn_skip_freq={freq} says which layers skip model.sliding_window, which is null; "
                f"set model.sliding_window=W or drop the pattern")
    unused = (f"model.window_attn_skip_freq={freq} makes every layer global: model.sliding_window={window} is "
              f"unused and the model trains with full attention; drop the window (model.sliding_window=null) or "
              f"window some layers (e.g. model.window_attn_skip_freq=4, every 4th layer global)")
    if _is_int(freq):
        if freq == 1:
            return unused
        return None if freq >= 1 else (f"model.window_attn_skip_freq={freq} must be >= 1 (every N-th layer global) "
                                       f"or a list of 1 (window) and 0 (global) per layer")
    entries = list(freq) if isinstance(freq, (list, tuple)) else None
    if not entries or any(not _is_int(x) or x not in (0, 1) for x in entries):
        return (f"model.window_attn_skip_freq={freq} must be N >= 1 (every N-th layer global) or a non-empty list "
                f"of 1 (window) and 0 (global), e.g. '[1,1,1,0]'")
    if len(entries) > m.num_layers:
        return (f"model.window_attn_skip_freq lists {len(entries)} layers but model.num_layers={m.num_layers}; give "
                f"at most {m.num_layers} entries (a shorter list repeats over the layers)")
    return None if 1 in entries else unused


def _dataset_prefixes(cfg: TrainConfig) -> list[str]:
    from megaframe.config.blend_spec import parse_blend

    d = cfg.data
    prefixes = [p for p in (d.path, d.valid_path) if p is not None]
    for key, blend in (("data.blend", d.blend), ("data.valid_blend", d.valid_blend)):
        if blend:
            prefixes += parse_blend(list(blend), key)[1]  # check_blend has refused a malformed one
    return prefixes


def documents_problem(cfg: TrainConfig) -> Optional[str]:
    """data.document_mask / data.eod_mask_loss need documents that end in an end-of-document token."""
    d = cfg.data
    keys = [k for k, on in (("data.document_mask", d.document_mask), ("data.eod_mask_loss", d.eod_mask_loss)) if on]
    if not keys:
        return None
    for prefix in _dataset_prefixes(cfg):  # the demo corpus (data.path=null) ends each document with one
        try:
            problem = document_ends_problem(prefix)
        except SidecarError as err:
            return str(err)
        if problem:
            return (f"{keys[0]}=true needs end-of-document tokens, but {problem}; rebuild it with megaframe-preprocess "
                    f"(which appends them) or set {keys[0]}=false")
    return None


def layout_problem(cfg: TrainConfig) -> Optional[str]:
    """The layouts whose attention core cannot apply the masks. Tensor and sequence parallelism can
    (each TP rank holds the whole token ids); so can context parallelism (the ring and Ulysses cores
    take documents and windows, the cp ranks gathering the whole rows' ids) and pipeline stages of
    either engine, over context-parallel shards too (each stage finds the documents in the
    micro-batch's token ids, gathered over cp: docs/attention.md); not Ulysses with a restricting
    mask, for its memory (ulysses_mask_problem)."""
    return ulysses_mask_problem(cfg)


def ulysses_mask_problem(cfg: TrainConfig) -> Optional[str]:
    """parallel.cp_impl=ulysses with a mask that restricts more than causal (documents, or a window
    shorter than the sequence: W >= T is no window). Ulysses applies it as one dense mask over the
    whole sequence, built in every block (parallel/context.py's attention_allowed: an int64 (T, T)
    distance, then a (B, 1, T, T) boolean), which no GPU holds at the recipes' lengths; the ring
    masks bounded score tiles and skips the pieces the mask empties (parallel/ring.py)."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    if p.cp <= 1 or p.cp_impl != "ulysses":
        return None
    windowed = m.sliding_window is not None and m.sliding_window < m.seq_length
    masks = [k for k, on in (("data.document_mask=true", d.document_mask),
                             (f"model.sliding_window={m.sliding_window}", windowed)) if on]
    if not masks:
        return None
    return (f"{masks[0]} with parallel.cp_impl=ulysses and parallel.cp={p.cp}: Ulysses builds the mask dense over the "
            f"whole sequence in every block (8*T^2 bytes, 128 GiB at T=131072); use parallel.cp_impl=ring, whose "
            f"blocks skip what the mask rules out")


ATTENTION_CORES = ("auto", "sdpa", "flex")


def core_problem(cfg: TrainConfig) -> Optional[str]:
    """model.attention_core: one of ATTENTION_CORES; flex (model/attention.py's FlexCore) applies every
    mask the keys make (its supports() takes any Mask) but has no attention dropout and attends on one
    rank's tokens (under context parallelism the ring and Ulysses cores attend)."""
    m, p = cfg.model, cfg.parallel
    if err := choice_problem("model.attention_core", m.attention_core, list(ATTENTION_CORES)):
        return err
    if m.attention_core != "flex":
        return None
    if m.dropout:
        return (f"model.attention_core=flex with model.dropout={m.dropout}: FlexAttention has no attention dropout; "
                f"set model.dropout=0 or model.attention_core=sdpa")
    if p.cp > 1:
        return (f"model.attention_core=flex with parallel.cp={p.cp}: context parallelism attends through "
                f"parallel.cp_impl={p.cp_impl}; set model.attention_core=auto or parallel.cp=1")
    return None


def core_device_problem(cfg: TrainConfig, on_cuda: Callable[[], bool]) -> Optional[str]:
    """model.attention_core=flex where the run trains on the CPU: torch's FlexAttention computes no
    gradients there (it raises in the first backward); on_cuda: asks the launching host's device, only
    for flex (asking imports the engine's accelerator, which a one-process run never imports)."""
    if cfg.model.attention_core == "flex" and not on_cuda():
        return ("model.attention_core=flex on the CPU: torch's FlexAttention has no backward there; "
                "use model.attention_core=auto (sdpa on the CPU) or train on a GPU")
    return None


def check_attention(cfg: TrainConfig) -> Optional[str]:
    """Every rule above but the device's, the first problem or None."""
    return window_problem(cfg) or documents_problem(cfg) or layout_problem(cfg) or core_problem(cfg)
