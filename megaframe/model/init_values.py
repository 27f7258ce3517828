"""A parameter's layout-invariant initial value, drawn in fixed tiles so that a rank draws only its piece.

Every layout must start from one model (parity with one rank depends on it), so a parameter's
initial value is a pure function of (seed, name, full shape). Drawing the whole tensor and slicing
a shard out of it cost every rank its whole pipeline stage: about 59B normal draws per rank for
Qwen3-235B at pp=4 (minutes of one core, at every start and restart, eight ranks a node) and a host
copy of the stage's largest tensor. Here the last two dimensions are cut into tiles of TILE_ROWS x
TILE_COLS (a vector is one row; a stacked expert tensor's leading index is part of the tile's key),
each drawn from its own generator seeded by (seed, name, tile): the value is the same in every
layout, and a piece (a TP or EP shard, then an FSDP box or a ZeRO-3 flat range) costs the tiles it
overlaps. Tiles are short and wide because rows are what gets cut finely: FSDP's Shard(0) and ZeRO-3's
flat ranges split a TP shard's rows over up to hundreds of data-parallel ranks (16 rows of Llama-70B's
q_proj each at tp=8, dp=64), while columns are cut only by a row-parallel layer's tp.

Always float32 on the host, made by a factory zero.Init leaves alone (host_float32): under it
torch.randn, empty, zeros and ones land on the accelerator without device= (a CUDA tensor refuses a
CPU generator) and come back in the run's bf16 or fp16 even with dtype= (DeepSpeed 0.19's
zero_wrapper_for_fp_tensor_constructor), which rounded ZeRO-3's draws before they were scaled, one
ulp off ZeRO-1's in a quarter of the weights. The caller casts and copies the piece over.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

TILE_ROWS, TILE_COLS = 16, 512  # 8K draws: seeding a generator costs about a sixth of drawing a tile


def name_seed(seed: int, key: str) -> int:
    """A stable 63-bit seed per (run seed, key); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def host_float32(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 host tensor, from a factory DeepSpeed's zero.Init does not wrap."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=torch.float32, device="cpu")


def draw_tile(seed: int, name: str, lead: tuple[int, ...], row: int, col: int,
              generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Tile (row, col) of matrix `lead` of parameter `name`: standard normal draws, on the host.
    Always whole, cropped by the caller: an element's value depends on its place and not on the
    tensor's extent, which the vocabulary's padding makes differ between layouts (to a multiple
    of make_vocab_size_divisible_by x tp). generator: one to reseed (making one costs as much as
    a sixth of the tile's draws)."""
    key = f"{name}#{'.'.join(map(str, lead))}#{row}.{col}"
    generator = (generator or torch.Generator()).manual_seed(name_seed(seed, key))
    return host_float32((TILE_ROWS, TILE_COLS)).normal_(generator=generator)  # torch.randn's values


@dataclass(frozen=True)
class InitValue:
    """A box [offset, offset + shape) of one parameter's initial value, drawn only when asked for:
    narrow and basic slicing give smaller boxes (as a tensor's would), tensor() and flat() draw."""

    name: str
    full_shape: tuple[int, ...]
    kind: str  # "zeros", "ones" or "normal"
    std: float
    seed: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, name: str, full_shape: tuple[int, ...], kind: str, std: float, seed: int) -> "InitValue":
        return cls(name, tuple(full_shape), kind, std, seed, (0,) * len(full_shape), tuple(full_shape))

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "InitValue":
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"{self.name}: [{start}, {start + length}) is outside dimension {dim} of {self.shape}")
        offset, shape = list(self.offset), list(self.shape)
        offset[dim] += start
        shape[dim] = length
        return replace(self, offset=tuple(offset), shape=tuple(shape))

    def __getitem__(self, index: tuple[slice, ...]) -> "InitValue":
        """Basic slicing with step 1 (what an FSDP box takes); dimensions not named are whole."""
        box = self
        for dim, part in enumerate(index if isinstance(index, tuple) else (index,)):
            if not isinstance(part, slice) or part.step not in (None, 1):
                raise TypeError(f"an initial value takes slices of step 1, got {part!r}")
            start, stop, _ = part.indices(box.shape[dim])
            box = box.narrow(dim, start, max(stop - start, 0))
        return box

    def tensor(self) -> torch.Tensor:
        """The box's values, float32 on the host."""
        if self.kind == "zeros":
            return host_float32(self.shape).zero_()
        if self.kind == "ones":
            return host_float32(self.shape).fill_(1.0)
        out = host_float32(self.shape)
        if out.numel():
            self._draw_into(out)
        return out.mul_(self.std)

    def flat(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the box flattened in row-major order (a ZeRO-3 partition): the
        whole rows inside are drawn at once, the partial ones at each end row by row (a tile row they
        share with the whole rows is drawn twice: at most two per range)."""
        if self.dim() == 0:
            return self.tensor().flatten()[start:stop]
        return self._flat(0, start, stop)

    def _flat(self, dim: int, start: int, stop: int) -> torch.Tensor:
        # elements [start, stop) of dimensions dim.. flattened; the box is one index wide before dim
        if dim == self.dim() - 1:
            return self.narrow(dim, start, max(stop - start, 0)).tensor().flatten()
        if stop <= start:
            return host_float32((0,))
        inner = math.prod(self.shape[dim + 1:])
        first, last = start // inner, (stop - 1) // inner
        if first == last:
            return self.narrow(dim, first, 1)._flat(dim + 1, start - first * inner, stop - first * inner)
        pieces, tail = [], None
        if start % inner:
            pieces.append(self.narrow(dim, first, 1)._flat(dim + 1, start - first * inner, inner))
            first += 1
        if stop % inner:
            tail = self.narrow(dim, last, 1)._flat(dim + 1, 0, stop - last * inner)
            last -= 1
        if first <= last:
            pieces.append(self.narrow(dim, first, last - first + 1).tensor().flatten())
        if tail is not None:
            pieces.append(tail)
        return torch.cat(pieces)

    def _draw_into(self, out: torch.Tensor) -> None:
        full, offset, shape = self.full_shape, self.offset, self.shape
        if len(full) < 2:  # a vector is one row, a scalar one element
            full, offset, shape = (1, *(full or (1,))), (0, *(offset or (0,))), (1, *(shape or (1,)))
        lead_dims = len(full) - 2
        view = out.reshape(shape)
        (r0, c0), (nr, nc) = offset[lead_dims:], shape[lead_dims:]
        generator = torch.Generator()
        leads = itertools.product(*(range(o, o + n) for o, n in zip(offset[:lead_dims], shape[:lead_dims])))
        for lead in leads:
            target = view[tuple(i - o for i, o in zip(lead, offset))]
            for row in range(r0 // TILE_ROWS, (r0 + nr - 1) // TILE_ROWS + 1):
                for col in range(c0 // TILE_COLS, (c0 + nc - 1) // TILE_COLS + 1):
                    top, left = row * TILE_ROWS, col * TILE_COLS
                    tile = draw_tile(self.seed, self.name, lead, row, col, generator)
                    lo_r, hi_r = max(r0, top), min(r0 + nr, top + TILE_ROWS)
                    lo_c, hi_c = max(c0, left), min(c0 + nc, left + TILE_COLS)
                    box = (slice(lo_r - top, hi_r - top), slice(lo_c - left, hi_c - left))
                    target[lo_r - r0:hi_r - r0, lo_c - c0:hi_c - c0] = tile[box]
