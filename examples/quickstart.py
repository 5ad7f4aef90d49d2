"""Grad-CAM on the shipped demo model: explain four synthetic images and save the overlays.

    python examples/quickstart.py [OUT_DIR]
"""

import sys
from pathlib import Path

from explain import GradCAM
from explain.data import CLASS_NAMES, load_demo_model, make_dataset

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
model = load_demo_model()
images = make_dataset(4, seed=7).images  # (4, 64, 64, 3) uint8 RGB

explanation = GradCAM(model, "layer4", class_names=CLASS_NAMES).explain(list(images))
for index in range(len(explanation)):
    print(explanation.title(index))
explanation.save(out / "quickstart.png")  # the four overlays side by side, at 64×64 each
explanation.save(out / "quickstart.pdf")  # the titled figure, vector
print(f"wrote {out / 'quickstart.png'} and {out / 'quickstart.pdf'}")
