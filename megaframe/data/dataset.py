"""Layout-invariant sampling: which tokens each global step trains on depends only on (step, batch size, seed).

Document ranges are "document positions": an int d means the start of document d; a fractional
position d + f means f of the way (in tokens, rounded down) through document d. Integer ranges are
the common case; fractions only appear when split_documents must split a single-document dataset.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from megaframe.data.epoch_orders import IN_MEMORY, EpochOrders, build_epoch_permutation, epoch_permutation  # noqa: F401
from megaframe.data.indexed import DataError, IndexedDataset

if TYPE_CHECKING:
    import torch

__all__ = [
    "SampleSet",
    "TokenStream",
    "eval_batches",
    "global_batch_indices",
    "micro_batches",
    "split_documents",
]

DocRange = tuple[float, float]
Batch = tuple["torch.Tensor", "torch.Tensor"]

# Guards ceil() against float noise: 0.07 * 100 is 7.000000000000001, which must count as 7 documents.
_FRACTION_TOLERANCE = 1e-9


def split_documents(num_documents: int, valid_fraction: float) -> tuple[DocRange, DocRange]:
    """(train, valid) document-position ranges: the last ceil(valid_fraction * n) documents are validation.

    With n >= 2 both ranges are whole documents and each side gets at least one. With a single
    document the split falls inside it: train = (0, 1 - valid_fraction), valid = (1 - valid_fraction, 1),
    which TokenStream turns into token ranges. valid_fraction == 0 gives an empty valid range (n, n).
    """
    if num_documents < 1:
        raise DataError(
            f"split_documents: num_documents={num_documents}; the dataset is empty, rebuild it with more text"
        )
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"data.valid_fraction={valid_fraction}: must be in [0, 1)")
    if valid_fraction == 0.0:
        return (0, num_documents), (num_documents, num_documents)
    if num_documents == 1:
        boundary = 1.0 - valid_fraction
        return (0, boundary), (boundary, 1)
    num_valid = math.ceil(valid_fraction * num_documents - _FRACTION_TOLERANCE)
    num_valid = min(max(num_valid, 1), num_documents - 1)
    boundary_doc = num_documents - num_valid
    return (0, boundary_doc), (boundary_doc, num_documents)


def _token_position(dataset: IndexedDataset, doc_position: float) -> int:
    document = math.floor(doc_position)
    if document == len(dataset):
        return dataset.num_tokens
    doc_begin, doc_end = int(dataset.doc_offsets[document]), int(dataset.doc_offsets[document + 1])
    return doc_begin + int((doc_position - document) * (doc_end - doc_begin))


class TokenStream:
    """The contiguous tokens covering document positions [doc_start, doc_end) of a dataset."""

    def __init__(self, dataset: IndexedDataset, doc_start: float, doc_end: float) -> None:
        """Resolve the document-position range to token offsets (a view, nothing is copied)."""
        if not 0 <= doc_start <= doc_end <= len(dataset):
            raise DataError(
                f"data.path={dataset.prefix}: document range [{doc_start}, {doc_end}) is outside "
                f"[0, {len(dataset)}]; take ranges from split_documents(len(dataset), ...)"
            )
        self.dataset = dataset
        self.doc_start = doc_start
        self.doc_end = doc_end
        self.token_start = _token_position(dataset, doc_start)
        self.token_end = _token_position(dataset, doc_end)
        self.tokens: np.ndarray = dataset.tokens[self.token_start : self.token_end]

    def __len__(self) -> int:
        """Number of tokens in the stream."""
        return self.token_end - self.token_start

    def __repr__(self) -> str:
        """Short description with the document and token ranges."""
        return (
            f"TokenStream({self.dataset.prefix}, docs=[{self.doc_start}, {self.doc_end}), "
            f"tokens=[{self.token_start}, {self.token_end}))"
        )


class SampleSet:
    """Non-overlapping training windows over a TokenStream; sample i holds seq_length + 1 tokens."""

    def __init__(self, stream: TokenStream, seq_length: int, orders: EpochOrders = IN_MEMORY) -> None:
        """Cut `stream` into (len(stream) - 1) // seq_length windows; DataError if that is zero.
        orders: where epoch orders come from (default: this process's memory)."""
        self.orders = orders
        if seq_length < 1:
            raise DataError(f"model.seq_length={seq_length}: must be at least 1")
        self.stream = stream
        self.seq_length = seq_length
        # Windows share their boundary token (target of one = input of the next), hence the -1.
        self.num_samples = max((len(stream) - 1) // seq_length, 0)
        if self.num_samples == 0:
            raise DataError(
                f"data.path={stream.dataset.prefix}: only {len(stream)} tokens in documents "
                f"[{stream.doc_start}, {stream.doc_end}), fewer than model.seq_length+1={seq_length + 1}; "
                "use more text or a shorter seq_length"
            )

    def __len__(self) -> int:
        """Number of samples."""
        return self.num_samples

    def samples_before_a_repeat(self) -> int:
        """How many samples an evaluation (ordered()) takes before it repeats one: all of them."""
        return self.num_samples

    def data_changes(self) -> tuple[int, ...]:
        """The steps after which what the training draws from changes: none for one sample set."""
        return ()

    def __getitem__(self, index: int) -> np.ndarray:
        """Tokens [index * seq_length, index * seq_length + seq_length + 1) of the stream."""
        position = int(index)
        if not 0 <= position < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        start = position * self.seq_length
        return self.stream.tokens[start : start + self.seq_length + 1]

    def step_indices(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """Sample indices of global step `step` (global_batch_indices)."""
        return global_batch_indices(step, global_batch_size, self.num_samples, seed, self.orders)

    def ordered(self, positions: np.ndarray) -> np.ndarray:
        """The evaluation set's samples at `positions`: the samples in order."""
        return positions

    def batch(self, indices: Sequence[int] | np.ndarray, positions: Optional[np.ndarray] = None,
              unlearned_after: Optional[int] = None, check: bool = True) -> Batch:
        """(inputs, targets), each an int64 tensor of shape (len(indices), seq_length), targets shifted by
        one; only the tokens at `positions` of each sequence when given (windows_batch). check=False:
        the caller has just called check_files (micro_batches: once for a step's micro-batches)."""
        if check:
            self.check_files()
        return windows_batch([self[index] for index in indices], positions, unlearned_after)

    def check_files(self, indices: Optional[np.ndarray] = None) -> None:
        """DataError when the dataset's files shrank since they were opened (data/mapped.py); `indices`:
        the samples about to be read, all from these files (BlendedSamples.check_files's picks)."""
        self.stream.dataset.check_files()


# torch's cross-entropy ignore_index: a target the loss leaves out
IGNORED_TARGET = -100


def windows_batch(windows: Sequence[np.ndarray], positions: Optional[np.ndarray] = None,
                  unlearned_after: Optional[int] = None) -> Batch:
    """(inputs, targets) of sample windows of seq_length + 1 tokens: int64 tensors of shape
    (len(windows), seq_length), the targets shifted by one. `positions`: only the tokens at these
    places of each sequence (a context-parallel rank's zig-zag shard), cut before any tensor is made.
    `unlearned_after` (data.eod_mask_loss: the end-of-document id): where the input is that token, the
    target (the next document's first token, which nothing before it predicts) is IGNORED_TARGET, as
    Megatron's --eod-mask-loss zeroes the loss mask where the input is EOD; the model still learns to
    end a document. Done here, once per batch on the host, so every engine, pipeline stage and
    context-parallel shard gets the targets it counts."""
    # Imported lazily so tools that only build datasets do not pay for importing torch.
    import torch

    tokens = np.stack(windows).astype(np.int64)
    if positions is None:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs, targets = tokens[:, positions], tokens[:, positions + 1]
    if unlearned_after is not None:
        targets = np.where(inputs == unlearned_after, IGNORED_TARGET, targets)
    return torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(np.ascontiguousarray(targets))


def global_batch_indices(step: int, global_batch_size: int, num_samples: int, seed: int,
                         orders: EpochOrders = IN_MEMORY) -> np.ndarray:
    """Sample indices of global step `step`: positions [step*G, (step+1)*G) of an endless chain of seeded epochs.

    Epoch e is np.random.default_rng([seed, e]).permutation(num_samples). The result depends only
    on the arguments (not on data-parallel size, micro-batch size or earlier calls), and only the
    epochs this step touches are generated. orders: where they come from (default: this process's
    memory).
    """
    if step < 0:
        raise DataError(f"step={step}: must be non-negative")
    if global_batch_size < 1:
        raise DataError(f"train.global_batch_size={global_batch_size}: must be at least 1")
    if num_samples < 1:
        raise DataError(f"num_samples={num_samples}: the training set is empty; use more text or a shorter seq_length")
    if seed < 0:
        raise DataError(f"seed={seed}: must be non-negative (numpy SeedSequence requirement)")
    indices = np.empty(global_batch_size, dtype=np.int64)
    position = step * global_batch_size
    filled = 0
    while filled < global_batch_size:
        epoch, offset = divmod(position, num_samples)
        take = min(num_samples - offset, global_batch_size - filled)
        indices[filled : filled + take] = orders(seed, epoch, num_samples)[offset : offset + take]
        orders.reached(seed, epoch, num_samples, 0, offset + take)  # shared orders build the next ahead
        filled += take
        position += take
    return indices


def _check_rank(dp_rank: int, dp: int) -> None:
    if dp < 1 or not 0 <= dp_rank < dp:
        raise DataError(f"dp_rank={dp_rank}, dp={dp}: need dp >= 1 and 0 <= dp_rank < dp")


def micro_batches(
    samples: SampleSet,
    step: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp: int,
    seed: int,
    positions: Optional[np.ndarray] = None,
    unlearned_after: Optional[int] = None,
) -> list[Batch]:
    """This rank's micro-batches for global step `step`: its contiguous 1/dp slice of the step, in
    order; of each sequence only the tokens at `positions` when given (context parallelism);
    unlearned_after: windows_batch's."""
    _check_rank(dp_rank, dp)
    if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp) != 0:
        raise DataError(
            f"train.global_batch_size={global_batch_size}: must be divisible by "
            f"micro_batch_size*dp={micro_batch_size}*{dp}; adjust the batch sizes"
        )
    step_indices = samples.step_indices(step, global_batch_size, seed)
    per_rank = global_batch_size // dp
    rank_indices = step_indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    # the files' sizes once for the step's micro-batches, read back to back: an fstat per file and
    # micro-batch was 128 a rank and step at a global batch of 1536 over dp=24 (on Lustre a size may
    # cost a round trip to the storage servers)
    samples.check_files(rank_indices)
    return [
        samples.batch(rank_indices[start : start + micro_batch_size], positions, unlearned_after, check=False)
        for start in range(0, per_rank, micro_batch_size)
    ]


def eval_wrap_problem(eval_steps: int, global_batch_size: int, valid_samples: int) -> Optional[str]:
    """An evaluation of eval_steps global batches larger than the validation set wraps around it
    (eval_batches) and counts its first samples twice: what to say, and the fix, or None."""
    evaluated = eval_steps * global_batch_size
    if evaluated <= valid_samples:
        return None
    fix = (f"set train.eval_steps<={valid_samples // global_batch_size}" if valid_samples >= global_batch_size
           else "hold out more text for validation (data.valid_fraction)")
    return (f"train.eval_steps={eval_steps} evaluates {eval_steps} x {global_batch_size} = {evaluated} samples but the "
            f"validation set holds {valid_samples}: evaluation wraps and counts {evaluated - valid_samples} of them "
            f"twice; {fix}")


def eval_batches(samples: SampleSet, num_batches: int, batch_size: int, dp_rank: int, dp: int,
                 positions: Optional[np.ndarray] = None, unlearned_after: Optional[int] = None) -> list[Batch]:
    """This rank's evaluation micro-batches: global eval batch b is samples [b*B*dp, (b+1)*B*dp) (wrapping).

    `batch_size` is per rank, so the evaluated set is the first num_batches * batch_size * dp
    samples; ranks take contiguous slices of each global eval batch, so concatenating the ranks'
    batches gives the same tokens as dp=1 with batch_size * dp.
    """
    _check_rank(dp_rank, dp)
    if num_batches < 0 or batch_size < 1:
        raise DataError(
            f"eval num_batches={num_batches}, batch_size={batch_size}: need num_batches >= 0 and batch_size >= 1"
        )
    batches = []
    samples.check_files()  # once for the batches, read back to back (micro_batches); every source of a blend
    for batch_number in range(num_batches):
        rank_start = (batch_number * dp + dp_rank) * batch_size
        sample_positions = np.arange(rank_start, rank_start + batch_size, dtype=np.int64) % len(samples)
        batches.append(samples.batch(samples.ordered(sample_positions), positions, unlearned_after, check=False))
    return batches
