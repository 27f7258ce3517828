"""Loss / eval loss against tokens and throughput against step, several runs overlaid, as a PNG."""
from __future__ import annotations

from pathlib import Path

from megaframe.tracking.metrics import read_metrics


def _tokens(record: dict, seq_length: int | None) -> float | None:
    if "consumed_tokens" in record:
        return record["consumed_tokens"]
    return record["consumed_samples"] * seq_length if seq_length else None


def _seq_length(run_dir: Path) -> int | None:
    """model.seq_length from the run's resolved config (older runs log samples, not tokens)."""
    import os

    from omegaconf import OmegaConf

    from megaframe.run_config import CONFIG_FILE, saved_run_config

    config = run_dir / CONFIG_FILE
    if not os.path.lexists(config):
        return None
    # the one reader of a run's config (no link followed, size-capped); ConfigError is a ValueError
    return OmegaConf.select(saved_run_config(config), "model.seq_length", default=None)


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """Write `out` (PNG) with one line per run and metric; raises ValueError on a run without metrics."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run_dir in map(Path, run_dirs):
        metrics_file = run_dir / "metrics.jsonl"
        if not metrics_file.is_file():
            raise ValueError(f"{run_dir}: no metrics.jsonl; pass a megaframe run directory")
        records, seq = read_metrics(metrics_file), _seq_length(run_dir)
        label = run_dir.name
        train = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        line, = ax_loss.plot([_tokens(r, seq) for r in train], [r["loss"] for r in train], label=f"{label} loss")
        ax_loss.plot([_tokens(r, seq) for r in evals], [r["eval_loss"] for r in evals], "o--", color=line.get_color(),
                     label=f"{label} eval loss")
        ax_speed.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], label=label)
    ax_loss.set(xlabel="tokens", ylabel="loss", title="loss against tokens")
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)  # never leave a half-written PNG under the final name
    return out
