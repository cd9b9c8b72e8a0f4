"""Time to accuracy on an emulated slow network, from a recorded run.

4 CPU hosts joined by an emulated 500 Mbit/s network (``make bench-tta``
records such runs; this one is in ``docs/_data/records.json``): the MLP
64-2048-2048-10, SGD with momentum, 60 s of training per variant from the
same start. A cheaper step turns into time saved, though each skipped step
teaches a little less.
"""

import json
import os
import pathlib

import matplotlib.pyplot as plt

records = pathlib.Path(__file__).resolve().parents[2] / "_data" / "records.json"
run = json.loads(records.read_text())["tta_curves"]
base = run["seconds_to_target_loss"]["all-reduce"]
fig, ax = plt.subplots(figsize=(5.2, 3.4))
for name in run["variants"]:
    curve = run["curves"][name]
    seconds = run["seconds_to_target_loss"][name]
    ax.plot(curve["seconds"], curve["loss"], lw=2, label=name)
    print(f"{name}: {run['ms_per_step'][name]} ms a step, the all-reduce's final loss "
          f"in {seconds:.1f} s ({base / seconds:.2f}x)")
ax.axhline(run["target_loss"], color="#BBBBBB", lw=1, ls="--")
ax.set_ylim(top=run["ylim_top"])
ax.set_xlabel("seconds of training")
ax.set_ylabel("test loss (mean of 3 evals)")
ax.set_title("4 CPU hosts, emulated 500 Mbit/s", fontsize=11)
ax.legend(frameon=False, fontsize=9)
fig.savefig(os.environ.get("GALLERY_FIGURE", "time_to_accuracy.png"), dpi=150,
            bbox_inches="tight")
