"""logging.wandb.mode=online without a key is one line before launch (wandb would prompt on rank 0's
terminal, or fail with its own traceback after the ranks started)."""
from __future__ import annotations

from megaframe.tracking.wandb_run import online_key_problem


def test_offline_and_disabled_need_no_key(tmp_path):
    assert online_key_problem("offline", {"NETRC": str(tmp_path / "none")}) is None
    assert online_key_problem("disabled", {"NETRC": str(tmp_path / "none")}) is None


def test_online_finds_the_key_where_wandb_does(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert online_key_problem("online", {"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "none")}) is None
    assert online_key_problem("online", {"NETRC": str(netrc)}) is None
    # a self-hosted server's key is its host's entry, not api.wandb.ai's
    problem = online_key_problem("online", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})
    assert problem is not None and "wandb.example.org" in problem


def test_online_without_a_key_names_the_ways_to_give_one(tmp_path):
    problem = online_key_problem("online", {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "none")})
    assert problem is not None and "\n" not in problem
    assert "WANDB_API_KEY" in problem and "wandb login" in problem and "logging.wandb.mode=offline" in problem
