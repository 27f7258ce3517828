"""The tokenizer side of `megaframe-convert`: which tokenizer a checkpoint's weights were trained
with, shipped with the Hugging Face export so that `AutoTokenizer` and `pipeline("text-generation")`
work on it, and the generation settings that go with it.

- A `byte` run gets a byte-level tokenizer built with `tokenizers` (what transformers itself uses):
  ids 0..255 are the UTF-8 bytes, 256 is end-of-document, exactly megaframe's ByteTokenizer.
- An HF-tokenizer run gets the files of its tokenizer, copied only from a directory whose files
  hash to the checkpoint's record (checkpoint/tokenizer_record.py): the checkpoint's own copy, the
  run's data.tokenizer, or --tokenizer. Anything else is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from megaframe.checkpoint import tokenizer_record as records
from megaframe.common import json_text
from megaframe.common.tokenizer_files import files_hash, has_tokenizer
from megaframe.convert.hf import ConvertError

EOD_TOKEN = "<|endoftext|>"  # GPT-2's spelling; the ids, not the spelling, are megaframe's


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of `tokenizers`' ByteLevel steps."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(directory: Path, context: int) -> None:
    """An HF tokenizer with megaframe's byte ids into `directory`: a BPE without merges over the 256
    byte characters (each byte its own token, id = byte value), end-of-document 256 as eos and bos.
    split_special_tokens: text that spells the eos token is still encoded as its bytes, as ours does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens([EOD_TOKEN])  # id 256: the next free id
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()  # invalid UTF-8 decodes to U+FFFD, as ByteTokenizer.decode does
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
              "pad_token": EOD_TOKEN, "clean_up_tokenization_spaces": False, "split_special_tokens": True,
              "model_max_length": context}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def checkpoint_record(ckpt: Path, state: dict) -> Optional[dict]:
    """The checkpoint's tokenizer record, or one inferred from the data.tokenizer string that
    checkpoints written before records carried (no hash: nothing to verify against); None when
    the checkpoint names no tokenizer at all."""
    record = state.get(records.RECORD_KEY)
    if record is not None:
        if not records.is_record(record):
            raise ConvertError(f"{ckpt}/state.json: '{records.RECORD_KEY}' is not a tokenizer record (the file was "
                               f"edited); restore the checkpoint from a copy")
        return record
    spec = state.get("tokenizer")
    if not isinstance(spec, str) or not spec:
        return None
    return records.byte_record() if spec == "byte" else {"kind": "hf", "name": spec, "sha256": None}


def tokenizer_source(ckpt: Path, state: dict, override: Union[str, Path, None],
                     run_dir: Optional[Path] = None, flag: str = "--tokenizer ") -> tuple[Optional[dict],
                                                                                        Union[str, Path, None], str]:
    """(the checkpoint's record, the tokenizer to use, a note) for megaframe-sample and to-hf alike:
    "byte", a directory whose files hash to the record (--tokenizer, the checkpoint's tokenizer/
    copy, the run's recorded directory: a relative one read from where the run trained, `run_dir`'s
    .hydra record), or None when the checkpoint names none and no --tokenizer is given. A source
    that is not the one the weights were trained with is refused in one line (ConvertError). `flag`:
    how the hint names the setting that gives a directory (megaframe-eval's is data.tokenizer=)."""
    if override is not None and not str(override).strip():
        raise ConvertError("--tokenizer is empty (an unset shell variable?); give byte or a tokenizer directory, or "
                           "leave it out to use the checkpoint's own")
    if override is not None and str(override) != "byte" and not Path(override).is_dir():
        raise ConvertError(f"--tokenizer={override}: not 'byte' and not a local directory; use byte or the directory "
                           f"of a Hugging Face tokenizer (saved with save_pretrained())")
    record = checkpoint_record(ckpt, state)
    wants_byte = override is not None and str(override) == "byte"
    if record is None:  # nothing to verify against: the user's word, or nothing
        return None, ("byte" if wants_byte else override), "no tokenizer recorded in the checkpoint"
    if record["kind"] == "byte":
        if override is not None and not wants_byte:
            raise ConvertError(f"--tokenizer {override}: {ckpt} was trained with the byte tokenizer; drop --tokenizer")
        return record, "byte", "byte-level tokenizer"
    if wants_byte:
        raise ConvertError(f"--tokenizer byte: {ckpt} was trained with {records.describe(record)}; drop --tokenizer")
    directory, note = hf_tokenizer_source(ckpt, record, None if override is None else Path(override), run_dir, flag)
    return record, directory, note


def _recorded_directory(record: dict, run_dir: Optional[Path]) -> Path:
    """The record's directory; a relative one (an old checkpoint's raw data.tokenizer) against the
    directory the run was started in, as megaframe-eval reads the run's data paths."""
    from megaframe.run_config import training_directory

    name = Path(str(record.get("name")))
    started = training_directory(run_dir) if run_dir is not None and not name.is_absolute() else None
    return started / name if started is not None else name


