"""The cluster profiles of conf/cluster/, for refusals that depend on the cluster: a layout refused on
one profile (most often cluster=local, this host) names the profiles it would fit, so the one-line
error carries the `cluster=` option that fixes it."""
from __future__ import annotations

import copy
from typing import Optional

from omegaconf import OmegaConf

from megaframe.config.schema import ClusterConfig, TrainConfig
from megaframe.config.validate import Layout
from megaframe.common.paths import conf_dir


def cluster_profiles() -> dict[str, ClusterConfig]:
    """Every conf/cluster/*.yaml, typed, by file name."""
    profiles = {}
    for path in sorted((conf_dir() / "cluster").glob("*.yaml")):
        node = OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(path))
        profiles[path.stem] = OmegaConf.to_object(node)
    return profiles


def fitting_profiles(cfg: TrainConfig, layout: Layout) -> list[str]:
    """The profiles other than cfg.cluster's on which this exact layout fits, as `cluster=NAME (peak
    of capacity)`; the planner's own arithmetic, device padding included."""
    from megaframe.plan.estimate import estimate_config
    from megaframe.plan.report import gib

    fits = []
    for name, cluster in cluster_profiles().items():
        if cluster.name == cfg.cluster.name:
            continue
        other = copy.copy(cfg)
        other.cluster = cluster
        est = estimate_config(other, layout)
        if est.fits:
            fits.append(f"cluster={name} (peak {gib(est.peak)} of {gib(est.capacity)})")
    return fits


def profile_hint(cfg: TrainConfig, layout: Layout) -> Optional[str]:
    """'; it fits cluster=h100_80g (...)' when another profile holds the layout, else None."""
    fits = fitting_profiles(cfg, layout)
    return f"; it fits {' and '.join(fits)}" if fits else None
