"""What a run reports: metrics.jsonl fields, MFU against a configured peak, the offline W&B run.
(No MFU without a peak: tests/e2e/test_train_cli.py::test_default_run_learns checks the default run.)"""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, assert_ok, curve, read_metrics, run_cli
from megaframe.tracking.wandb_offline import read_offline_run

pytestmark = pytest.mark.slow


def test_offline_wandb_run_holds_config_and_metrics(tmp_path):
    args = [a for a in TINY if not a.startswith("logging.wandb")]
    result = run_cli([*args, "train.max_steps=6", "logging.wandb.mode=offline", "cluster.peak_tflops=0.5",
                      f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    records = read_metrics(tmp_path)
    train = [r for r in records if "loss" in r]
    for r in train:
        assert "mfu" in r  # a configured peak is used as given; the FLOPs are checked in test_flop_counter.py
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"])
        assert r["memory_gb"] > 0.05 and r["consumed_tokens"] == r["step"] * 8 * 32
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run = read_offline_run(run_file)
    assert run["config"]["model"]["hidden_size"] == 64 and run["config"]["parallel"]["global_batch_size"] == 8
    assert run["config"]["run"]["world_size"] == 1 and run["config"]["run"]["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    # one process at ZeRO-0 in fp32: stepped without DeepSpeed (backends/plain/), and the run says so
    assert run["config"]["run"]["engine"] == "plain" and "deepspeed" not in run["config"]["run"]["versions"]
    # no recipe and no logging.wandb.group: grouped by model, named by layout, ZeRO and precision
    assert run["group"].startswith("gpt2-") and run["name"] == run["group"] + "-tp1pp1dp1-zero0-fp32"
    assert run["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    logged = [(row["_step"], row["loss"]) for row in run["history"] if "loss" in row]
    assert logged == curve(records, "loss")
    assert [row["eval_loss"] for row in run["history"] if "eval_loss" in row] == [v for _, v in curve(records, "eval_loss")]


@pytest.mark.parametrize("tf32, peak", [(False, 66.9), (True, 494.7)])
def test_mfu_divides_by_the_profiles_gpu_in_the_runs_matmul_precision(tmp_path, tf32, peak):
    """cluster.gpu=H100 in fp32: MFU against the fp32 peak, or TF32's with precision.tf32=true (which
    the run turns on in torch). The profiles once gave every precision bf16's 989."""
    result = run_cli([*TINY, "train.max_steps=2", "cluster.gpu=H100", f"precision.tf32={str(tf32).lower()}",
                      f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    for record in (r for r in read_metrics(tmp_path) if "loss" in r):
        assert record["mfu"] * peak == pytest.approx(record["tflops"], rel=1e-6)


def test_bench_tool_compares_megaframe_with_plain_loops_and_transformers():
    """Without its compiled path (tests/unit/model/test_compile.py covers compiled blocks): CI time."""
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    result = subprocess.run([sys.executable, "tools/bench.py", "--steps", "2", "--repeats", "2", "--warmup", "1",
                             "--no-compile"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert_ok(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["megaframe", "pytorch", "transformers", "nanogpt loop",
                                                          "nanogpt model"]
    assert all(float(row.split("|")[2].replace(",", "")) > 0 for row in rows)


def test_bench_tool_times_muon_and_document_masks_against_megaframes_baseline(tmp_path):
    """--optim muon --document-mask: megaframe's rows only, each beside its baseline run (AdamW, no
    mask) in the same interleaved rounds, and the step-time ratio the Muon target (1.1x) is read from.
    Its two trainers' run folders are gone after it (each run used to leave one in the temp folder)."""
    import re
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    result = subprocess.run([sys.executable, "tools/bench.py", "--steps", "1", "--repeats", "2", "--warmup", "1",
                             "--no-compile", "--optim", "muon", "--document-mask", "model.num_layers=2",
                             "model.hidden_size=64", "model.ffn_hidden_size=256", "model.seq_length=32"],
                            cwd=REPO, env=cli_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert_ok(result)
    assert not list(tmp_path.glob("megaframe-bench-*")), sorted(p.name for p in tmp_path.iterdir())
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    label = "adamw, no document mask"
    assert [row.split("|")[1].strip() for row in rows] == ["megaframe", f"megaframe ({label})"], rows
    assert all(float(row.split("|")[2].replace(",", "")) > 0 for row in rows)
    ratio = re.search(rf"^step time megaframe / megaframe \({label}\): ([\d.]+) \(rounds ", result.stdout, re.M)
    assert ratio and float(ratio.group(1)) > 0, result.stdout[-2000:]


def test_adamw_and_profile_tools_run():
    """The two tools BENCHMARKS.md cites for the optimizer and the per-operator profile."""
    import re
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    adamw = subprocess.run([sys.executable, "tools/bench_adamw.py", "--rounds", "1", "--steps", "1"], cwd=REPO,
                           env=cli_env(), capture_output=True, text=True, timeout=300)
    assert_ok(adamw)
    timings = dict(re.findall(r"^(default \(loop\)|fused)\s+([\d.]+) ms", adamw.stdout, re.M))
    assert set(timings) == {"default (loop)", "fused"} and all(float(v) > 0 for v in timings.values())
    # the bench model: 4 layers, hidden 256, ffn 1024, seq 128, the 257-byte vocabulary unpadded on the CPU:
    # 257*256 + 128*256 + 4 * (3*(256*256+256) + 256*256+256 + 256*1024+1024 + 1024*256+256 + 2*2*256) + 2*256
    assert "gpt2: 3,258,112 parameters" in adamw.stdout
    profile = subprocess.run([sys.executable, "tools/profile_step.py", "--steps", "1", "--warmup", "1", "--rows", "5"],
                             cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert_ok(profile)
    assert profile.stdout.count("aten::mm") == 2  # one table per path, matmuls among the top rows


def test_the_trash_bench_times_both_deletes_and_leaves_nothing(tmp_path):
    """tools/bench_trash.py, whose figures BENCHMARKS.md cites for the trash's rm child."""
    import re
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    result = subprocess.run([sys.executable, "tools/bench_trash.py", "--files", "3000", "--rounds", "1"], cwd=REPO,
                            env=cli_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert_ok(result)
    deletes = re.findall(r"^(python rmtree|rm child): 3,000 files deleted in [\d.]+ s", result.stdout, re.M)
    assert deletes == ["python rmtree", "rm child"] and "no delete: step median" in result.stdout, result.stdout
    assert list(tmp_path.iterdir()) == []
