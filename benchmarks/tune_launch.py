"""Choose each fused kernel's warp count offline, on this GPU, for the DSv4 layer (and the
shared expert fused inside its leaf); for any other model, ``fuser tune FILE.py:FACTORY``.

    PYTHONPATH=. python benchmarks/tune_launch.py [--config flash] [--tokens 8,256] [--out DIR]

See :mod:`fuser.tools.tune`; the table is merged into ``fuser/launch_configs/<GPU>.json`` (or
``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.dsv4 import layer as dsv4  # noqa: E402
from fuser.tools import bench  # noqa: E402
from fuser.codegen.launch_config import TABLE_DIR, current_gpu  # noqa: E402
from fuser.tools.tune import tune_plans, write_table  # noqa: E402


def tune(config: str, tokens: tuple[int, ...]) -> list[dict]:
    layer, inputs = getattr(dsv4, config)(T=max(tokens), device="cuda")
    return tune_plans(dsv4.fuse_layer(layer, inputs), tokens, layer)


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="flash", choices=["flash", "tiny"])
    parser.add_argument("--tokens", default="8,256")
    parser.add_argument("--out", default=str(TABLE_DIR))
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    gpu = current_gpu()
    assert gpu, "tune_launch needs a CUDA GPU"
    about = {**bench.stamp(), "layer": f"examples/dsv4/layer.py:{args.config}", "tokens": list(tokens)}
    print(f"wrote {write_table(tune(args.config, tokens), Path(args.out), gpu, about)}")
