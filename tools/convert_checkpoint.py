#!/usr/bin/env python
"""Convert checkpoints: `to-hf CKPT OUT` (megaframe -> transformers), `from-hf HF_DIR OUT` (transformers -> megaframe).

The same as `megaframe-convert` / `python -m megaframe.convert`; see megaframe/convert/cli.py.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Run from a source checkout without installing: `python tools/convert_checkpoint.py ...` puts tools/,
# not the repo root, on sys.path. An installed megaframe takes precedence.
if importlib.util.find_spec("megaframe") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megaframe.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
