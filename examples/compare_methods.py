"""A comparison grid of every method on the demo model's images (images in rows, methods in columns).

    python examples/compare_methods.py [OUT_DIR] [--pdf]   # writes OUT_DIR/compare.png (and compare.pdf)
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import explain  # noqa: E402
from explain.data import CLASS_NAMES, load_demo_model, make_dataset  # noqa: E402

arguments = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
out = Path(arguments[0] if arguments else "docs")
out.mkdir(parents=True, exist_ok=True)
model = load_demo_model()
images = list(make_dataset(4, seed=21).images)
methods = ("gradcam", "gradcam++", "hirescam", "layercam", "eigencam", "scorecam", "ablationcam", "saliency",
           "inputxgradient", "integratedgradients", "smoothgrad", "guidedbackprop", "guidedgradcam")
fig, _ = explain.compare(model, images, methods=methods, layer="layer4",
                         method_options={"class_names": CLASS_NAMES}, colorbar=True, panel_size=1.5, fontsize=6.5)
fig.savefig(out / "compare.png", dpi=80)
if "--pdf" in sys.argv:
    fig.savefig(out / "compare.pdf")  # vector, one embedded image per panel
print(f"wrote {out / 'compare.png'}")
