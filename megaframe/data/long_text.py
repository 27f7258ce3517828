""".txt inputs of any size: each is one document, read and tokenized in pieces.

Tokenizing a whole file at once held its text and the tokenizer's objects for all of it: a Python
list costs 36 bytes a token and a Hugging Face encoding more than 100, so a 1 GB file (enwik9)
needed tens of GB. Here memory holds a piece of text (about 2 x PIECE_CHARS characters); preprocess.py
writes each piece's tokens as they come (cut_text, encode_piece), while encode_text_file returns the
whole file's tokens as int32 (8 to 10 bytes a token at the peak).

A piece ends at a cut where tokenizing the two sides apart gives the tokens the whole text gives:
after a line break between two non-blank characters, else before a space that follows a non-blank
character, and only where the tokenizer agrees on the text around the cut (the tokens of
CHECK_CHARS either side together equal those of each side apart). The tokenizers that split text
into words first (GPT-2's and Llama 3's byte-level BPE, word-level ones, the byte tokenizer) agree
there. Text with neither (a genome, base64) is cut anywhere the tokenizer agrees, the same check.
One that marks the start of every text it is given (sentencepiece's dummy prefix: Llama 2's,
Mistral's) is cut only before a space, which the next piece drops: the tokenizer's mark at that
piece's start stands where the space stood, as in the whole text ("▁word" either way). A tokenizer
that agrees in neither way gets its file whole, as before. A file of one piece is tokenized whole.
"""
from __future__ import annotations

import codecs
import io
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megaframe.data.indexed import DataError
from megaframe.data.tokenizer import Tokenizer

PIECE_CHARS = 1 << 20  # text read and tokenized at a time (a few MB of the tokenizer's objects)
CHECK_CHARS = 2048  # text on each side of a cut that the tokenizer must agree on
_CHECKS_PER_PIECE = 16  # cuts tried (tokenized) per piece before the piece grows by another read
_LOOKS_PER_RULE = 4096  # line breaks or spaces looked at per piece and rule
# between the cuts tried anywhere in text without a line break or space to cut at (a file of one such
# run, 100 MB, was held whole: 1.37 GB); a tokenizer that merges across them agrees on some, a byte
# tokenizer on all
_ANYWHERE_STRIDE = 61


