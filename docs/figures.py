"""Draws the site's figures into docs/_static/figures/ (``make figures``).

The measured figures read ``docs/_data/records.json``, whose numbers are
copied from the recorded tables it names; the schedule figures are drawn
from the library's own schedule code (``make_schedule``), so they show what
the ring does. Run from anywhere: ``python docs/figures.py``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

import skipreduce_jax as sr  # noqa: E402
from skipreduce_jax import cost  # noqa: E402

OUT = DOCS / "_static" / "figures"
RECORDS = json.loads((DOCS / "_data" / "records.json").read_text())
FULL, SKIP, FAST, GREY = "#4C72B0", "#DD8452", "#55A868", "#BBBBBB"
plt.rcParams.update({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
                     "savefig.dpi": 150, "savefig.bbox": "tight"})


def _save(fig: plt.Figure, name: str) -> None:
    fig.savefig(OUT / name)
    plt.close(fig)
    print(f"wrote {(OUT / name).relative_to(DOCS.parent)}")


def _ring_axes(ax: plt.Axes, n: int, summed: set[int], chunk: int, title: str) -> None:
    """Draws n ranks on a circle: summed ranks filled, dropped ones hollow."""
    angles = [math.pi / 2 - 2 * math.pi * r / n for r in range(n)]
    xy = [(math.cos(a), math.sin(a)) for a in angles]
    for r in range(n):
        nxt = (r + 1) % n
        x0, y0 = xy[r]
        x1, y1 = xy[nxt]
        used = r in summed and nxt in summed and r != chunk
        ax.annotate("", xy=(x1 * 0.86 + x0 * 0.14, y1 * 0.86 + y0 * 0.14),
                    xytext=(x0 * 0.86 + x1 * 0.14, y0 * 0.86 + y1 * 0.14),
                    arrowprops=dict(arrowstyle="-|>", color=SKIP if used else GREY,
                                    lw=2.2 if used else 1.0, ls="-" if used else ":"))
    for r, (x, y) in enumerate(xy):
        ax.add_patch(plt.Circle((x, y), 0.17, facecolor=SKIP if r in summed else "white",
                                edgecolor=SKIP if r in summed else GREY, lw=1.5, zorder=3))
        ax.text(x, y, str(r), ha="center", va="center", zorder=4,
                fontweight="bold" if r == chunk else "normal")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-1.35, 1.35)
    ax.set_ylim(-1.35, 1.35)
    ax.set_aspect("equal")
    ax.axis("off")


def ring() -> None:
    """One ring chunk's reduce-scatter on 8 ranks: all of it, and k = 4 skipped."""
    n, chunk = 8, 0
    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    for ax, k in zip(axes, (0, 4)):
        schedule = sr.make_schedule(n, num_skip=k, randomize=False)
        summed = {r for r in range(n) if bool(schedule.contributes(r)[chunk, 0])}
        title = ("all-reduce:\nchunk 0 sums all 8 ranks in 7 steps" if k == 0 else
                 f"SkipReduce, k = {k}:\nchunk 0 sums {n - k} ranks in {n - 1 - k} steps")
        _ring_axes(ax, n, summed, chunk, title)
    fig.text(0.5, 0.0, "filled: the ranks summed into ring chunk 0; solid arrows: the\n"
             "reduce-scatter sends that carry it; rank 0 ends holding the sum",
             ha="center", fontsize=9)
    _save(fig, "ring.png")


