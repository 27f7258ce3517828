"""Writing state so that no reader, and no crash, ever sees half a file."""
from __future__ import annotations

import os
import socket
from pathlib import Path

from megaframe.common.safe_files import create_fresh


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file.
    The temp file is named by host and process: ranks on several hosts may write the same path on
    shared storage (the last rename wins, whole)."""
    tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    with os.fdopen(create_fresh(tmp), "w") as f:  # a link planted at the temp name is not followed
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
