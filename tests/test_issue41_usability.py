"""Issue 41, points 4, 5, 7, 8, 9, 10 and 11, through the command line where they are about it: a transformer
given an input its patches do not tile is told so (no silent Grad-CAM before its blocks); offline, pretrained
weights fail at once with the clear error; a bad image among several is reported and the others explained; the
demo VLM's one question, its colour bar and unknown words; no tqdm notebook warning on import; every command and
option in --help; under torchrun one progress bar and one report of the whole run."""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import explain
from explain.cli import main
from explain.data import make_dataset

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = Path(explain.__file__).resolve().parent.parent
"""Where the explain under test lies (the repository, or another copy first on PYTHONPATH): subprocesses get it."""


def image_file(folder: Path, name: str, size: tuple[int, int] = (64, 64), seed: int = 0) -> Path:
    path = folder / name
    Image.fromarray(make_dataset(1, seed=seed).images[0]).resize(size).save(path)
    return path


# ---------------------------------------------------------------- 4: a transformer's input of the wrong size


def test_a_vit_given_an_image_its_patches_do_not_tile_is_told_not_explained_before_its_blocks(tmp_path, capsys):
    odd = image_file(tmp_path, "odd.png", (100, 70))
    assert main([str(odd), "--model", "demo-vit", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "cannot lay the 109 tokens of layer 'blocks.3.norm1' out on a patch grid for a 70×100 input" in error
    assert "no layer of its blocks can be drawn on this input, so none is chosen" in error
    assert "--size S or H W" in error and "name a layer (--layer, layer=)" in error
    assert not list((tmp_path / "out").glob("*.png"))  # no map at the stem written

    # the same size that tiles is explained at the last block's norm; another size that does not, by the API
    assert main([str(image_file(tmp_path, "tiles.png", (72, 56))), "--model", "demo-vit", "--out",
                 str(tmp_path / "out")]) == 0
    assert "GradCAM @ blocks.3.norm1" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"for a 90×60 input.*none is chosen"):
        explain.GradCAM(explain.load_model("demo-vit")).explain(Image.open(image_file(tmp_path, "b.png", (60, 90))))


# ---------------------------------------------------------------- 5: offline, pretrained weights fail fast


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No network, as on a machine without one: every connection fails at once; the hub client's cache is empty and
    its back-off sleeps are recorded (not slept). Yields the connections tried and the sleeps asked for."""
    import huggingface_hub.utils._http as hub_http
    from huggingface_hub import constants

    tried: list[object] = []
    slept: list[float] = []

    def unreachable(*args, **kwargs):
        tried.append(args[1:] if args else kwargs)
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(hub_http.time, "sleep", slept.append)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the user did not say they are offline
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf-home"))
    return tried, slept


def test_offline_pretrained_timm_weights_fail_at_once_with_the_clear_error(no_network, tmp_path, capsys):
    tried, slept = no_network
    image = image_file(tmp_path, "a.png")
    assert main([str(image), "--model", "timm:resnet18", "--weights", "pretrained", "--out",
                 str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "could not download timm's pretrained weights for resnet18 (the HuggingFace hub did not answer" in error
    assert "--weights /path/to/model.safetensors" in error
    assert slept == []  # no retries with back-off (HEAD: 10 sleeps, 46 s)
    assert len(tried) == 1  # one probe of the hub, no download tried


def test_offline_a_hub_id_fails_at_once_too(no_network):
    tried, slept = no_network
    with pytest.raises(explain.models.WeightsUnavailableError):
        explain.load_model("hf:google/vit-base-patch16-224")
    assert slept == [] and len(tried) == 1


# ---------------------------------------------------------------- 7: the other images are explained


def test_a_bad_image_among_several_is_reported_and_the_others_are_explained(tmp_path, capsys):
    good = [image_file(tmp_path, f"good{index}.png", seed=index) for index in range(2)]
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    missing = tmp_path / "missing.png"
    out = tmp_path / "out"
    assert main([str(broken), str(good[0]), str(missing), str(good[1]), "--model", "demo", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert sorted(path.name for path in out.glob("*.png")) == ["good0_gradcam_demo.png", "good1_gradcam_demo.png"]
    assert [line.split(":")[0] for line in captured.out.splitlines()] == [str(good[0]), str(good[1])]
    errors = captured.err.splitlines()
    assert str(broken) in errors[0] and str(missing) in errors[1]
    assert errors[-1] == (f"explain: error: 2 of 4 image(s) could not be explained (the reasons above); the other 2 "
                          f"were written to {out}.")


# ---------------------------------------------------------------- 8: the demo VLM


@pytest.fixture(scope="module")
def scene_file(tmp_path_factory) -> tuple[Path, object]:
    from explain.data.demo_vlm import make_scene

    scene = make_scene(np.random.default_rng(1))
    path = tmp_path_factory.mktemp("scene") / "scene.png"
    scene.image.save(path)
    return path, scene


def test_the_demo_vlm_is_said_to_answer_one_question_with_a_colour(scene_file, tmp_path, capsys):
    path, scene = scene_file
    with pytest.raises(SystemExit):
        main(["vlm", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "colour or" not in shown and "or shape" not in shown
    assert "trained on one question about explain.data.demo_vlm's scenes, 'what color is it ?'" in shown
    for page in ("vlm.md", "command-line.md"):
        assert "colour or the shape" not in " ".join((ROOT / "docs" / page).read_text(encoding="utf-8").split())

    assert main(["vlm", str(path), "--model", "demo-vlm", "--prompt", "what shape is it ?", "--device", "cpu",
                 "--out", str(tmp_path / "shape")]) == 0
    captured = capsys.readouterr()
    assert ("demo-vlm was trained on one question, 'what color is it ?' (the shape's colour); it answers "
            "'what shape is it ?' with a colour too") in captured.err
    assert f"answer: {scene.color}" in captured.out  # a colour, as the warning says


def test_a_given_answer_with_words_the_model_does_not_know_is_refused_naming_them(scene_file, tmp_path, capsys):
    path, _ = scene_file
    out = tmp_path / "out"
    assert main(["vlm", str(path), "--model", "demo-vlm", "--prompt", "what color is it ?", "--device", "cpu",
                 "--answer", "the circle is red", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "the answer 'the circle is red' has 1 word(s) the model's tokenizer does not know, 'the'" in error
    assert "(its words: user assistant : ? what color shape is it square circle red green blue yellow)" in error
    assert not (out / "tokens.png").exists()


def test_a_prompt_with_unknown_words_warns_at_the_callers_line(scene_file):
    from explain.data.demo_vlm import load_vlm_demo
    from explain.vlm import GenerationExplainer

    path, _ = scene_file
    explainer = GenerationExplainer(*load_vlm_demo())
    with pytest.warns(UserWarning, match=r"'which'.* the model reads '<unk>' in their place") as caught:
        explainer.explain(Image.open(path), "which color is it ?", max_new_tokens=1)
    assert [warning.filename for warning in caught if "which" in str(warning.message)] == [__file__]


def test_tokens_png_has_a_colour_bar_for_the_signed_maps(scene_file, tmp_path, monkeypatch):
    from explain.vlm import view

    drawn = []
    token_figure = view.token_figure

    def recorded(*args, **kwargs):
        drawn.append(token_figure(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(view, "token_figure", recorded)
    path, _ = scene_file
    assert main(["vlm", str(path), "--model", "demo-vlm", "--prompt", "what color is it ?", "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 0
    (figure,) = drawn
    assert len(figure.axes) == 2  # the panels' and the colour bar's
    bar = figure.axes[1]
    assert bar.get_ylim() == (-1.0, 1.0)  # input × gradient is signed: from -1 (against) to 1 (for)
    assert "red: for the token, blue: against" in bar.get_ylabel()
    panels_only = token_figure(explain_vlm_explanation(path), colorbar=False)
    assert len(panels_only.axes) == 1
    unsigned = token_figure(explain_vlm_explanation(path, method="attention"), colorbar=True)
    assert unsigned.axes[1].get_ylim() == (0.0, 1.0) and unsigned.axes[1].get_ylabel() == "relevance / largest value"


def explain_vlm_explanation(path: Path, method: str = "input_x_gradient"):
    from explain.data.demo_vlm import load_vlm_demo
    from explain.vlm import GenerationExplainer

    return GenerationExplainer(*load_vlm_demo(), method=method).explain(Image.open(path), "what color is it ?",
                                                                      max_new_tokens=1)


# ---------------------------------------------------------------- 9: import in a notebook without ipywidgets


def test_importing_explain_in_a_notebook_without_ipywidgets_prints_no_warning(tmp_path):
    """A Jupyter kernel as tqdm.auto detects one (ipykernel's shell loaded), ipywidgets missing: tqdm warns
    "IProgress not found" on import; `import explain` must not pass that on, and the bars still work."""
    script = textwrap.dedent("""
        import sys, types, warnings
        class ZMQInteractiveShell:
            config = {"IPKernelApp": {}}
        ipython = types.ModuleType("IPython")
        ipython.get_ipython = ZMQInteractiveShell
        sys.modules.update({"IPython": ipython, "ipykernel.zmqshell": types.ModuleType("ipykernel.zmqshell"),
                            "ipywidgets": None})
        warnings.simplefilter("always")
        import explain
        from explain.dataset_tools.evaluation import tqdm
        for _ in tqdm(range(3), desc="bar"):
            pass
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import tqdm.autonotebook  # the module the notebook warning comes from: already imported, quietly
        print("warnings after import:", len(caught))
    """)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=environment, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "IProgress" not in result.stderr, result.stderr[-2000:]
    assert "bar: 100%" in result.stderr and "warnings after import: 0" in result.stdout


# ---------------------------------------------------------------- 10: --help


def help_text(command: list[str]) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main([*command, "--help"])
    return printed.getvalue()


def options_without_help(text: str) -> list[str]:
    """The options of an argparse --help text whose entry has no description (neither beside it nor under it)."""
    lines = text.splitlines()
    missing = []
    for number, line in enumerate(lines):
        entry = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if entry is None or entry.group(2):
            continue
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if not (re.match(r"^\s{4,}\S", following) and not following.strip().startswith("-")):
            missing.append(entry.group(1))
    return missing


def test_help_lists_every_command_and_model_and_every_option_says_what_it_does():
    main_help = " ".join(help_text([]).split())
    for command in ("explain demo", "explain methods", "explain layers", "explain batch", "explain strategies",
                    "explain report", "explain evaluate", "explain vlm"):
        assert f"`{command}" in main_help, command
    for model in ("demo-vit2", "demo-watermark", "demo-vlm"):
        assert model in main_help, model
    assert re.search(r"--device DEVICE cpu, cuda, cuda:N or mps", main_help)
    batch_help = " ".join(help_text(["batch"]).split())
    assert re.search(r"--batch-size BATCH_SIZE images explained together", batch_help)
    assert re.search(r"--no-progress no progress bar", batch_help)
    for command in ([], ["batch"], ["evaluate"], ["strategies"], ["report"], ["demo"], ["methods"], ["layers"],
                    ["vlm"]):
        assert options_without_help(help_text(command)) == [], command


# ---------------------------------------------------------------- 11: torchrun


def test_under_torchrun_one_bar_and_one_report_of_the_whole_run(tmp_path):
    """13 images on 2 processes: rank 0 explains 7, rank 1 6. One progress bar (rank 0's, 7 images), one line
    that counts the whole run."""
    folder = tmp_path / "images"
    for index in range(13):
        (folder / str(index % 2)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(make_dataset(1, seed=index).images[0]).save(folder / str(index % 2) / f"{index}.png")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29541",
               "-m", "explain", "batch", str(folder), "--model", "demo", "--out", str(out), "--batch-size", "4"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE_ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=environment, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if "image(s) explained" in line]
    assert len(reports) == 1, result.stdout
    assert reports[0].startswith("13 image(s) explained by 2 processes (7 by rank 0)"), reports[0]
    assert "/7 " in result.stderr  # rank 0's bar, over its 7 images
    assert "/6 " not in result.stderr  # rank 1 draws none
    with open(out / "index.csv", encoding="utf-8") as index:
        assert len(index.read().splitlines()) == 1 + 13