def schedule() -> None:
    """Who is summed into which element: static, Random, and a balanced period."""
    n, k, columns = 8, 4, 16
    key = jax.random.key(0)
    panels = [("static: the same ranks dropped every step",
               sr.make_schedule(n, num_skip=k, chunks_per_rank=columns, randomize=False)),
              ("Random, balanced step 1 (phase 0)",
               sr.make_schedule(n, num_skip=k, chunks_per_rank=columns, key=key, phase=0)),
              ("step 2 (phase 1): the ranks step 1 dropped",
               sr.make_schedule(n, num_skip=k, chunks_per_rank=columns, key=key, phase=1))]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), sharey=True)
    cmap = matplotlib.colors.ListedColormap(["white", SKIP])
    for ax, (title, s) in zip(axes, panels):
        matrix = np.asarray(s.contribution_matrix())[:, 0, :]  # ranks x columns of slot 0
        ax.imshow(matrix, cmap=cmap, aspect="auto", vmin=0, vmax=1)
        ax.set_title(title, fontsize=9.5)
        ax.set_xlabel("sub-chunk of one slot")
        ax.set_xticks([])
        ax.set_yticks(range(n))
        for edge in range(n + 1):
            ax.axhline(edge - 0.5, color="white", lw=0.6)
    axes[0].set_ylabel("rank")
    fig.suptitle(f"8 ranks, k = {k}: filled = this rank's value is summed "
                 f"({n - k} ranks per element); over the 2-step period every rank is "
                 "summed into every element once", fontsize=9.5, y=1.03)
    _save(fig, "schedule.png")


def bytes_sent() -> None:
    """Bytes each device sends per step against k, from the library's formula."""
    n = 8
    ks = np.arange(n)
    fractions = [cost.traffic_fraction(n, int(k)) for k in ks]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.plot(ks, fractions, "o-", color=SKIP, label="float32 wire")
    ax.plot(ks, np.asarray(fractions) / 2, "s--", color=FAST, label="bfloat16 wire (comm_dtype)")
    ax.axhline(1.0, color=FULL, lw=1, label="ring all-reduce")
    ax.set_xlabel("k, reduce-scatter steps skipped (N = 8)")
    ax.set_ylabel("bytes sent / all-reduce's")
    ax.set_ylim(0, 1.1)
    ax.legend(frameon=False, fontsize=9)
    _save(fig, "bytes.png")


def cluster() -> None:
    """The emulated cluster's collective timings as bars, theory marked."""
    rec = RECORDS["cluster_collectives"]
    ms, theory = np.asarray(rec["ms"]), np.asarray(rec["theory"]) * rec["ms"][0]
    colors = [FULL, FULL] + [GREY] * 3 + [SKIP] * 3
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    x = np.arange(len(ms))
    ax.bar(x, ms, color=colors)
    ax.scatter(x, theory, marker="_", s=400, color="black", zorder=3,
               label="theory: psum x (2(N-1)-k)/(2(N-1))")
    for xi, value in zip(x, ms):
        ax.text(xi, value + 10, str(value), ha="center", fontsize=8.5)
    ax.set_xticks(x, rec["variants"], rotation=20)
    ax.set_ylabel("ms per call (median)")
    ax.set_title("4 emulated hosts at 1 Gbit/s, 16M float32 per rank", fontsize=10)
    ax.legend(frameon=False, fontsize=9, loc="upper right")
    _save(fig, "cluster.png")


def time_to_accuracy() -> None:
    """Speedup to the all-reduce's accuracy, and the 16-bit wire's step times."""
    mlp, wire = RECORDS["tta_mlp"], RECORDS["tta_comm_dtype"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6),
                                      gridspec_kw=dict(width_ratios=[3, 2]))
    x = np.arange(len(mlp["variants"]))
    left.bar(x - 0.2, mlp["speedup_acc"], 0.4, color=SKIP, label="to its accuracy")
    left.bar(x + 0.2, mlp["speedup_loss"], 0.4, color=FULL, label="to its test loss")
    left.axhline(1.0, color="black", lw=0.8)
    names = [v.replace(" + ", " +\n").replace(" r=", "\nr=") for v in mlp["variants"]]
    left.set_xticks(x, names, fontsize=8.5)
    left.set_ylabel("speedup over the all-reduce")
    left.set_title("MLP, SGD, 4 hosts at 500 Mbit/s, 60 s each", fontsize=10)
    left.legend(frameon=False, fontsize=9)
    labels = ["all-reduce", "Random", "Random,\nbf16 wire", "pmean of\nbf16 cast"]
    x = np.arange(len(labels))
    right.bar(x, wire["ms_per_step"], color=[FULL, SKIP, FAST, GREY])
    for xi, (ms, speed) in enumerate(zip(wire["ms_per_step"], wire["speedup_acc"])):
        right.text(xi, ms + 8, f"{ms} ms\n" + (f"{speed:.2f}x" if speed else "never"),
                   ha="center", fontsize=8.5)
    right.set_xticks(x, labels, fontsize=9)
    right.set_ylabel("ms per step")
    right.set_ylim(0, 680)
    right.set_title("a 16-bit wire (separate run): step time, speedup", fontsize=10)
    _save(fig, "time_to_accuracy.png")


