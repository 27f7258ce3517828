"""data.tokenizer against the tokenizer a dataset's sidecar records (data/formats.py): by its files'
hash where preprocess recorded one, so a tokenizer with the same vocabulary size and end-of-document
id but other ids is refused, and a moved copy is not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megaframe.data import DataError, open_dataset
from megaframe.data.preprocess import preprocess
from megaframe.data.tokenizer import HFTokenizer
from tests.unit.data.test_indexed import assert_one_line
from tests.support.word_tokenizer import TEXTS, save_word_tokenizer, swap_words


def _dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset preprocessed with a word tokenizer, and that tokenizer's directory."""
    tokenizer = save_word_tokenizer(tmp_path / "tok")
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    preprocess([text], tmp_path / "ds", tokenizer=str(tokenizer), progress=False)
    return tmp_path / "ds", tokenizer


def test_a_moved_copy_of_the_tokenizer_opens_the_dataset(tmp_path: Path) -> None:
    prefix, tokenizer = _dataset(tmp_path)
    moved = shutil.copytree(tokenizer, tmp_path / "elsewhere" / "tok")
    assert open_dataset(prefix, str(moved)).vocab_size == HFTokenizer(tokenizer).vocab_size
    assert open_dataset(prefix, str(tokenizer)).metadata["tokenizer_hash_scheme"] == 2


def test_a_tokenizer_with_the_same_sizes_but_other_ids_is_refused(tmp_path: Path) -> None:
    """Two words trade ids: the vocabulary size and end-of-document id agree, and the run trained on
    (the check compared only those two), recording the other tokenizer in every checkpoint."""
    prefix, tokenizer = _dataset(tmp_path)
    other = shutil.copytree(tokenizer, tmp_path / "other")
    swap_words(other)
    assert (HFTokenizer(other).vocab_size, HFTokenizer(other).eod_id) == \
        (HFTokenizer(tokenizer).vocab_size, HFTokenizer(tokenizer).eod_id)
    with pytest.raises(DataError) as error:
        open_dataset(prefix, str(other))
    assert f"data.tokenizer={other} is not the tokenizer that made {prefix}'s tokens" in str(error.value)
    assert f"set data.tokenizer={tokenizer}" in str(error.value)
    assert_one_line(error)


def test_a_tokenizer_changed_in_place_since_preprocess_is_refused(tmp_path: Path) -> None:
    prefix, tokenizer = _dataset(tmp_path)
    assert open_dataset(prefix, str(tokenizer))  # hashed once here: the edit below must be seen
    swap_words(tokenizer)
    with pytest.raises(DataError) as error:
        open_dataset(prefix, str(tokenizer))
    assert f"data.tokenizer={tokenizer}: its files changed since they made {prefix}'s tokens" in str(error.value)
    assert_one_line(error)


def test_a_sidecar_written_before_the_hash_compares_sizes_as_before(tmp_path: Path) -> None:
    """Datasets preprocessed before sidecars held the hash still open with a moved copy (by name,
    vocabulary and end-of-document id): the hash is not there to compare."""
    prefix, tokenizer = _dataset(tmp_path)
    sidecar = Path(f"{prefix}.json")
    fields = json.loads(sidecar.read_text())
    del fields["tokenizer_sha256"], fields["tokenizer_hash_scheme"]
    sidecar.write_text(json.dumps(fields))
    other = shutil.copytree(tokenizer, tmp_path / "other")
    swap_words(other)
    assert open_dataset(prefix, str(other)).vocab_size == HFTokenizer(tokenizer).vocab_size


def test_the_sidecar_names_a_tokenizer_given_by_a_relative_path_by_its_full_path(tmp_path: Path, monkeypatch) -> None:
    """--tokenizer tok was recorded as "tok": a run started elsewhere was told to set data.tokenizer=tok."""
    save_word_tokenizer(tmp_path / "tok")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    monkeypatch.chdir(tmp_path)
    preprocess(["docs.jsonl"], "ds", tokenizer="tok", progress=False)
    assert json.loads((tmp_path / "ds.json").read_text())["tokenizer"] == str((tmp_path / "tok").resolve())


def test_a_copy_with_another_end_of_document_token_is_refused(tmp_path: Path) -> None:
    """The hash covers the vocabulary files, not tokenizer_config.json's eos_token: a copy whose eos is
    another token hashed alike and opened the dataset (its tokens end documents with the old id)."""
    prefix, tokenizer = _dataset(tmp_path)
    other = shutil.copytree(tokenizer, tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "[UNK]"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError) as error:
        open_dataset(prefix, str(other))
    assert f"data.tokenizer={other} has vocabulary 11 and end-of-document id 0, but {prefix}'s tokens were made " \
           f"with 11 and 1" in str(error.value)
    assert_one_line(error)


def test_a_copy_re_saved_with_other_bytes_for_the_same_mapping_opens_the_dataset(tmp_path: Path) -> None:
    """Another version of `tokenizers` writes other bytes for the same tokenizer (merges as pairs or as
    strings, another layout): it maps every token to the same id as the recorded one, which is still in
    place and unchanged, so it opens the dataset; once the recorded one is gone nothing shows that."""
    prefix, tokenizer = _dataset(tmp_path)
    resaved = shutil.copytree(tokenizer, tmp_path / "resaved")
    (resaved / "tokenizer.json").write_text(json.dumps(json.loads((resaved / "tokenizer.json").read_text()), indent=4))
    assert open_dataset(prefix, str(resaved)).vocab_size == 11
    shutil.rmtree(tokenizer)
    with pytest.raises(DataError, match=f"data.tokenizer={resaved} is not the tokenizer that made"):
        open_dataset(prefix, str(resaved))
