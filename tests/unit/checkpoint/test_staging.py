"""HostStaging: a background save's host copies, in buffers kept from one save to the next."""
from __future__ import annotations

import torch

from megaframe.checkpoint import staging
from megaframe.checkpoint.staging import HostStaging


def shard(scale: float) -> list[torch.Tensor]:
    """Tensors of the dtypes, shapes and sizes a rank's shard holds (a 0-d step count, an empty piece,
    odd byte counts that leave the next piece unaligned unless the stager aligns it)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g) * scale, torch.randn(7, generator=g).to(torch.bfloat16) * scale,
            torch.tensor(3.0 * scale), torch.empty(0, 4), torch.arange(11, dtype=torch.int64) * int(scale),
            torch.randn(2, 3, 4, generator=g).double() * scale, torch.randn(13, 2, generator=g)[::2] * scale]


def test_copies_hold_the_values_at_the_save_and_not_later_changes():
    tensors = shard(1.0)
    snapshot = HostStaging(pin_device_copies=False).start()
    copies = [snapshot.copy(t) for t in tensors]
    snapshot.ready()()
    expected = [t.clone() for t in tensors]
    for t in tensors:
        t.add_(1) if t.dtype != torch.int64 else t.add_(5)  # the step loop goes on
    for copy, want in zip(copies, expected):
        assert copy.dtype == want.dtype and copy.shape == want.shape and copy.device.type == "cpu"
        assert torch.equal(copy, want)


def test_a_second_save_of_the_same_shard_reuses_every_byte_and_allocates_nothing():
    stager = HostStaging(pin_device_copies=False)
    first = stager.start()
    first_copies = [first.copy(t) for t in shard(1.0)]
    slabs, held = [s.data_ptr() for s in stager.host_slabs], stager.nbytes
    second = stager.start()
    second_copies = [second.copy(t) for t in shard(2.0)]
    assert [s.data_ptr() for s in stager.host_slabs] == slabs and stager.nbytes == held == staging.SLAB_BYTES
    assert [c.data_ptr() for c in second_copies] == [c.data_ptr() for c in first_copies]
    # what each save filled, the planner's figure (plan/host.py): the pieces' own bytes, alignment not counted
    assert stager.staged_bytes == (15 * 4 + 7 * 2 + 4 + 0 + 11 * 8 + 24 * 8 + 7 * 2 * 4)
    assert all(torch.equal(c, t) for c, t in zip(second_copies, shard(2.0)))


def test_pieces_do_not_overlap_and_start_on_64_byte_boundaries():
    snapshot = HostStaging(pin_device_copies=False).start()
    copies = [snapshot.copy(t) for t in shard(1.0)]
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies if c.numel())
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_a_piece_larger_than_a_slab_gets_its_own_and_small_ones_fill_slabs_in_order(monkeypatch):
    monkeypatch.setattr(staging, "SLAB_BYTES", 256)
    stager = HostStaging(pin_device_copies=False)
    snapshot = stager.start()
    small, large = torch.ones(24), torch.ones(100)  # 96 and 400 bytes
    copies = [snapshot.copy(small), snapshot.copy(large), snapshot.copy(small), snapshot.copy(small)]
    # small at 0 of slab 1; large does not fit after it (128 + 400 > 256): a slab of its own, 512 bytes (the
    # allocator's next power of two); small again does not fit after large (448 + 96 > 512): a new slab,
    # where the last one follows it (128 + 96 <= 256)
    assert [s.numel() for s in stager.host_slabs] == [256, 512, 256]
    assert all(torch.equal(c, t) for c, t in zip(copies, (small, large, small, small)))
    # the same shard again: the same places, nothing new
    again = stager.start()
    assert [again.copy(t).data_ptr() for t in (small, large, small, small)] == [c.data_ptr() for c in copies]
    assert len(stager.host_slabs) == 3


def test_a_shard_that_grew_takes_new_slabs_and_keeps_the_old():
    stager = HostStaging(pin_device_copies=False)
    stager.start().copy(torch.ones(10))
    first = stager.host_slabs[0].data_ptr()
    snapshot = stager.start()
    big = torch.ones(staging.SLAB_BYTES // 4)  # a whole slab's bytes: no longer fits after the first piece
    copies = [snapshot.copy(torch.ones(10)), snapshot.copy(big)]
    assert stager.host_slabs[0].data_ptr() == first and len(stager.host_slabs) == 2
    assert torch.equal(copies[1], big)