def loss_vs_time() -> None:
    """Test loss against wall-clock seconds: all-reduce, Random, a bf16 wire.

    Drawn small with large text: the landing page shows it on a phone too.
    """
    run = RECORDS["tta_curves"]
    with plt.rc_context({"font.size": 12}):
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        for name, color in zip(run["variants"], (FULL, SKIP, FAST), strict=True):
            curve = run["curves"][name]
            ax.plot(curve["seconds"], curve["loss"], color=color, lw=2.2, label=name)
        target = run["target_loss"]
        ax.axhline(target, color=GREY, lw=1, ls="--")
        ax.text(1, target, " the all-reduce's final loss", va="bottom", fontsize=11,
                color="#555555")
        ax.set_xlabel("seconds of training")
        ax.set_ylabel("test loss (mean of 3 evals)")
        ax.set_ylim(top=run["ylim_top"])
        ax.set_title("MLP, SGD: 4 CPU hosts, emulated 500 Mbit/s", fontsize=12)
        ax.legend(frameon=False, fontsize=11)
        _save(fig, "loss_vs_time.png")


def time_to_accuracy_lm() -> None:
    """The LM's seconds to the all-reduce's validation loss."""
    rec = RECORDS["tta_lm"]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    y = np.arange(len(rec["variants"]))[::-1]
    seconds = [s if s is not None else 60 for s in rec["seconds_to_target"]]
    colors = [FULL, SKIP, SKIP, GREY, GREY]
    ax.barh(y, seconds, color=colors, hatch=None)
    for yi, s, loss in zip(y, rec["seconds_to_target"], rec["final_val_loss"]):
        ax.text((s or 60) + 0.8, yi, (f"{s} s" if s else "not in 60 s") + f"  (final {loss})",
                va="center", fontsize=8.5)
    ax.set_yticks(y, rec["variants"])
    ax.set_xlim(0, 85)
    ax.set_xlabel("seconds to the all-reduce's final validation loss")
    ax.set_title("byte-level transformer, AdamW, 4 hosts at 500 Mbit/s", fontsize=10)
    _save(fig, "time_to_accuracy_lm.png")


def convergence() -> None:
    """Steps to the target over the half-batch bound's, per workload (N = 8, k = 4)."""
    rows = RECORDS["convergence"]["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = np.arange(len(rows))
    balanced = [r["balanced"] for r in rows]
    iid = [r["iid"] if r["iid"] is not None else 0 for r in rows]
    ax.bar(x - 0.2, balanced, 0.4, color=SKIP, label="Random, balanced (default): median")
    ax.bar(x + 0.2, iid, 0.4, color=GREY, label="Random, fresh draw each step: median")
    for xi, r in zip(x, rows):
        seeds = [s for s in r["seeds"] if s is not None]
        ax.scatter([xi - 0.2] * len(seeds), seeds, s=10, color="black", zorder=3)
        if r["iid"] is None:
            ax.text(xi + 0.2, 0.05, "never", rotation=90, ha="center", fontsize=8)
    ax.axhline(1.0, color=FULL, lw=1, label="half-batch all-reduce (the bound)")
    ax.set_xticks(x, [f"{r['workload']}\n{r['opt']}" for r in rows], fontsize=8.5)
    ax.set_ylabel("steps / bound's steps")
    ax.set_title("8 ranks, skip ratio 0.5; dots: each seed", fontsize=10)
    ax.legend(frameon=False, fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=3)
    _save(fig, "convergence.png")


def main() -> None:
    """Draws every figure."""
    OUT.mkdir(parents=True, exist_ok=True)
    for draw in (ring, schedule, bytes_sent, cluster, time_to_accuracy, loss_vs_time,
                 time_to_accuracy_lm, convergence):
        draw()


if __name__ == "__main__":
    main()
