"""Transformer attribution against the authors' code: explain.TransformerAttribution and
hila-chefer/Transformer-Explainability (``baselines/ViT/ViT_LRP.py``, ``method="transformer_attribution"``) on the
same random-weight timm ViTs, image by image.

    git clone https://github.com/hila-chefer/Transformer-Explainability /tmp/chefer   # outside this repository
    python benchmarks/chefer_reference.py --authors-code /tmp/chefer [--write]

Their code is imported from that folder (it needs ``einops``); nothing of it is part of this repository. Their ViT
is built with the timm model's sizes and loads its state dict (the parameter names are the same); their final
LayerNorm gets timm's ε. Their ``LRP.generate_LRP`` moves the one-hot vector to CUDA, so this script seeds
``relprop`` with the one-hot vector itself, as that function does. Prints, per model, each image's correlation and
the largest difference relative to the map's maximum; ``--write`` writes the section "Transformer attribution against
the authors' code" of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402


def realistic(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of a trained network's scale: N(0, 1/fan-in) matrices, norm weights in [0.5, 1.5], small biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "embed" not in name and "token" not in name:
                parameter.normal_(0, parameter[0].numel() ** -0.5, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:
                parameter.normal_(0, 0.1 if parameter.dim() < 2 else 0.5, generator=generator)
    return model


def authors_model(vit: torch.nn.Module, code: Path) -> torch.nn.Module:
    sys.path.insert(0, str(code))
    from baselines.ViT.ViT_LRP import VisionTransformer  # the authors' ViT, from their checkout

    block = vit.blocks[0]
    theirs = VisionTransformer(img_size=vit.patch_embed.img_size[0], patch_size=vit.patch_embed.patch_size[0],
                               embed_dim=vit.embed_dim, depth=len(vit.blocks), num_heads=block.attn.num_heads,
                               mlp_ratio=block.mlp.fc1.out_features / vit.embed_dim, qkv_bias=True,
                               num_classes=vit.head.out_features).to(torch.float64)  # before loading: no rounding
    missing, unexpected = theirs.load_state_dict(vit.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"the two ViTs differ: missing {missing}, unexpected {unexpected}")
    theirs.norm.eps = vit.norm.eps
    return theirs.eval()


def authors_maps(theirs: torch.nn.Module, images: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """(N, T − 1): their class-token row over the patches, one image at a time (their code takes one)."""
    maps = []
    for image, target in zip(images, targets):
        output = theirs(image[None])
        one_hot = torch.zeros_like(output)
        one_hot[0, target] = 1.0
        theirs.zero_grad()
        (one_hot * output).sum().backward(retain_graph=True)
        maps.append(theirs.relprop(one_hot, method="transformer_attribution", start_layer=0, alpha=1)[0].detach())
    return torch.stack(maps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-code", type=Path, required=True, help="a checkout of Transformer-Explainability")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    arguments = parser.parse_args()
    import timm

    rows = []
    for depth in (3, 5):
        for weights in ("timm's initialisation", "trained scale"):
            torch.manual_seed(depth)
            vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=depth,
                                    num_classes=10).double().eval()
            if weights == "trained scale":
                realistic(vit, depth)
            images = torch.randn(arguments.images, 3, 64, 64, dtype=torch.float64)
            targets = [i % 10 for i in range(arguments.images)]
            theirs = authors_maps(authors_model(vit, arguments.authors_code), images, targets)
            ours = explain.TransformerAttribution(vit).explain(images, target=targets).low_res_maps[0][:, 0]
            ours = ours.flatten(1).double()
            correlations = [torch.corrcoef(torch.stack([theirs[i], ours[i]]))[0, 1].item()
                            for i in range(len(images))]
            difference = max(((theirs[i] - ours[i]).abs().max() / theirs[i].abs().max()).item()
                             for i in range(len(images)))
            rows.append(f"| {depth} | {weights} | {len(images)} | {min(correlations):.6f} | "
                        f"{sum(correlations) / len(correlations):.6f} | {difference:.1e} |")
            print(rows[-1], flush=True)
    table = "\n".join(["| blocks | weights | images | lowest correlation | mean correlation | largest difference "
                       "(of the map's max) |", "| ---: | --- | ---: | ---: | ---: | ---: |", *rows])
    text = ("`python benchmarks/chefer_reference.py --authors-code DIR`: timm "
            "`vit_tiny_patch16_224` at 64 px (16 patches, embedding 192, 3 heads) with random weights, float64, one "
            "class per image, their code run on the same weights, image by image.\n\n" + table + "\n\n"
            "The maps are the same. The remaining differences come from their ε of 10⁻⁹ added where the relevance is "
            "divided by a value it passes unchanged (their `IndexSelect` and `Clone` rules divide and multiply by the "
            "same activation), which these rules do not do: with those two rules made exact in a copy of their code, "
            "the largest difference is 1e-15.")
    if arguments.write:
        write_section("Transformer attribution against the authors' code", text)


if __name__ == "__main__":
    main()
