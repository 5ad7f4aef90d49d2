"""Sanity check (Adebayo et al. 2018) on the demo model: how much each method's maps change as the
model's layers are randomised, top layer first. A method that explains the model changes a lot.

    python examples/sanity_check.py [OUT_DIR]         # writes OUT_DIR/sanity.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import explain  # noqa: E402
from explain import metrics  # noqa: E402
from explain.data import load_demo_model, make_dataset  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
out.mkdir(parents=True, exist_ok=True)
model = load_demo_model()
data = make_dataset(8, seed=5)
fig, axis = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
for name in ("gradcam", "scorecam", "saliency", "integratedgradients", "guidedbackprop"):
    cls = explain.get_method(name)
    options = {"scorecam": {"progress": False}, "integratedgradients": {"steps": 16}}.get(name, {})
    explainer = cls(model, "layer4", **options) if cls.needs_layer else cls(model, **options)
    stages = metrics.cascading_randomization(explainer, list(data.images), data.labels.tolist())
    axis.plot([stage.layer for stage in stages], [stage.rank_correlation.mean().item() for stage in stages],
              marker="o", label=explainer.method_name)
axis.axhline(0, color="gray", linewidth=0.5)
axis.set_xlabel("randomised down to (cascading, top layer first)")
axis.set_ylabel("rank correlation with trained maps")
axis.set_title("Sanity check: maps should change when the model does")
axis.legend(fontsize=8)
fig.savefig(out / "sanity.png", dpi=100)
print(f"wrote {out / 'sanity.png'}")
