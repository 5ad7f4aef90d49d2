"""The concept atlas (relevance maximisation over a data set, stored): its references are the images where each
concept carried the most relevance (and was most active) computed image by image; a kill -9 and a rerun give the
atlas an uninterrupted run gives; shards merge to the same; other settings are refused; the page opens offline in
headless Chromium with every reference image loading; the command line builds it and reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ResidualNet, offline_page

import explain
from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder
from explain.dataset_tools.concept_atlas import build_atlas, load_atlas

COUNT, BATCH, TOP = 16, 8, 2


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory) -> Path:
    return write_watermark_folder(tmp_path_factory.mktemp("atlas-data") / "images", count=COUNT)


@pytest.fixture(scope="module")
def built(data_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas") / "atlas"
    return build_atlas(load_watermark_demo(), "layer3", data_folder, out, top=TOP, batch_size=BATCH, progress=False)


def test_the_references_are_the_images_where_each_concept_mattered_most_image_by_image(built, data_folder):
    model = load_watermark_demo()
    files = sorted(path for path in data_folder.rglob("*.png"))
    seen = {}  # the relevance LRP passes to layer3's output, read with a tensor hook, summed per channel

    def on_output(module, args, output):
        output.register_hook(lambda relevance: seen.update(r=relevance.detach().double().sum(dim=(2, 3))))

    handle = model.layer3.register_forward_hook(on_output)
    try:
        explanation = explain.LRP(model).explain([str(path) for path in files])
    finally:
        handle.remove()
    relevance_table, classes = seen["r"], explanation.class_indices[:, 0].tolist()
    store = {}
    handle = model.layer3.register_forward_hook(lambda module, args, output: store.update(a=output))
    try:
        with torch.no_grad():
            model(explain.io.inputs.prepare_inputs([str(path) for path in files], explain.Normalize(),
                                                   torch.device("cpu"), torch.float32).batch)
    finally:
        handle.remove()
    largest = store["a"].flatten(2).amax(2)
    names = [str(path.relative_to(data_folder)) for path in files]
    for concept in (0, 21, 63):
        references = built.references(concept)
        expected = relevance_table[:, concept].topk(TOP)
        assert [reference["image"] for reference in references] == [names[i] for i in expected.indices]
        assert [reference["value"] for reference in references] == pytest.approx(expected.values.tolist(), rel=1e-4)
        activation = built.references(concept, "activation")
        assert [reference["image"] for reference in activation] == [names[i] for i in
                                                                     largest[:, concept].topk(TOP).indices]
        assert all(patch.dtype.name == "uint8" and patch.shape[-1] == 3 for patch in built.patches(concept))
        entry = next(item for item in built.entries["concepts"] if item["concept"] == concept)
        by_class = {label: float(relevance_table[[c == label for c in classes], concept].mean())
                    for label in set(classes)}
        best = max(by_class, key=by_class.get)
        assert entry["classes"][0]["class"] == best
        assert entry["classes"][0]["mean_relevance"] == pytest.approx(by_class[best], rel=1e-4)


def test_shards_merge_to_the_atlas_of_one_run_and_other_settings_are_refused(built, data_folder, tmp_path):
    model = load_watermark_demo()
    out = tmp_path / "sharded"
    for shard in ((0, 2), (1, 2)):
        assert build_atlas(model, "layer3", data_folder, out, top=TOP, batch_size=BATCH, shard=shard,
                           progress=False) is None
    merged = build_atlas(model, "layer3", data_folder, out, top=TOP, batch_size=BATCH, progress=False)
    assert merged.entries == built.entries
    with pytest.raises(ValueError, match="top: 2 earlier, 3 now"):
        build_atlas(model, "layer3", data_folder, out, top=3, batch_size=BATCH, progress=False)
    with pytest.raises(ValueError, match="options: None earlier, .*epsilon_plus"):  # another composite
        build_atlas(model, "layer3", data_folder, out, top=TOP, batch_size=BATCH, progress=False,
                    composite="epsilon_plus")
    with pytest.raises(ValueError, match=r"options: None earlier, .*tensor\(2, 64\)"):  # concepts as directions
        build_atlas(model, "layer3", data_folder, out, top=TOP, batch_size=BATCH, progress=False,
                    directions=torch.eye(64)[:2])
    with torch.no_grad():
        model.fc.weight.mul_(2)
    with pytest.raises(ValueError, match="model:"):
        build_atlas(model, "layer3", data_folder, out, top=TOP, batch_size=BATCH, progress=False)


BUILD = """
import sys
from explain.data.demo_watermark import load_watermark_demo
from explain.dataset_tools.concept_atlas import build_atlas
build_atlas(load_watermark_demo(), "layer3", sys.argv[1], sys.argv[2], top={top}, batch_size=1, progress=False)
"""


def test_a_run_killed_with_sigkill_resumes_to_the_atlas_of_an_uninterrupted_run(built, data_folder, tmp_path):
    """One image per batch (24 batch files): the process is killed once some are written; a rerun computes the
    rest and the atlas equals an uninterrupted run's (the references do not depend on the batch size)."""
    out = tmp_path / "killed"
    script = tmp_path / "build.py"
    script.write_text(BUILD.format(top=TOP))
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(script), str(data_folder), str(out)], env=environment)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((out / "batches").glob("*.pt"))) < 3 and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = len(list((out / "batches").glob("*.pt")))
    assert 3 <= written < COUNT, written
    assert not (out / "atlas.json").exists()
    record = json.loads((out / "atlas-record.json").read_text())
    assert record["batch_size"] == 1
    resumed = subprocess.run([sys.executable, str(script), str(data_folder), str(out)], env=environment,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    atlas = load_atlas(out)
    for entry, expected in zip(atlas.entries["concepts"], built.entries["concepts"]):
        assert [r["image"] for r in entry["relevance_references"]] == [
            r["image"] for r in expected["relevance_references"]]
        assert [r["value"] for r in entry["relevance_references"]] == pytest.approx(
            [r["value"] for r in expected["relevance_references"]], rel=1e-4)
    assert not list(out.rglob(".*.part"))


def test_the_page_opens_offline_with_every_reference_image_loading(built, chromium):
    context, page, blocked, errors = offline_page(chromium, console_errors=False)
    try:
        page.goto((built.folder / "atlas.html").resolve().as_uri())
        page.wait_for_function("[...document.images].every(image => image.complete)")
        sizes = page.eval_on_selector_all("img", "images => images.map(image => image.naturalWidth)")
        cards = page.eval_on_selector_all(".card", "cards => cards.length")
    finally:
        context.close()
    assert cards == 64 and len(sizes) == 64 * 2 * TOP
    assert all(width > 0 for width in sizes)
    assert not blocked and not errors


def test_the_command_line_builds_the_atlas_and_the_glocal_figure_reads_it(data_folder, tmp_path, capsys):
    from explain.cli import main

    out = tmp_path / "cli-atlas"
    assert main(["concepts", str(data_folder), "--model", "demo-watermark", "--layer", "layer3", "--out", str(out),
                 "--top", "2", "--batch-size", "12"]) == 0
    assert f"64 concepts over {COUNT} images" in capsys.readouterr().out
    image = sorted(data_folder.rglob("*.png"))[0]
    assert main(["concepts", str(image), "--model", "demo-watermark", "--layer", "layer3", "--references", str(out),
                 "--top", "2", "--out", str(tmp_path / "glocal.png")]) == 0
    assert (tmp_path / "glocal.png").stat().st_size > 0
    assert main(["concepts", str(image), "--model", "demo-watermark", "--layer", "layer4", "--references",
                 str(out)]) == 2
    assert "is of layer layer3" in capsys.readouterr().err
    assert main(["concepts", str(data_folder), "--model", "demo-watermark", "--layer", "layer3", "--out", str(out),
                 "--shard", "2"]) == 2


def test_an_atlas_of_a_vits_token_directions_is_built_with_activation_values_on_its_patch_tokens(data_folder,
                                                                                                  tmp_path):
    """A ViT block's tokens with directions as concepts (AttnLRP): the atlas is built (it failed at the activation
    patches), each concept's activation references are the images with the largest u_k · token over the patch
    tokens (the class token does not lie on the image), by hand."""
    timm = pytest.importorskip("timm")
    from explain.io.inputs import as_preprocess, prepare_inputs

    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=64, patch_size=16, embed_dim=16, depth=2,
                                                             num_heads=2, num_classes=4).eval()
    basis = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                            ).Q.T[:3].contiguous()
    atlas = build_atlas(model, "blocks.1", data_folder, tmp_path / "vit", method="attnlrp", top=TOP,
                        batch_size=BATCH, progress=False, directions=basis)
    files = sorted(data_folder.rglob("*.png"))
    batch = prepare_inputs(files, as_preprocess(None), torch.device("cpu"), torch.float32).batch
    seen = {}
    handle = model.blocks[1].register_forward_hook(lambda _m, _a, output: seen.update(out=output.detach()))
    with torch.no_grad():
        model(batch)
    handle.remove()
    largest = (seen["out"][:, 1:].double() @ basis.T).amax(dim=1)  # (images, 3): over the 16 patch tokens
    for concept in range(3):
        references = atlas.references(concept, "activation")
        expected = largest[:, concept].topk(TOP)
        assert [reference["image"] for reference in references] == [
            files[int(index)].relative_to(data_folder).as_posix() for index in expected.indices]
        assert [reference["value"] for reference in references] == pytest.approx(expected.values.tolist(), rel=1e-5)
        assert len(atlas.patches(concept, "activation")) == TOP and len(atlas.patches(concept)) == TOP


