"""Plot torch.cuda.memory_reserved() per request from agentic_memory.py JSON files (pooled vs unpooled).

    python benchmark/plot_agentic_memory.py RESULTS_DIR OUT.png
"""

from __future__ import annotations

import glob
import json
import os
import sys


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results_dir, out = sys.argv[1], sys.argv[2]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for path in sorted(glob.glob(os.path.join(results_dir, "agentic_*.json"))):
        r = json.load(open(path))
        xs = [rec["context"] for rec in r["records"]]
        ys = [rec["reserved_bytes"] / 2**30 for rec in r["records"]]
        label = f"{r['index']} keys, {'pooled' if r['pooled'] else 'not pooled'}"
        ax.plot(xs, ys, label=label, linestyle="-" if r["pooled"] else "--")
        print(f"{label}: reserved {ys[4]:.2f} GiB after warm-up -> {ys[-1]:.2f} GiB at context {xs[-1]}")
    ax.set_xlabel("context tokens (one request per point)")
    ax.set_ylabel("torch.cuda.memory_reserved() [GiB]")
    ax.set_title("Lightning-indexer prefill logits: pooled block vs fresh tensors")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