def hf_tokenizer_source(ckpt: Path, record: dict, override: Optional[Path],
                        run_dir: Optional[Path] = None, flag: str = "--tokenizer ") -> tuple[Path, str]:
    """(directory to copy, a note for the summary) of an HF-tokenizer run: the first of --tokenizer,
    the checkpoint's copy and the run's data.tokenizer whose files hash to the record."""
    candidates = [Path(override)] if override is not None else [ckpt / "tokenizer",
                                                                _recorded_directory(record, run_dir)]
    seen = []
    for directory in candidates:
        if not has_tokenizer(directory):
            seen.append(f"{directory}: no tokenizer files")
            continue
        if record.get("sha256") is None:  # an old checkpoint: nothing to check against
            return directory, f"tokenizer from {directory} (unverified: the checkpoint predates tokenizer records)"
        try:
            digest = files_hash(directory, records.scheme_of(record))  # under the record's own scheme
        except OSError as err:
            seen.append(f"{directory}: unreadable ({err})")
            continue
        if digest == record["sha256"]:
            return directory, f"tokenizer from {directory}"
        seen.append(f"{directory}: other files (sha256 {digest[:12]}, trained with {record['sha256'][:12]})")
    hint = "" if override is not None else f"; pass {flag}DIR with the tokenizer the run trained with"
    raise ConvertError(f"{ckpt}: no copy of the tokenizer the weights were trained with ({records.describe(record)}): "
                       f"{'; '.join(seen)}{hint}")


def import_record(hf_dir: Path) -> tuple[Optional[dict], str]:
    """The tokenizer record of an HF model directory's tokenizer (from-hf) and "", or None and why the
    tokenizer is left behind: one that loads only with its own Python (an auto_map), which megaframe
    never runs, would only be refused later by training, sampling and to-hf. byte_record() for one that gives
    megaframe's byte ids. The record holds the ids where the tokenizer loads with an eos token (one
    that does not load here, for want of a package, is copied as before), its files' hash always."""
    from megaframe.data.indexed import DataError
    from megaframe.data.tokenizer import HFTokenizer, TokenizerDoesNotLoad

    try:
        tokenizer = HFTokenizer(hf_dir, named="")
        ids = (tokenizer.vocab_size, tokenizer.eod_id, tokenizer.bos_id)
    except TokenizerDoesNotLoad:  # an auto_map with a class of transformers' own loads, and is copied
        if names_own_code(hf_dir):
            return None, "its tokenizer_config.json names its own Python (auto_map), which megaframe never runs"
        ids = (None, None, None)  # for want of a package here: training with it says why, in its own line
    except DataError:  # no eos token: the same
        ids = (None, None, None)
    else:
        if gives_byte_ids(tokenizer):  # what to-hf wrote for a byte run: the run's own tokenizer comes back
            return records.byte_record(), ""
    try:
        return records.hf_record(hf_dir, *ids), ""
    except OSError as err:
        raise ConvertError(f"{hf_dir}: cannot read its tokenizer files ({err})") from None


# every byte value alone, text that spells the end-of-document token, combining marks and 4-byte characters
_BYTE_PROBE = "".join(map(chr, range(0x180))) + "<|endoftext|> é∑😀e\u0301\r\n\t  <s></s>[UNK]"


def gives_byte_ids(tokenizer: Any) -> bool:
    """Whether an HF tokenizer (HFTokenizer) is megaframe's byte tokenizer in another form: vocabulary
    257, end-of-document 256, and each text's UTF-8 bytes as its ids (to-hf's byte-level export is)."""
    from megaframe.data.tokenizer import ByteTokenizer

    return (tokenizer.vocab_size, tokenizer.eod_id) == (257, 256) and \
        list(tokenizer.encode(_BYTE_PROBE)) == ByteTokenizer().encode(_BYTE_PROBE)


def names_own_code(directory: Path) -> bool:
    """Whether a tokenizer directory's tokenizer_config.json names its own Python (an auto_map)."""
    try:
        return "auto_map" in json_text.loads((Path(directory) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):  # no file, not JSON, JSON but not an object
        return False


def set_special_ids(hf_config: Any, eod_id: Optional[int], bos_id: Optional[int]) -> None:
    """eos/bos of the HF config: the run's end-of-document id (bos: the tokenizer's, else the same)."""
    if eod_id is not None and 0 <= eod_id < hf_config.vocab_size:
        hf_config.eos_token_id = eod_id
        bos = bos_id if bos_id is not None and 0 <= bos_id < hf_config.vocab_size else eod_id
        hf_config.bos_token_id = bos


def write_generation_config(directory: Path, hf_config: Any, context: int) -> None:
    """generation_config.json: generate() stops at the end-of-document id and, by default, at the
    model's context (model.seq_length) instead of running past the positions it was trained on."""
    from transformers import GenerationConfig

    eos = getattr(hf_config, "eos_token_id", None)
    pad = getattr(hf_config, "pad_token_id", None)
    GenerationConfig(max_length=context, eos_token_id=eos, bos_token_id=getattr(hf_config, "bos_token_id", None),
                     pad_token_id=pad if pad is not None else eos).save_pretrained(str(directory))