def test_an_atlas_of_a_layer_inside_a_residual_branch_says_its_patches_include_the_relevance_around_it(data_folder,
                                                                                                     tmp_path):
    """Relevance that reaches the input around the layer (a skip connection) is in every conditional heatmap, so in
    the relevance references' patches: the build says so (conftest's ResidualNet, its branch's
    first convolution), and says nothing for the block's output."""
    import warnings

    from explain.methods.concepts import concept_references

    model = ResidualNet().eval()
    crp = explain.ConceptRelevance(model, "branch.0", composite="epsilon_plus")
    with pytest.warns(RuntimeWarning, match="branch.0 does not carry all the relevance.*references' patches") as seen:
        concept_references(crp, list(torch.rand(3, 3, 16, 16)), concepts=[0], top=1)
    assert [warning.filename for warning in seen] == [__file__]  # the caller's line
    with pytest.warns(RuntimeWarning, match="branch.0 does not carry all the relevance.*references' patches") as seen:
        build_atlas(model, "branch.0", data_folder, tmp_path / "branch", top=TOP, batch_size=BATCH, progress=False,
                    composite="epsilon_plus")
    assert [warning.filename for warning in seen] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        build_atlas(model, "merge", data_folder, tmp_path / "merge", top=TOP, batch_size=BATCH, progress=False,
                    composite="epsilon_plus")
