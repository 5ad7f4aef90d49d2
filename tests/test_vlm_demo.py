"""The shipped vision-language demo: it loads offline, answers held-out scenes right, its maps point at the shape
(where its vision encoder keeps the colour), and the command line runs on it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from explain import GenerationExplainer
from explain.cli import main
from explain.data.demo_vlm import QUESTIONS, held_out_scenes, load_vlm_demo, local_vision_parameters, make_scene

_QUALITY = Path(__file__).resolve().parents[1] / "benchmarks" / "vlm_quality.py"
_spec = importlib.util.spec_from_file_location("vlm_quality_benchmark", _QUALITY)
assert _spec is not None and _spec.loader is not None
vlm_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vlm_quality)  # benchmarks/ stays off sys.path
shape_cells = vlm_quality.shape_cells


def test_the_demo_answers_and_its_attnlrp_maps_point_at_the_shape() -> None:
    model, processor = load_vlm_demo()
    assert all(float(parameter.abs().max()) == 0.0 for parameter in local_vision_parameters(model))
    explainer = GenerationExplainer(model, processor, method="attnlrp")
    scenes = held_out_scenes(20)
    hits = 0
    for scene in scenes:
        explanation = explainer.explain(scene.image, QUESTIONS["color"], max_new_tokens=2)
        assert explanation.class_names == [scene.color]
        assert explanation.diagnostics["answer"] == [scene.color]
        values = explanation.raw_maps[0, 0].cpu().numpy()
        hits += bool(shape_cells(scene).flat[int(values.argmax())])
    assert hits >= 15, hits  # measured 17 of these 20; 179 of 200 in benchmarks/vlm_quality.py


def test_explain_vlm_on_the_demo_writes_the_figure_and_the_page(tmp_path, capsys) -> None:
    scene = make_scene(np.random.default_rng(1))
    image = tmp_path / "scene.png"
    scene.image.save(image)
    out = tmp_path / "out"
    assert main(["vlm", str(image), "--model", "demo-vlm", "--prompt", QUESTIONS["color"], "--out", str(out),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"answer: {scene.color}" in printed
    assert (out / "tokens.png").is_file()
    page = (out / "tokens.html").read_text(encoding="utf-8")
    assert scene.color in page
