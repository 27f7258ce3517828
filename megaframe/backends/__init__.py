"""Training engines behind one interface: the trainer's loop, evaluation, logging and checkpoint
policy talk to a Backend and never to the engine library itself.

DeepSpeed (backends/deepspeed/) is the one engine today and the only code that imports it; the rest
of megaframe reaches it through backends/registry.py, the only importer of an engine's folder. A
second engine (FSDP2, say) is a sibling folder that implements the same Protocol and a plug.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:  # the planner reaches engines' facts through this package without importing torch
    import torch

    from megaframe.checkpoint.staging import HostStaging

Batch = tuple["torch.Tensor", "torch.Tensor"]  # (inputs, targets), each (micro_batch, seq)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as every rank sees it."""

    loss: float  # the global batch's mean loss
    applied: bool  # False: skipped on every rank (non-finite gradients, or skip_if said so)


class Backend(Protocol):
    """What the trainer needs from an engine, for one rank of one run."""

    module: torch.nn.Module  # this rank's model (a pipeline stage when pipelined)
    device: torch.device  # this rank's accelerator: where the step loop's tensors live
    num_parameters: int  # the whole model's, TP shards at full size, pipeline stages summed
    compiled_blocks: int  # blocks compiled by train.compile (0 when off)
    writes_layout_free: bool  # whether save_full_state can hold this run's state (else native files only)

    def train_step(self, batches: list[Batch], skip_if: Optional[Callable[[float], bool]] = None) -> StepResult:
        """One optimizer step over this rank's micro-batches. Non-finite gradients skip the update on
        every rank. skip_if, when given, is asked with the global mean loss before the update (on
        the ranks that hold the loss) and skips it when it answers True."""

    def eval_step(self, batches: list[Batch]) -> float:
        """Mean loss over this rank's micro-batches, averaged over the data-parallel replicas."""

    def grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping)."""

    def lr(self) -> float:
        """The learning rate the next step uses."""

    def precision_state(self) -> dict[str, Any]:
        """fp16 only: the current loss scale and the steps skipped on overflow."""

    def router_metrics(self) -> dict[str, float]:
        """Mixture-of-Experts router metrics since the last call ({} for a dense model); a collective."""

    def held_model_states(self) -> dict[str, int]:
        """Bytes of weights, gradients, optimizer states, buckets and other this rank holds."""

    def hook_forward(self, hook: Callable[..., Any]) -> torch.utils.hooks.RemovableHandle:
        """Register hook(module, inputs, output) on this rank's model (a forward hook): the tests'
        fault injection (training/faults.py) reaches the model through it, never through .module."""

    def state_parts(self) -> dict[str, Any]:
        """The engine's run state beyond weights and optimizer, as checkpoint parts by name
        (checkpoint/parts.py): MoE router biases, this rank's TP dropout stream."""

    def layout_record(self) -> dict[str, Any]:
        """The layout native checkpoints are bound to (they load only into the same one)."""

    def save_native(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        """The engine's own checkpoint files for this rank under directory/tag."""

    def load_native(self, directory: Path, tag: str) -> dict[str, Any]:
        """Load the engine's own files written by save_native; return the client state."""

    def has_native(self, path: Path) -> bool:
        """Whether a checkpoint directory holds the engine's own files."""

    def save_full_state(self, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
                        staging: Optional[HostStaging] = None) -> Optional[Callable[[], None]]:
        """This rank's shard of the layout-free checkpoint (every rank; no collectives): returns its
        record (checkpoint/sharded.py). staging (a background save): copy the shard into its host
        buffers now and return the function that writes it and returns the record."""

    def load_full_state(self, directory: Path) -> dict[str, Any]:
        """Load a layout-free checkpoint in this layout; return its state.json."""

    def versions(self) -> dict[str, str]:
        """Version strings of the engine library, for run metadata."""

    def close(self) -> None:
        """Release what the engine holds outside memory (swap files)."""

