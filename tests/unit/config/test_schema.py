"""Defaults of the typed config that depend on who runs it."""
from __future__ import annotations

from megaframe.config.schema import LoopConfig


def test_each_user_gets_a_fast_tier_folder_of_their_own_by_default(monkeypatch):
    """The fast tier refuses a folder another user owns (checkpoint/fast_tier.private_problem), so a
    default shared by every user of a node (/dev/shm/megaframe) failed each second user with exit 8."""
    folders = {}
    for user in ("alice", "bob"):
        for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
            monkeypatch.setenv(name, user)
        folders[user] = LoopConfig().fast_save_dir
    assert folders["alice"] != folders["bob"]
    assert all(folder.startswith("/dev/shm/") for folder in folders.values())
    assert not folders["bob"].startswith(folders["alice"] + "/")
