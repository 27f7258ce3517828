"""A tokenizer directory is data, never code: one whose tokenizer_config.json names its own Python
(an `auto_map`, what `trust_remote_code` would run) is refused in one line, without running that
code and without asking on the terminal."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO, cli_env
from tests.support.word_tokenizer import give_own_code


@pytest.fixture
def tokenizer_with_code(hf_tokenizer_dir: Path) -> Path:
    give_own_code(hf_tokenizer_dir)  # its Python, if it ran, writes code-ran beside it
    return hf_tokenizer_dir


LOAD = """
import sys
from megaframe.data.tokenizer import HFTokenizer, DataError
try:
    HFTokenizer(sys.argv[1])
except DataError as error:
    print("refused:", error)
"""


def test_a_tokenizer_that_brings_its_own_code_is_refused_without_running_it(tokenizer_with_code):
    # stdin is a terminal-less pipe that answers "y": transformers' prompt, if it came, would run the code
    result = subprocess.run([sys.executable, "-c", LOAD, str(tokenizer_with_code)], cwd=REPO, env=cli_env(),
                            input="y\n", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("refused: data.tokenizer=") and result.stdout.count("\n") == 1, result.stdout
    assert not (tokenizer_with_code / "code-ran").exists(), "the tokenizer directory's Python ran"


def test_the_same_directory_without_the_code_loads(hf_tokenizer_dir):
    from megaframe.data.tokenizer import HFTokenizer

    assert HFTokenizer(hf_tokenizer_dir).eod_id is not None


def test_the_converter_refuses_the_same_directory_in_one_line(tokenizer_with_code):
    """megaframe-convert to-hf reads the checkpoint's tokenizer for its special ids: same rule."""
    from transformers import GPT2Config

    from megaframe.convert.cli import _set_special_tokens
    from megaframe.convert.hf import ConvertError

    with pytest.raises(ConvertError, match="tokenizer does not load") as refused:
        _set_special_tokens(GPT2Config(vocab_size=16), tokenizer_with_code)
    assert "\n" not in str(refused.value)
    assert not (tokenizer_with_code / "code-ran").exists()