def text_pieces(path: Path, chars: int = PIECE_CHARS) -> Iterator[str]:
    """The text of a UTF-8 file, read `chars` bytes at a time, with Python's universal newlines
    ("\\r\\n" and "\\r" read as "\\n", as Path.read_text reads them). Not UTF-8: DataError naming the
    byte's offset in the file."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes of the file read before this block
    with open(path, "rb") as file:
        while True:
            block = file.read(chars)
            pending = len(decoder.getstate()[0])  # bytes of a character the last block cut in two
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                raise DataError(f"--input {path}: not UTF-8 text (byte {offset - pending + error.start}); "
                                "convert it to UTF-8") from None
            offset += len(block)
            if text:
                yield text
            if not block:
                return


_PROBES = (("one two.\n", "Three four"), ("one two", " three four"))


def cut_rule(tokenizer: Tokenizer) -> Optional[int]:
    """How the tokenizer's text may be cut, on a probe (each cut is checked again on the file's own
    text): 0, at a line break or before a space, the pieces tokenized as they are; 1, before a space
    only, which the next piece drops (the tokenizer marks every text's start); None, not at all."""
    encode = tokenizer.encode
    if all(encode(left + right) == encode(left) + encode(right) for left, right in _PROBES):
        return 0
    left, right = _PROBES[1]
    return 1 if encode(left + right) == encode(left) + encode(right[1:]) else None


def splits_text(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's text can be cut into pieces that tokenize as the whole text (cut_rule)."""
    return cut_rule(tokenizer) is not None


def _agrees(tokenizer: Tokenizer, text: str, cut: int, dropped: int = 0) -> bool:
    left, right = text[cut - CHECK_CHARS:cut], text[cut:cut + CHECK_CHARS]
    return tokenizer.encode(left + right) == tokenizer.encode(left) + tokenizer.encode(right[dropped:])


def _candidates(text: str, low: int, high: int, dropped: int = 0) -> Iterator[int]:
    """Cuts in text[low:high], last first: after a line break between non-blank characters (unless
    the next piece drops a space: `dropped`), then before a space after a non-blank character and
    before a non-blank one."""
    for mark, before, after in (("\n", -2, 0), (" ", -1, 1))[dropped:]:
        end = high
        for _ in range(_LOOKS_PER_RULE):
            found = text.rfind(mark, low, end)
            if found < 0:
                break
            cut = found + 1 if mark == "\n" else found
            if low <= cut and not text[cut + before].isspace() and not text[cut + after].isspace():
                yield cut
            end = found
    if not dropped:  # text without such a cut (DNA, base64, minified JSON): anywhere the tokenizer agrees
        for step in range(_CHECKS_PER_PIECE):
            if (cut := high - step * _ANYWHERE_STRIDE) > low:
                yield cut


def find_cut(tokenizer: Tokenizer, text: str, dropped: int = 0) -> Optional[int]:
    """The last cut of `text` with CHECK_CHARS on each side that the tokenizer agrees on, of the last
    few candidates, the next piece without its first `dropped` characters (cut_rule); None when none is."""
    low, high = CHECK_CHARS, len(text) - CHECK_CHARS
    if high <= low:
        return None
    for checked, cut in enumerate(_candidates(text, low, high, dropped)):
        if checked == _CHECKS_PER_PIECE:
            return None
        if _agrees(tokenizer, text, cut, dropped):
            return cut
    return None


def cut_text(tokenizer: Tokenizer, path: Path, chars: Optional[int] = None) -> Iterator[str]:
    """The file's text in pieces of about 2 x `chars` characters (default PIECE_CHARS), each ending at
    a cut the tokenizer agrees on (find_cut), the space after it dropped for a tokenizer that marks a
    text's start (cut_rule 1); the whole text as one piece when it is that short, or when the
    tokenizer agrees on no cut."""
    chars = chars or PIECE_CHARS
    dropped = cut_rule(tokenizer)
    blocks: list[str] = []  # text read and not yet given out
    held, next_try = 0, 2 * chars  # its characters; how many before a cut is looked for again
    for text in text_pieces(path, chars):
        blocks.append(text)
        held += len(text)
        if dropped is None or held < next_try:
            continue
        rest = "".join(blocks)
        cut = find_cut(tokenizer, rest, dropped)
        if cut is None:  # none the tokenizer agrees on near the end: look again once twice as much is read
            blocks, next_try = [rest], 2 * held
            continue
        yield rest[:cut]
        rest = rest[cut + dropped:]  # the space a tokenizer that marks a text's start puts its mark for
        blocks, held, next_try = [rest], len(rest), 2 * chars
    yield "".join(blocks)


def encode_piece(tokenizer: Tokenizer, text: str, eod_id: Optional[int] = None) -> np.ndarray:
    """One piece's token ids as int32 (eod_id appended unless None): half int64's memory, and every
    vocabulary's ids fit."""
    ids = tokenizer.encode(text)
    if eod_id is not None:
        ids.append(eod_id)
    return np.asarray(ids, dtype=np.int32)


def encode_text_file(tokenizer: Tokenizer, path: Path, eod_id: Optional[int],
                     chars: Optional[int] = None) -> np.ndarray:
    """The token ids of the file's text (eod_id appended unless None), tokenized a piece at a time."""
    parts = [encode_piece(tokenizer, piece) for piece in cut_text(tokenizer, path, chars)]
    if len(parts) == 1 and eod_id is None:
        return parts[0]
    return np.concatenate([*parts, np.asarray([eod_id] if eod_id is not None else [], dtype=np.int32)])
