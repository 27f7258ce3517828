"""torch.optim.Muon on whole matrices, the oracle megaframe's split Muon is checked against."""
from __future__ import annotations

import torch


class TorchMuon:
    """torch.optim.Muon (lr 0.02, weight decay 0.1) over copies of `full`: every tensor a matrix but
    the last, an expert stack (E x rows x cols) that torch steps as E matrices of their own."""

    def __init__(self, full: list[torch.Tensor]):
        self.reference = [torch.nn.Parameter(t.clone()) for t in full[:-1]]
        self.experts = [torch.nn.Parameter(expert.clone()) for expert in full[-1]]
        self.optimizer = torch.optim.Muon([*self.reference, *self.experts], lr=0.02, weight_decay=0.1)

    def step(self, grads: list[torch.Tensor]) -> None:
        """One step on these gradients of `full`."""
        for p, g in zip(self.reference, grads):
            p.grad = g.clone()
        for e, p in enumerate(self.experts):
            p.grad = grads[-1][e].clone()
        self.optimizer.step()

    def tensors(self) -> list[torch.Tensor]:
        """The stepped tensors, shaped as `full` (the experts stacked again)."""
        return [*(p.detach() for p in self.reference), torch.stack([p.detach() for p in self.experts])]
