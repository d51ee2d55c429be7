"""The Pareto front as a PNG: shard bytes against predicted loss, every non-dominated mix, the uniform recipes
as labelled reference points and the pick circled (the same rows `quant search` prints)."""

from __future__ import annotations

from pathlib import Path


def plot_front(rows: list[dict], pick: dict, out: Path, title: str) -> None:
    """`rows`: the search's `front` (size_bytes, predicted_loss, what); `pick`: the chosen row's totals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    front = [r for r in rows if r["what"] == "pareto"]
    ax.step([r["size_bytes"] / 1e6 for r in front], [r["predicted_loss"] for r in front], where="post",
            color="#1f77b4", lw=1.2, label="Pareto front (engine-loadable mixes)")
    ax.scatter([r["size_bytes"] / 1e6 for r in front], [r["predicted_loss"] for r in front], s=10, color="#1f77b4")
    for r in rows:
        if r["what"].startswith("recipe "):
            ax.scatter([r["size_bytes"] / 1e6], [r["predicted_loss"]], marker="s", color="#d62728", s=28, zorder=3)
            ax.annotate(r["what"].removeprefix("recipe "), (r["size_bytes"] / 1e6, r["predicted_loss"]),
                        textcoords="offset points", xytext=(5, 5), fontsize=7, color="#d62728")
    ax.scatter([pick["size_bytes"] / 1e6], [pick["predicted_loss"]], s=90, facecolors="none", edgecolors="#2ca02c",
               lw=2, zorder=4, label=f"pick: {pick['effective_bits']} effective bits")
    ax.set_xlabel("shard bytes (MB)")
    ax.set_ylabel("predicted loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
