"""Draw benchmarks/results/<name>.png from <name>.json (needs matplotlib; not a test dependency).

    python benchmarks/plot.py benchmarks/results/dsv4_flash.json
    python benchmarks/plot.py benchmarks/results/zoo.json      # the zoo summary
    python benchmarks/plot.py benchmarks/results/decode.json   # whole-model decode steps
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_zoo(data: dict, path: Path) -> Path:
    """fuser's glue time over torch.compile's, and glue launches, per zoo layer and T."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    layers = sorted({r["layer"] for r in data["rows"]})
    for layer in layers:
        rows = [r for r in data["rows"] if r["layer"] == layer]
        T = [r["tokens"] for r in rows]
        axes[0].plot(T, [r["fuser_over_compile"] for r in rows], marker="o", label=layer)
        axes[1].plot(T, [r["glue_launches"][2] - r["glue_launches"][1] for r in rows], marker="o", label=layer)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(0.5, color="k", lw=0.8, ls="--")
    axes[0].set_title("glue µs, fuser / torch.compile (target 1.0; 0.5 for mHC/MoE layers)")
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set_title("glue launches, fuser − torch.compile (target ≤ 0)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per decode step (T)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("transformers' decoder layers at real dims, H200, replayed in CUDA graphs")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def plot_decode(data: dict, path: Path) -> Path:
    """Step time, tokens/s and glue launches per variant and batch, one row per model measured."""
    models = {name: m for name, m in data["models"].items() if any("step_us" in r for r in m["rows"])}
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for row, (name, model) in zip(axes, models.items()):
        for ax, key, label in zip(row, ("step_us", "tokens_per_s", "glue_launches"), ("decode step, µs", "tokens/s", "glue launches per step")):
            for variant in ("eager", "compile", "fuser"):
                rows = [r for r in model["rows"] if r["variant"] == variant and key in r]
                ax.plot([r["batch"] for r in rows], [r[key] for r in rows], marker="o", label=variant)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (sequences, one new token each)")
            s = model["stamp"]
            ax.set_title(f"{name}: {label} (commit {s['commit']})")
            ax.grid(alpha=0.3)
        row[0].legend()
    fig.suptitle("a whole CausalLM's decode step, static cache, replayed in CUDA graphs, H200")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def plot(path: Path) -> Path:
    data = json.loads(path.read_text())
    if "models" in data:
        return plot_decode(data, path)
    if "stamp" not in data:
        return plot_zoo(data, path)
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
