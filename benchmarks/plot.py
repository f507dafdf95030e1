"""Draw benchmarks/results/<name>.png from <name>.json (needs matplotlib; not a test dependency).

    python benchmarks/plot.py benchmarks/results/dsv4_flash.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: Path) -> Path:
    data = json.loads(path.read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in zip(
        axes, ("layer_us", "glue_us", "glue_launches"), ("whole layer, µs", "glue GPU time, µs", "glue launches per layer")
    ):
        for variant in ("eager", "compile", "fuser"):
            rows = [r for r in data["rows"] if r["variant"] == variant]
            if rows:
                ax.plot([r["tokens"] for r in rows], [r[key] for r in rows], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per decode step (T)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    s = data["stamp"]
    fig.suptitle(f"{data['target']} — {s['gpu']}, torch {s['torch']}, triton {s['triton']}, commit {s['commit']}")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))
