"""Grad-CAM on a vision transformer (any input size, layer chosen automatically) and on a
segmentation model with a segmentation target. Random weights: the code is what matters here;
with pretrained weights (torchvision's ``weights=``) the same lines give meaningful maps.

    python examples/vit_and_segmentation.py [OUT_DIR]  # writes OUT_DIR/vit_segmentation.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402
import torchvision  # noqa: E402

import explain  # noqa: E402
from explain.data import make_dataset  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
images = list(make_dataset(2, seed=3).images)  # 64 × 64 RGB

vit = torchvision.models.VisionTransformer(image_size=64, patch_size=8, num_layers=4, num_heads=4, hidden_dim=64,
                                           mlp_dim=128, num_classes=4).eval()
torch.nn.init.normal_(vit.heads.head.weight, std=0.2)  # torchvision starts the head at zero
vit_maps = explain.GradCAM(vit).explain(images)  # layer: the last block's first norm
print("ViT layer:", vit_maps.layer)

segmenter = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
    weights=None, weights_backbone=None, num_classes=4, aux_loss=False).eval()
mask = torch.zeros(64, 64, dtype=torch.bool)
mask[16:48, 16:48] = True  # explain the class-1 logits inside this square
segmentation_target = explain.SegmentationTarget(1, mask)
segmentation_maps = explain.GradCAM(segmenter, "backbone.16").explain(images, target=segmentation_target)

fig = explain.figure([vit_maps, segmentation_maps], panel_size=2.0)
fig.savefig(out / "vit_segmentation.png", dpi=100)
print(f"wrote {out / 'vit_segmentation.png'}")
