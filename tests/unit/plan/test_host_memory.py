"""Host memory per node in the plan (plan/host.py): a layout that fits the GPUs but not the nodes' RAM
is refused before launch, in one line naming the settings that fill it. The figures themselves are
measured against real ranks in tests/dist/test_host_memory_plan.py.

Llama-2 70B on one DGX H100 node with ZeRO-3 and offload=cpu (DeepSpeed's ZeRO-Offload recipe for a
70B on 8 GPUs): 46 GiB per GPU fits the 80, and the ranks' offloaded states are 8 x 96 GiB of the
node's RAM; the fast tier's parts (4 x 128 GiB a rank) would take 4.9 TiB of it."""
from __future__ import annotations

import pytest

from megaframe.launch.checks import check
from megaframe.plan.cli import main as plan_main, preflight
from megaframe.plan.estimate import estimate_config
from megaframe.plan.memory import GIB

OFFLOADED_70B = ["recipe=llama2_70b", "cluster=h100_80g", "zero=stage3", "offload=cpu", "parallel.tp=1",
                 "parallel.pp=1", "parallel.dp=8"]


def _plan(*overrides: str):
    cfg, layout, _ = check(list(overrides))
    return estimate_config(cfg, layout)


def test_offloaded_states_and_async_copies_fill_the_node_but_fit():
    est = _plan(*OFFLOADED_70B, "train.async_save=true")
    host = est.host
    assert est.fits_devices and est.fits and host.ranks == 8 and host.capacity == 1900 * GIB
    # 69.0B parameters over 8 ranks: Adam's fp32 master and moments offloaded (12 bytes each), and a
    # save's copy of the rank's shard (those plus the bf16 weight: 14 bytes each)
    assert host.offloaded / GIB == pytest.approx(96.4, abs=0.1)
    assert host.async_copies / GIB == pytest.approx(112.4, abs=0.1)
    assert host.peak / GIB == pytest.approx(8 * (96.4 + 112.4), abs=1)


def test_a_layout_that_fits_the_gpus_but_not_the_nodes_ram_is_refused_before_launch(capsys):
    overrides = [*OFFLOADED_70B, "train.fast_save_interval=10"]
    est = _plan(*overrides)
    assert est.fits_devices and not est.fits and not est.host.fits
    cfg, layout, _ = check(overrides)
    with pytest.raises(SystemExit) as ended:
        preflight(cfg, layout, [], "megaframe-train")
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("megaframe-train: error: the planner says this will not fit: "), line
    assert "but NOT the host memory: 8 ranks x (offload=cpu states 96.36 GiB + train.fast_save_interval parts " in line
    assert "vs 1,900.00 GiB per node" in line
    assert "keep less in host memory (offload=nvme offload.nvme_path=DIR, train.fast_save_interval=0)" in line, line
    assert "set cluster.host_memory_gb" in line, line
    # what does not help the host (a smaller micro-batch) is not offered; the host line is said once
    assert "micro_batch_size" not in line and line.count("4,882.20 GiB") == 1, line


def test_parallel_auto_says_when_the_host_memory_is_what_no_layout_fits(capsys):
    cfg, layout, _ = check([*OFFLOADED_70B, "train.fast_save_interval=10", "parallel=auto"])
    with pytest.raises(SystemExit) as ended:
        preflight(cfg, layout, [], "megaframe-train")
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("megaframe-train: error: parallel=auto: no layout of 8 ranks fits cluster=h100_80g "
                               "(the host memory: 8 ranks x (offload=cpu states"), lines[0]
    assert "more nodes shrink each rank's share" in lines[0] and "train.fast_save_interval=0" in lines[0]


def test_fsdp2_is_not_told_to_offload_to_nvme_which_it_cannot(capsys):
    overrides = ["recipe=llama2_70b", "cluster=h100_80g", "backend=fsdp2", "zero=stage3", "offload=cpu",
                 "parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "train.fast_save_interval=10"]
    cfg, layout, _ = check(overrides)
    with pytest.raises(SystemExit):
        preflight(cfg, layout, [], "megaframe-train")
    line = capsys.readouterr().err.strip()
    assert "keep less in host memory (train.fast_save_interval=0)" in line and "nvme" not in line, line


def test_the_plan_table_says_what_fills_the_nodes_ram(capsys):
    plan_main([*OFFLOADED_70B, "train.fast_save_interval=10"])
    out = capsys.readouterr().out
    host = [line for line in out.splitlines() if line.startswith("host memory: ")]
    assert len(host) == 1 and host[0].endswith("vs 1,900.00 GiB per node: DOES NOT FIT"), out
    assert "per device: FITS" in out  # the GPUs are not what fails


def test_states_offloaded_to_nvme_take_no_ram_and_an_unknown_node_is_not_checked():
    assert _plan(*OFFLOADED_70B[:3], "offload=nvme", "offload.nvme_path=/tmp", *OFFLOADED_70B[4:]).host.offloaded == 0
    # optimizer states on the drive, parameters in RAM: the bf16 weights alone, as a rank holds them unoffloaded
    mixed = _plan(*OFFLOADED_70B[:3], "offload=nvme", "offload.nvme_path=/tmp", "offload.param=cpu", *OFFLOADED_70B[4:])
    on_device = _plan(*OFFLOADED_70B[:3], "offload=none", *OFFLOADED_70B[4:]).stages[0].states.weights
    assert mixed.host.offloaded == on_device and on_device / GIB == pytest.approx(16.06, abs=0.01)
    est = _plan(*OFFLOADED_70B, "train.fast_save_interval=10", "cluster.host_memory_gb=null")
    assert est.host.capacity is None and est.fits


def test_a_local_cpu_run_counts_its_whole_peak_and_its_copies_against_this_hosts_ram(capsys):
    """cluster=local without a GPU: the ranks' memory is the host's; a background save's copies add to it."""
    tiny = ["model=gpt_tiny", "parallel.dp=2", "zero=stage1", "train.async_save=true"]
    est = _plan(*tiny)
    host = est.host
    assert host.device_in_ram == est.peak and host.offloaded == 0 and host.async_copies > 0
    assert host.fits and host.capacity > 0
    small = f"cluster.host_memory_gb={host.peak / GIB * 0.05}"  # no layout of two ranks fits it
    refused = _plan(*tiny, small)
    assert refused.fits_devices and not refused.fits
    # one host: no advice to add nodes, and the copies are what can go
    for auto in ([], ["parallel=auto"]):
        cfg, layout, _ = check([*tiny, small, *auto])
        with pytest.raises(SystemExit):
            preflight(cfg, layout, [], "megaframe-train")
        line = capsys.readouterr().err.strip()
        assert "host memory" in line and "more nodes" not in line and "train.async_save=false" in line, line


def test_a_host_memory_that_is_not_positive_is_one_line(capsys):
    with pytest.raises(SystemExit) as ended:
        plan_main(["cluster.host_memory_gb=0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and lines[0].startswith(
        "megaframe-plan: error: cluster.host_memory_gb=0.0 must be > 0"), lines
