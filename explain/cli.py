"""The ``explain`` command.

    explain demo [--model demo-vit|demo-vit2]      # no network, no arguments: writes explain-demo.png
    explain IMAGE... --model MODEL [--weights PATH|NAME] [--method gradcam] [--layer layer4]
                     [--target CLASS | --topk K] [--option KEY=VALUE ...] [--out DIR]
    explain methods [--verbose] [NAME]             # every method with one line each, or its options
    explain layers MODEL [--input-size 3 224 224]  # layer names with output shapes
    explain batch DIR --model MODEL --out OUT [--overlays]   # a whole folder, resumable;
                  [--labels folders|FILE.csv] [--target label|predicted|both]
                                                   # under torchrun, sharded across processes
    explain strategies OUT                         # SpRAy: each class's maps clustered, odd clusters flagged
    explain report OUT                             # a static HTML page of a batch run (opens offline)
    explain demo --debugging                       # all three on a model with a watermark shortcut
    explain evaluate --model M --methods A B ... --out OUT [--metrics ...] [--data demo|DIR]
                                                   # a method × metric table over a data set, resumable
    explain vlm IMAGE --model hf:DIR --prompt TEXT [--answer TEXT] [--method input_x_gradient|attention|attnlrp]
                [--max-new-tokens N] [--out DIR]  # a vision-language model's answer: a map per answer token,
                                                   # OUT/tokens.png and OUT/tokens.html (hover a token)

MODEL: demo, demo-vit, demo-vit2, a torchvision name (resnet50), timm:NAME, hf:ID_OR_DIRECTORY, or a file
holding a whole model (with --allow-pickle); see ``explain.models``. A torchvision or timm
architecture needs --weights (DEFAULT, pretrained, a file, or random): without, its weights would
be random and its maps meaningless.

Each image's overlays go to ``OUT/<image>_<method>_<model>[_<weights>][_<layer>][_<target>]
[_<options>][_<digest>].png``, so that runs with other settings never share a file; the PNG records
the settings that made it, and a file there from other settings is kept (the new one is numbered).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import hashlib
import inspect
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

import torch

from .core.capture import LayerNotRunError, ModelInputError
from .core.layers import format_layers, list_layers
from .core.targets import SegmentationTarget, Target, class_index
from .dataset_tools.batch import merge_shard_indexes, run
from .dataset_tools.pipeline import default_workers
from .dataset_tools.run_folder import Shard, one_line, write_atomically
from .detection.instances import InstanceSpec
from .io.explanation import Explanation
from .io.inputs import open_image
from .io.loaded_model import LoadedModel
from .methods import REGISTRY, Explainer, get_method
from .methods.signatures import parameter_docs
from .models import WeightsUnavailableError, load_model, names_an_architecture, weights_choices

DEMO_SEED = 2024


class Parser(argparse.ArgumentParser):
    """argparse with the command's error format: one ``explain: error:`` line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"explain: error: {message} (`{self.prog} --help` lists the options)\n")


SET_BY_THE_COMMAND = ("model", "layer", "preprocess", "class_names", "output", "explainer")
"""Constructor parameters that the command line sets from its own flags, not from --option."""


def method_options(cls: type[Explainer]) -> dict[str, inspect.Parameter]:
    """The options of a method that --option can set: its keyword parameters, by name."""
    return {name: parameter for name, parameter in inspect.signature(cls).parameters.items()
            if name not in SET_BY_THE_COMMAND and parameter.kind is not inspect.Parameter.VAR_KEYWORD}


def parse_option(text: str, cls: type[Explainer]) -> tuple[str, Any]:
    """--option KEY=VALUE for a method: VALUE read as a Python literal (64, 0.5, (7, 7), None, True;
    a bare word such as blur is a string), checked against the option's default."""
    key, separator, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    options = method_options(cls)
    if not separator:
        raise ValueError(f"--option {text!r}: write KEY=VALUE, e.g. --option steps=64.")
    if key not in options:
        close = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"{cls.name} has no option {key!r}.{hint} Its options: {', '.join(options) or 'none'} "
                         f"(`explain methods {cls.name}` describes them).")
    raw = raw.strip()
    words = {"none": None, "true": True, "false": False}
    try:
        value = words[raw.lower()] if raw.lower() in words else ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word: a string
    default = options[key].default
    expected = type(default) if default is not inspect.Parameter.empty and default is not None else None
    fits = (expected is None or isinstance(value, expected) or value is None
            or (expected is float and isinstance(value, int) and not isinstance(value, bool)))
    if expected is bool and not isinstance(value, bool) and value is not None:
        fits = False
    if expected is int and isinstance(value, bool):
        fits = False
    if not fits:
        raise ValueError(f"--option {key}={raw}: {key} takes {expected.__name__ if expected else 'a value'} "
                         f"values (default {default!r}).")
    return key, value


def make_explainer(method: str, loaded: LoadedModel, layer: Optional[str] = None,
                   options: Sequence[str] = ()) -> Explainer:
    """Build a registered method for a loaded model: its preprocessing, class names and output
    selector, the layer (the model's default layer, or chosen on the first call), and the
    ``--option KEY=VALUE`` settings."""
    cls = get_method(method)
    if layer is not None and not cls.needs_layer:
        raise ValueError(f"{cls.name} takes no layer: leave out --layer (it explains at the input), or choose a "
                         "method that explains a layer, e.g. --method gradcam.")
    settings = dict(parse_option(text, cls) for text in options)
    common: dict[str, Any] = dict(preprocess=loaded.preprocess, class_names=loaded.class_names, **settings)
    if loaded.output is not None:
        common["output"] = loaded.output
    make: Callable[..., Explainer] = cls  # constructors differ: CAM methods take the layer after the model
    if cls.needs_layer:  # layer None: the method picks one on its first call
        return make(loaded.model, layer if layer is not None else loaded.default_layer, **common)
    return make(loaded.model, **common)


def parse_device(text: str) -> torch.device:
    """--device: "cpu", "cuda", "cuda:1", "mps", ...; an error that says what is available otherwise."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: no CUDA GPU is available on this machine; use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available on this machine; use --device cpu.")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {text}: explain runs on cpu, cuda or mps.")
    return device


def check_colormap(name: str) -> str:
    """--cmap: a matplotlib colour map name, or an error listing close names."""
    import matplotlib

    if name not in matplotlib.colormaps:
        close = difflib.get_close_matches(name, list(matplotlib.colormaps), n=4, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else " Try jet, viridis, cividis, inferno or turbo."
        raise ValueError(f"--cmap {name!r} is not a matplotlib colour map.{hint}")
    return name


def check_output_folder(path: str) -> Path:
    """--out: a folder (created when missing); an error when a file is in the way."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {path!r} is a file; give a folder (it is created if missing).")
    return out


def user_path(text: str) -> str:
    """A path argument with a leading ``~`` (``~/data``, ``~user/data``) expanded, as the shell does not in
    ``--out=~/runs`` or a quoted ``"~/runs"``: a folder named ``~`` would be made instead."""
    return os.path.expanduser(text)


def positive_int(text: str) -> int:
    """argparse type: an int ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0; got {value}")
    return value


def output_names(paths: Sequence[str]) -> list[str]:
    """A distinct name per input file for its outputs: the file's stem, or, where stems collide
    (a/x.png, b/x.png, x.jpg), its path below the inputs' common folder with the suffix spelled
    out (a__x_png, b__x_png, x_jpg); a file given twice is numbered."""
    stems = [Path(path).stem for path in paths]
    resolved = [Path(path).resolve() for path in paths]
    common = Path(os.path.commonpath([str(path.parent) for path in resolved])) if paths else Path()
    names = []
    for stem, path in zip(stems, resolved):
        if stems.count(stem) == 1:
            names.append(stem)
        else:
            below = "__".join(path.relative_to(common).with_suffix("").parts)
            names.append(re.sub(r"[^A-Za-z0-9._-]", "_", below) + "_" + path.suffix.lstrip("."))
    original = list(names)
    seen: dict[str, int] = {}
    for index, name in enumerate(original):
        if original.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            names[index] = f"{name}-{seen[name]}"
    return names


def parse_target(text: Optional[str], class_names: Optional[Sequence[str]]) -> Optional[int]:
    """--target: a class index or a class name."""
    if text is None:
        return None
    text = text.strip()  # " 1" from a quoted shell argument, "cat\r" from a CRLF script
    if text.lstrip("-").isdigit():
        return int(text)
    if class_names is None:
        raise ValueError(f"--target {text!r} is not a class index, and the model's class names are not known: give "
                         "an index, or the names with --class-names FILE.")
    return class_index(text, class_names)


def command_line_target(arguments: argparse.Namespace, loaded: LoadedModel) -> Target:
    """--target / --topk for the loaded model: a class index for a classifier; for a segmentation
    model, a SegmentationTarget (the class's logits summed over the pixels predicted as it)."""
    if loaded.task == "detection":
        if arguments.target is not None or arguments.topk is not None:
            raise ValueError(f"{loaded.name} is a detection model: it explains detected instances, one map each; "
                             "choose them with --instances (all, K for the K highest-scoring, a score threshold in "
                             "(0, 1), or boxes x0,y0,x1,y1;...), not --target / --topk.")
        return None
    if arguments.instances is not None:
        raise ValueError(f"--instances explains the detections of a detector; {loaded.name} is a {loaded.task} model: "
                         "give --target CLASS or --topk K.")
    index = parse_target(arguments.target, loaded.class_names)
    if loaded.task == "segmentation":
        if arguments.topk is not None:
            raise ValueError(f"--topk ranks the classes of a classifier; {loaded.name} is a segmentation model: give "
                             "--target CLASS (a class index or name).")
        if index is None:
            raise ValueError(f"{loaded.name} is a segmentation model: give --target CLASS (a class index or name); the "
                             "map explains that class's logits summed over the pixels predicted as it.")
        return SegmentationTarget(index)
    return index


def parse_instances(text: Optional[str], loaded: LoadedModel) -> Optional[InstanceSpec]:
    """--instances for a detector ("all" when not given): all, K, a score threshold in (0, 1), or boxes
    "x0,y0,x1,y1;x0,y0,x1,y1" in the model input's pixels. None for other models."""
    if loaded.task != "detection":
        return None
    if text is None or text == "all":
        return "all"
    if ";" in text or text.count(",") == 3:
        try:
            boxes = [[float(value) for value in box.split(",")] for box in text.split(";") if box.strip()]
        except ValueError:
            boxes = []
        if not boxes or any(len(box) != 4 for box in boxes):
            raise ValueError(f"--instances {text!r}: boxes are four numbers x0,y0,x1,y1 each, separated by ';'.")
        return torch.tensor(boxes)
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"--instances takes all, K (the K highest-scoring detections), a score threshold in (0, 1) "
                         f"or boxes x0,y0,x1,y1;...; got {text!r}.") from None
    if number.is_integer() and number >= 1:
        return int(number)
    if 0 < number < 1:
        return number
    raise ValueError(f"--instances {text!r}: K must be a whole number ≥ 1, a threshold in (0, 1).")


def check_takes_images_alone(loaded: LoadedModel) -> None:
    """The command line gives a model images only: refuse one whose forward needs text as well
    (CLIP's input_ids), saying how to explain it."""
    parameters = list(inspect.signature(loaded.model.forward).parameters)
    if not parameters or parameters[0] == "pixel_values" or "pixel_values" not in parameters:
        return
    architecture = type(loaded.model).__name__
    tower = architecture.removesuffix("Model") + "VisionModelWithProjection"
    raise ValueError(
        f"{loaded.name} is a {architecture}: every output of its forward needs {parameters[0]} (text prompts) "
        f"besides the images{f' ({loaded.output} scores images against prompts)' if loaded.output else ''}, and the "
        "command line gives images only. Explain it in Python with the prompts: explainer.explain(image, "
        f"forward_kwargs=dict({parameters[0]}=...), input_position='pixel_values', per_image=[]) (see 'Transformers "
        f"and CLIP' in the docs); or, for its image embedding alone, save the image tower once, "
        f"transformers.{tower}.from_pretrained(DIR).save_pretrained(DIR2), and use --model hf:DIR2 --output "
        "image_embeds."
    )


RANDOM_MARK = " [random weights]"


def warn_if_random(loaded: LoadedModel) -> str:
    """A warning on stderr when the weights are random (--weights random); the mark for printed results."""
    if not loaded.random_weights:
        return ""
    print(f"explain: warning: {loaded.name} has random weights (--weights random): the classes, scores and maps "
          "below mean nothing.", file=sys.stderr)
    return RANDOM_MARK


def _slug(text: str) -> str:
    """Text as part of a file name: letters, digits and . _ = - kept, any other run as one '-'."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-.")


def _model_label(source: str) -> str:
    """--model as a readable file-name part: resnet50, timm-vit_small_patch16_224, hf-my-vit, a file's stem."""
    if source.startswith("hf:"):
        identifier = source.removeprefix("hf:")
        local = Path(identifier).expanduser()
        return "hf-" + _slug(local.resolve().name if local.is_dir() else identifier)
    if source.startswith("timm:"):
        return "timm-" + _slug(source.removeprefix("timm:"))
    if Path(source).expanduser().is_file():
        return _slug(Path(source).stem)
    return _slug(source.removeprefix("torchvision:"))


def _resolved(text: Optional[str]) -> Optional[str]:
    """A path given on the command line as an absolute path (a name such as DEFAULT as it is)."""
    if text is None:
        return None
    path = Path(text.removeprefix("hf:")).expanduser()
    if not path.exists():
        return text
    return ("hf:" if text.startswith("hf:") else "") + str(path.resolve())


def run_settings(arguments: argparse.Namespace, image: str) -> dict[str, Any]:
    """Everything of a command that decides an output picture (recorded in it): the image, model,
    weights, method, layer, target, options, preprocessing and rendering."""
    return {"image": str(Path(image).resolve()), "model": _resolved(arguments.model),
            "weights": _resolved(arguments.weights), "num_classes": arguments.num_classes,
            "output": arguments.output, "class_names": _resolved(arguments.class_names),
            "size": arguments.size, "mean": arguments.mean, "std": arguments.std,
            "method": get_method(arguments.method).name, "layer": arguments.layer, "target": arguments.target,
            "topk": arguments.topk, "instances": arguments.instances, "options": sorted(arguments.option),
            "alpha": arguments.alpha,
            "cmap": arguments.cmap}


def output_file_name(arguments: argparse.Namespace, stem: str) -> str:
    """``<stem>_<method>_<model>[_<weights>][_<layer>][_t<target>|_top<k>][_<options>][_<digest>].png``:
    what changes a map is in the name, readable (the output and preprocessing settings, and
    options longer than 40 characters, as a 6-digit digest), file-name safe."""
    weights = arguments.weights
    parts = [stem, get_method(arguments.method).name, _model_label(arguments.model)]
    if weights is not None:
        parts.append(_slug(Path(weights).stem if Path(weights).expanduser().is_file() else weights))
    if arguments.layer is not None:
        parts.append(_slug(arguments.layer))
    if arguments.target is not None:  # a name in other letters (正方形) as a digest: t alone would be shared
        target = _slug(arguments.target)  # (a byte that is not UTF-8, a lone surrogate, is hashed as its code)
        digest = hashlib.sha1(arguments.target.encode("utf-8", "surrogatepass")).hexdigest()[:6]
        parts.append("t" + (target if target else digest))
    if arguments.topk is not None:
        parts.append(f"top{arguments.topk}")
    if arguments.instances is not None:
        parts.append("i" + _slug(arguments.instances))
    options = _slug("_".join(sorted(arguments.option)))
    readable_options = len(options) <= 40
    if readable_options:
        parts.append(options)
    extras = [[] if readable_options else sorted(arguments.option), arguments.output, arguments.size, arguments.mean,
              arguments.std, arguments.num_classes]
    if any(extra for extra in extras):
        parts.append(hashlib.sha1(json.dumps(extras).encode()).hexdigest()[:6])
    name = "_".join(part for part in parts if part)
    if len(name) > 200:  # file systems allow 255 bytes
        name = f"{name[:190]}-{hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
    return name + ".png"


SETTINGS_KEY = "explain-settings"
"""The PNG text chunk in which the command records the settings that made a picture."""


def _recorded_settings(path: Path) -> Optional[str]:

    try:
        with open_image(path) as image:
            return getattr(image, "text", {}).get(SETTINGS_KEY)
    except Exception:  # not an image, unreadable: not ours
        return None


def write_overlays(explanation: Explanation, destination: Path, settings: dict[str, Any], alpha: float,
                   cmap: str) -> tuple[Path, str]:
    """Save an explanation's overlays as a PNG recording its settings. A file already at
    ``destination`` from other settings (or not written by explain) is kept and the new one is
    numbered (``-2``, ``-3``, ...); one from the same settings is replaced. Returns the path
    written and a note saying which of these happened ("" for a new file)."""
    from PIL import PngImagePlugin

    recorded = json.dumps(settings, sort_keys=True)
    path, number = destination, 1
    while path.exists() and _recorded_settings(path) != recorded:
        number += 1
        path = destination.with_name(f"{destination.stem}-{number}{destination.suffix}")
    done = "replaced the earlier result of the same settings" if path.exists() else ""
    if path != destination:
        note = f" ({destination.name} holds another run's result: kept; {done or 'this one numbered'})"
    else:
        note = f" ({done})" if done else ""
    information = PngImagePlugin.PngInfo()
    information.add_text(SETTINGS_KEY, recorded)
    picture = explanation.overlay_image(alpha=alpha, cmap=cmap)
    write_atomically(path, lambda temporary: picture.save(temporary, format="PNG", pnginfo=information))
    return path, note


def _describe(explanation: Explanation, image_index: int, target_index: int) -> str:
    text = explanation.title(image_index, target_index)
    if explanation.probabilities is not None:
        text += f" (p={float(explanation.probabilities[image_index, target_index]):.3f})"
    return text


def check_image_arguments(arguments: argparse.Namespace) -> None:
    """The settings of the image command that hold for every image, checked before the model is loaded: an error
    once, not one per image."""
    if not 0.0 <= arguments.alpha <= 1.0:  # NaN fails too
        raise ValueError(f"--alpha is the heatmap's opacity, in [0, 1]; got {arguments.alpha}.")
    if arguments.target is not None and arguments.topk is not None:
        raise ValueError(f"--target {arguments.target} and --topk {arguments.topk}: give one of them (--target "
                         "explains one class, --topk the k top classes of each image).")
    if arguments.layer is not None and not arguments.layer.strip():
        raise ValueError("--layer is empty: give a layer's name (`explain layers MODEL` lists them), or leave it out "
                         "for the model's default layer.")
    check_colormap(arguments.cmap)


def run_images(arguments: argparse.Namespace) -> int:
    check_image_arguments(arguments)
    device = parse_device(arguments.device)
    out = check_output_folder(arguments.out)
    loaded = load_from_arguments(arguments)
    loaded.model.to(device)
    explainer = make_explainer(arguments.method, loaded, arguments.layer, arguments.option)
    target = command_line_target(arguments, loaded)
    instances = parse_instances(arguments.instances, loaded)
    mark = warn_if_random(loaded)
    out.mkdir(parents=True, exist_ok=True)
    failures: list[tuple[str, str]] = []  # (image, reason)
    none_written = True  # no image written yet: the reasons wait, as one reason shared by every image is said once
    for path, stem in zip(arguments.images, output_names(arguments.images)):
        try:  # an image that cannot be read or explained is reported, and the others are explained
            explanation = explainer.explain(path, target=target, topk=arguments.topk, instances=instances)
            destination, note = write_overlays(explanation, out / output_file_name(arguments, stem),
                                               run_settings(arguments, path), arguments.alpha, arguments.cmap)
        except (ValueError, TypeError, LayerNotRunError, ModelInputError, OSError) as error:
            reason = _os_error_text(error) if isinstance(error, OSError) else str(error)
            if isinstance(error, ModelInputError):  # its advice is Python's: say the flag
                reason += " On the command line, --size S or --size H W sets the input size."
            failures.append((path, reason))
            if not none_written:
                _print_image_error(*failures[-1])
            continue
        if none_written:
            none_written = False
            for failure in failures:
                _print_image_error(*failure)
        targets = explanation.map_grid.shape[1]
        described = "; ".join(_describe(explanation, 0, k) for k in range(targets))
        layer = f" [{explanation.description()}]" if explanation.layer is not None else ""
        print(one_line(f"{path}: {described}{mark}{layer} -> {destination}{note}"), flush=True)
    if not failures:
        return 0
    reasons = {reason for _, reason in failures}
    if none_written and len(reasons) == 1:  # every image failed for the same reason: the settings', said once
        count = len(failures)
        print(f"explain: error: {reasons.pop()}{f' (each of the {count} images)' if count > 1 else ''}",
              file=sys.stderr)
        return 2
    if none_written:
        for failure in failures:
            _print_image_error(*failure)
    written = len(arguments.images) - len(failures)
    print(f"explain: error: {len(failures)} of {len(arguments.images)} image(s) could not be explained (the reasons "
          f"above){f'; the other {written} were written to {out}' if written else ''}.", file=sys.stderr)
    return 2


def _print_image_error(path: str, reason: str) -> None:
    """One image's failure as an ``explain: error:`` line that names the image."""
    print(f"explain: error: {'' if path in reason else f'{one_line(path)}: '}{reason}", file=sys.stderr, flush=True)


DEMO_METHODS = {"demo": ("gradcam", "layer4", "Grad-CAM at layer4 of the demo CNN"),
                "demo-vit": ("gradientrollout", None, "Gradient-weighted attention rollout of the demo transformer"),
                "demo-vit2": ("transformerattribution", None, "Transformer attribution of the second demo transformer")}


def run_demo(out: str = "explain-demo.png", count: int = 6, model: str = "demo") -> Path:
    """Explain a few synthetic images with a shipped model ('demo', the CNN, or 'demo-vit' and 'demo-vit2', the
    transformers); write one figure. No network."""
    from .data.synthetic import CLASS_NAMES, make_dataset

    if model not in DEMO_METHODS:
        raise ValueError(f"explain demo takes --model demo, demo-vit or demo-vit2; got {model!r}.")
    method, layer, what = DEMO_METHODS[model]
    loaded = load_model(model)
    data = make_dataset(count, seed=DEMO_SEED)
    explainer = make_explainer(method, loaded, layer)
    explanation = explainer.explain(list(data.images))
    titles = [f"true class: {CLASS_NAMES[label]}" for label in data.labels]
    figure = explanation.figure(image_titles=titles)
    figure.suptitle(f"{what}: the class is the filled shape; rings, bars and boxes are distractors", fontsize=9)
    figure.savefig(out, dpi=120)
    for index in range(count):
        print(f"image {index}: {titles[index]}, predicted {_describe(explanation, index, 0)}")
    print(f"figure written to {out}")
    return Path(out)


def run_strategies(argv: Sequence[str]) -> int:
    """``explain strategies OUT``: SpRAy over a batch run's maps; writes OUT/strategies.json (shown by the report)."""
    from .dataset_tools.spray import strategies

    parser = Parser(prog="explain strategies", description="Cluster each class's maps of a batch run (SpRAy) and "
                    "flag clusters whose relevance sits at a fixed place or the border; writes OUT/strategies.json "
                    "and OUT/strategies/*.png, which `explain report OUT` shows.")
    parser.add_argument("out", help="a folder written by explain batch")
    parser.add_argument("--clusters", type=positive_int, help="clusters per class (default: from the eigengap)")
    parser.add_argument("--min-images", type=positive_int, default=20, help="classes with fewer maps are skipped")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    arguments = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        found = strategies(arguments.out, clusters=arguments.clusters, min_images=arguments.min_images,
                           progress=not arguments.no_progress)
    for warning in caught:  # the notes are printed below, once; other warnings are shown as they came
        if str(warning.message) not in found.notes:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    for entry in found.classes:
        print(f"{entry.class_name}: {entry.images} map(s), {len(entry.clusters)} cluster(s)")
        for cluster in entry.clusters:
            flag = f" FLAGGED: {cluster.reason}" if cluster.flagged else ""
            print(f"  cluster {cluster.cluster}: {cluster.size} image(s), peak at (y {cluster.peak[0]:.2f}, "
                  f"x {cluster.peak[1]:.2f}){flag}")
    for skipped in found.skipped:
        print(f"{skipped.class_name}: skipped ({skipped.reason})")
    for note in found.notes:  # unreadable maps, maps without a place, more groups than max_clusters...
        print(f"note: {note}", file=sys.stderr)
    print(f"written to {found.json_file}")
    return 0


def run_concepts(argv: Sequence[str]) -> int:
    """``explain concepts IMAGE ... --model M --layer L``: CRP's glocal figure of each image (its most relevant
    concepts of the layer, their conditional heatmaps, and reference patches from ``--references FOLDER``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .io.inputs import folder_images
    from .methods.concepts import ConceptRelevance, concept_references, glocal_figure, relevance_method_for

    parser = Parser(prog="explain concepts", description="Concept Relevance Propagation: for each image, the layer's "
                    "concepts (channels) most relevant to the prediction, where each looked, and (with --references) "
                    "the patches of a folder of images where each concept mattered most. Writes one figure per image.")
    parser.add_argument("images", nargs="+", help="image files; or one folder: build its concept atlas in --out")
    _add_model_options(parser)
    parser.set_defaults(method=None)  # lrp, or attnlrp for a transformer (relevance_method_for)
    parser.add_argument("--concepts", type=positive_int, help="concepts per image (default 4)")
    parser.add_argument("--references", metavar="FOLDER", help="a folder of images to find reference patches in")
    parser.add_argument("--top", type=positive_int, default=4, help="reference patches per concept (default 4)")
    parser.add_argument("--out", help="the figure (default concepts.png; several images: NAME-1.png, NAME-2.png, "
                        "...); for a folder, the atlas's folder (default concept-atlas)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="atlas: images per pass (default 32)")
    parser.add_argument("--shard", metavar="I/N", help="atlas: compute only batches b with b %% N == I (merge with a "
                        "run without --shard)")
    arguments = parser.parse_args(argv)
    if arguments.method not in (None, "lrp", "attnlrp"):
        raise ValueError(f"explain concepts propagates relevance with --method lrp or attnlrp; got {arguments.method}.")
    if arguments.layer is None:
        raise ValueError("explain concepts needs --layer: the layer whose channels are the concepts (see "
                         "`explain layers MODEL`).")
    if arguments.topk is not None or arguments.instances is not None:
        raise ValueError("explain concepts explains one class per image: --topk and --instances do not apply.")
    loaded = load_from_arguments(arguments)
    if arguments.method is None:
        arguments.method = relevance_method_for(loaded)
    options = dict(parse_option(text, get_method(arguments.method)) for text in arguments.option)
    if len(arguments.images) == 1 and Path(arguments.images[0]).is_dir():
        given = [option for option, value in (("--target", arguments.target), ("--concepts", arguments.concepts),
                                              ("--references", arguments.references)) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} apply to image files, not to a folder: a folder's concept atlas "
                             "holds every concept's references for each image's predicted class. Leave them out, or "
                             "give image files.")
        return _build_atlas_from_arguments(arguments, loaded, options)
    if arguments.shard is not None:
        raise ValueError("--shard splits a folder's concept atlas; give one folder, or leave --shard out for image "
                         "files.")
    crp = ConceptRelevance(loaded, arguments.layer, arguments.method, **options)
    target = command_line_target(arguments, loaded)
    concept_count = 4 if arguments.concepts is None else arguments.concepts
    explanations = [crp.explain(image, target=target, concepts=concept_count) for image in arguments.images]
    references: Any = None
    if arguments.references is not None and (Path(arguments.references) / "atlas.json").is_file():
        from .dataset_tools.concept_atlas import load_atlas

        references = load_atlas(arguments.references)  # an atlas: its stored patches, nothing computed
        if references.entries["layer"] != arguments.layer:
            raise ValueError(f"the atlas in {arguments.references} is of layer {references.entries['layer']}, not "
                             f"{arguments.layer}.")
    elif arguments.references is not None:  # the patches of every concept the figures show, found once
        folder = Path(arguments.references)
        if not folder.is_dir():
            raise ValueError(f"--references {folder} is not a folder of image files.")
        try:
            files = folder_images(folder)
        except ValueError as error:
            raise ValueError(f"--references: {error}") from None
        shown = sorted({int(c) for explanation in explanations for c in concept_indices(explanation)})
        references = concept_references(crp, files, concepts=shown, top=arguments.top)
    out = Path(arguments.out or "concepts.png")
    for index, (image, explanation) in enumerate(zip(arguments.images, explanations)):
        figure = glocal_figure(explanation, references, patches=arguments.top if references is not None else 0)
        destination = out if len(arguments.images) == 1 else out.with_name(f"{out.stem}-{index + 1}{out.suffix}")
        figure.savefig(destination, dpi=120)
        plt.close(figure)
        concepts = ", ".join(f"{int(c)} ({float(r):.3g})" for c, r in zip(concept_indices(explanation),
                                                                          explanation.scores[0]))
        print(f"{image}: class {int(explanation.diagnostics['explained_class'][0])}, concepts {concepts} -> "
              f"{destination}")
    return 0


def concept_indices(explanation: Explanation) -> list[int]:
    """The concepts (channels) of image 0 of ``ConceptRelevance.explain``'s explanation."""
    assert explanation.class_indices is not None, "CRP's explanations hold their concepts"
    return [int(concept) for concept in explanation.class_indices[0]]


def _build_atlas_from_arguments(arguments: argparse.Namespace, loaded: LoadedModel, options: dict[str, Any]) -> int:
    """``explain concepts DIR``: the concept atlas of the layer over the folder's images."""
    from .dataset_tools.concept_atlas import build_atlas

    shard = None
    if arguments.shard is not None:
        parts = arguments.shard.split("/")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"--shard takes I/N (e.g. 0/4); got {arguments.shard!r}.")
        shard = (int(parts[0]), int(parts[1]))
    out = arguments.out or "concept-atlas"
    atlas = build_atlas(loaded, arguments.layer, arguments.images[0], out, method=arguments.method,
                        top=arguments.top, batch_size=arguments.batch_size, shard=shard, **options)
    if atlas is None:
        print(f"shard {arguments.shard} of the atlas written to {out}/batches")
    else:
        print(f"concept atlas of {arguments.layer}: {len(atlas.entries['concepts'])} concepts over "
              f"{atlas.entries['images']} images -> {Path(out) / 'atlas.html'}")
    return 0


EVALUATE_METRICS = ("deletion", "insertion", "road", "confidence_drop", "pointing_game", "energy_pointing_game",
                    "sparseness", "random_logit")


def literal_value(raw: str) -> Any:
    """A command-line VALUE as a Python literal (64, 0.5, (7, 7), None, True; a bare word such as blur is a
    string)."""
    raw = raw.strip()
    words = {"none": None, "true": True, "false": False}
    if raw.lower() in words:
        return words[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def evaluation_explainers(methods: Sequence[str], loaded: LoadedModel, layer: Optional[str],
                          options: Sequence[str]) -> dict[str, Explainer]:
    """``explain evaluate``'s methods: each built as ``explain batch`` builds its one (``make_explainer``), with
    --layer for the methods that explain a layer (the others explain at the input) and each --option: KEY=VALUE
    to every method that takes KEY (an error when none does), METHOD:KEY=VALUE to that method alone."""
    classes = {name: get_method(name) for name in methods}
    if layer is not None and not any(cls.needs_layer for cls in classes.values()):
        raise ValueError(f"--layer {layer}: none of the methods ({', '.join(methods)}) explains a layer; leave it out, "
                         "or add a CAM method (gradcam, ...).")
    given: dict[str, list[str]] = {name: [] for name in methods}
    for text in options:
        head, separator, value = text.partition("=")
        method, colon, key = head.rpartition(":")
        key = key.strip().replace("-", "_")
        if not separator:
            raise ValueError(f"--option {text!r}: write KEY=VALUE (to every method that takes KEY) or "
                             "METHOD:KEY=VALUE (to one method), e.g. --option integratedgradients:steps=64.")
        if colon:
            if method.strip() not in classes:
                raise ValueError(f"--option {text!r}: {method.strip()!r} is not one of --methods "
                                 f"({', '.join(methods)}).")
            given[method.strip()].append(f"{key}={value}")
            continue
        takers = [name for name, cls in classes.items() if key in method_options(cls)]
        if not takers:
            listed = "; ".join(f"{name}: {', '.join(method_options(cls)) or 'none'}" for name, cls in classes.items())
            raise ValueError(f"--option {text!r}: none of the methods takes {key!r}. Their options: {listed}.")
        for name in takers:
            given[name].append(f"{key}={value}")
    return {name: make_explainer(name, loaded, layer if classes[name].needs_layer else None, given[name])
            for name in methods}


def evaluation_metrics(names: Sequence[str], options: Sequence[str]) -> list[Any]:
    """``explain evaluate``'s metrics: names of ``evaluation.METRICS`` (in any case, with or without their
    underscores: pointinggame is pointing_game), those named by a --metric-option METRIC.KEY=VALUE changed with
    ``Metric.with_options`` (VALUE read as ``literal_value``, checked against the setting's default)."""
    from .dataset_tools.evaluation import METRICS

    def spelled(name: str) -> str:  # a metric's name as written: pointinggame, pointing-game, Pointing_Game
        return name.lower().replace("_", "").replace("-", "")

    by_spelling = {spelled(name): name for name in METRICS}
    names = [by_spelling.get(spelled(name), name) for name in names]
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(METRICS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown metric {unknown[0]!r}.{hint} Known: {', '.join(METRICS)}.")
    changes: dict[str, dict[str, Any]] = {}
    for text in options:
        head, separator, raw = text.partition("=")
        metric, dot, key = head.strip().partition(".")
        if not separator or not dot:
            raise ValueError(f"--metric-option {text!r}: write METRIC.KEY=VALUE, e.g. --metric-option "
                             "pointing_game.tolerance=4.")
        metric, key = by_spelling.get(spelled(metric), metric), key.strip()
        if metric not in names:
            raise ValueError(f"--metric-option {text!r}: {metric!r} is not one of the metrics evaluated "
                             f"({', '.join(names)}).")
        settings = METRICS[metric].options
        if key not in settings:
            raise ValueError(f"--metric-option {text!r}: {metric} has the settings "
                             f"{', '.join(f'{name}={value!r}' for name, value in settings.items()) or '(none)'}.")
        value, default = literal_value(raw), settings[key]
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        fits = (default is None or value is None or type(value) is type(default)
                or (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)))
        if not fits:
            raise ValueError(f"--metric-option {text!r}: {metric}.{key} takes {type(default).__name__} values "
                             f"(default {default!r}).")
        changes.setdefault(metric, {})[key] = value
    return [METRICS[name].with_options(**changes[name]) if name in changes else name for name in names]


def run_evaluate(argv: Sequence[str]) -> int:
    """``explain evaluate``: a method × metric table over a data set (``explain.evaluate``), resumable."""
    from .dataset_tools.evaluation import METRICS, evaluate, metric_heading

    parser = Parser(prog="explain evaluate", description="Compare explanation methods with metrics over a data set: "
                    "writes OUT/evaluation.md (mean ± standard error per method and metric, ranks, ≈ where a "
                    "difference lies inside the standard error, the mean rank, and every metric's settings), "
                    "OUT/evaluation.png and every image's values in OUT/evaluation.csv; a rerun resumes.",
                    epilog="Settings: " + "; ".join(metric_heading(metric) for metric in METRICS.values()
                                                     if metric.options))
    parser.add_argument("--model", required=True, help="demo, demo-vit, demo-vit2, demo-watermark, a torchvision "
                        "name, timm:NAME, hf:ID_OR_DIRECTORY, or a file holding a whole model (--allow-pickle)")
    parser.add_argument("--weights", help="a pretrained name, a state-dict file, or random")
    parser.add_argument("--num-classes", type=positive_int, help="classes of a fine-tuned head (with --weights FILE)")
    parser.add_argument("--allow-pickle", action="store_true", help="load a whole pickled model from --model FILE "
                        "(unpickling can run code from the file: trust it)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:N or mps (default: cuda when there is a GPU, else cpu)")
    parser.add_argument("--methods", nargs="+", required=True, metavar="METHOD", help="registered method names")
    parser.add_argument("--layer", help="target layer of the methods that explain a layer (CAMs), e.g. layer4 "
                        "(default: chosen automatically); the other methods explain at the input")
    parser.add_argument("--option", action="append", default=[], metavar="[METHOD:]KEY=VALUE",
                        help="a method option, as explain batch takes it: KEY=VALUE goes to every method that takes "
                        "KEY, METHOD:KEY=VALUE to that one (repeatable; `explain methods NAME` lists a method's "
                        "options), e.g. --option integratedgradients:steps=64")
    parser.add_argument("--metrics", nargs="+", metavar="METRIC",
                        help=f"default: {' '.join(EVALUATE_METRICS)} (with --data FOLDER, those that need no masks); "
                        f"known: {' '.join(METRICS)}")
    parser.add_argument("--metric-option", action="append", default=[], metavar="METRIC.KEY=VALUE",
                        help="a metric's setting instead of its default, e.g. --metric-option "
                        "pointing_game.tolerance=4 (repeatable; the table and the figure show every metric's "
                        "settings, the settings below)")
    parser.add_argument("--data", default="demo", type=user_path,
                        help="'demo' (held-out synthetic images of the shipped models, with object masks) or a "
                        "folder with one sub-folder per class (no masks: no localisation metrics; images of "
                        "different sizes go in batches of one size; an --out folder inside it is "
                        "left out)")
    parser.add_argument("--images", type=positive_int, default=32, help="with --data demo: how many (default 32)")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="images explained and measured together (default 8); a resumed run needs the same")
    parser.add_argument("--workers", type=non_negative_int, default=default_workers(), metavar="N",
                        help="with --data FOLDER: processes that read and preprocess the images ahead of the batch "
                        f"being evaluated (default: min(8, CPU cores - 1), here {default_workers()}; 0: in the main "
                        "process)")
    parser.add_argument("--out", required=True, type=user_path, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    arguments = parser.parse_args(argv)
    for name in ("output", "size", "mean", "std", "class_names"):
        setattr(arguments, name, None)
    twice = sorted({name for name in arguments.methods if arguments.methods.count(name) > 1})
    if twice:
        raise ValueError(f"method {twice[0]!r} is given twice in --methods.")
    if arguments.metrics is None:  # a class folder has no masks: the default metrics that need none
        arguments.metrics = [name for name in EVALUATE_METRICS
                             if arguments.data == "demo" or not METRICS[name].needs_masks]
    device = parse_device(arguments.device)
    chosen = evaluation_metrics(arguments.metrics, arguments.metric_option)
    out = check_output_folder(arguments.out)
    loaded = load_from_arguments(arguments)
    loaded.model.to(device)
    explainers = evaluation_explainers(arguments.methods, loaded, arguments.layer, arguments.option)
    result = evaluate(loaded.model, explainers, _evaluation_data(arguments, loaded, out), chosen, out=out,
                      batch_size=arguments.batch_size, progress=not arguments.no_progress)
    print(result.markdown())
    print()
    print(result.notes_markdown())
    print(f"written to {arguments.out}: evaluation.md, evaluation.png, evaluation.csv")
    return 0


def run_vlm(argv: Sequence[str]) -> int:
    """``explain vlm IMAGE --model hf:DIR --prompt TEXT``: a vision-language model answers the prompt about the image
    (greedy decoding, or the answer given with --answer) and each answer token gets a map over the image; writes
    OUT/tokens.png (every token's map) and OUT/tokens.html (the answer as text: hover a token to see its map)."""
    from .io.inputs import load_image
    from .vlm.generation import METHODS, GenerationExplainer, check_text
    from .vlm.hf import DTYPES, load_vision_language_model
    from .vlm.view import write_token_files

    parser = Parser(prog="explain vlm", description=run_vlm.__doc__,
                    epilog="Open OUT/tokens.html in a browser: it is one file and needs no server and no network.")
    parser.add_argument("image", metavar="IMAGE", help="an image file")
    parser.add_argument("--model", required=True, metavar="hf:DIR",
                        help="hf:DIRECTORY (what model.save_pretrained(DIR) and processor.save_pretrained(DIR) wrote), "
                        "hf:HUB_ID (fetched into the HuggingFace cache: needs the network the first time), or "
                        "demo-vlm (the shipped tiny LLaVA, trained on one question about explain.data.demo_vlm's "
                        "scenes, 'what color is it ?', which it answers with the shape's colour; to any other prompt "
                        "it still names a colour)")
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the question about the image (in the model's chat template when its processor has one)")
    parser.add_argument("--answer", metavar="TEXT", help="explain this answer instead of generating one")
    parser.add_argument("--method", default="input_x_gradient", choices=METHODS,
                        help="input_x_gradient (default; signed), attention (gradient-weighted attention) or attnlrp "
                        "(signed)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                        help="the longest answer generated, in tokens (default 32)")
    parser.add_argument("--out", default="explain-vlm", metavar="DIR", help="output folder (default: explain-vlm)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="load the model in this dtype (default: as saved)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read weights that are only pickled (pytorch_model.bin): unpickling can run code from "
                        "the file, trust it")
    parser.add_argument("--alpha", type=float, default=0.5, help="heatmap opacity in [0, 1] (default 0.5)")
    parser.add_argument("--cmap", default="jet", help="matplotlib colour map of unsigned maps (signed maps: RdBu_r)")
    parser.add_argument("--columns", type=positive_int, default=8, metavar="N",
                        help="panels per row of tokens.png (default 8)")
    arguments = parser.parse_args(argv)
    check_text(arguments.prompt, "prompt (--prompt)")  # before the model is loaded
    if arguments.answer is not None:
        check_text(arguments.answer, "answer (--answer)")
    check_colormap(arguments.cmap)
    if not 0.0 <= arguments.alpha <= 1.0:
        raise ValueError(f"--alpha must lie in [0, 1]; got {arguments.alpha}.")
    device = parse_device(arguments.device)
    out = check_output_folder(arguments.out)
    image = load_image(arguments.image)
    if arguments.model == "demo-vlm":
        from .data.demo_vlm import QUESTIONS, load_vlm_demo

        if " ".join(arguments.prompt.split()) != QUESTIONS["color"]:
            print(f"explain: warning: demo-vlm was trained on one question, {QUESTIONS['color']!r} (the shape's "
                  f"colour); it answers {arguments.prompt!r} with a colour too, whatever it asks.", file=sys.stderr)
        model, processor = load_vlm_demo()
        model = model.to(device=device, dtype=DTYPES[arguments.dtype] if arguments.dtype else None)
    else:
        model, processor = load_vision_language_model(arguments.model, device=device, dtype=arguments.dtype,
                                                      allow_pickle=arguments.allow_pickle)
    explainer = GenerationExplainer(model, processor, method=arguments.method)
    explanation = explainer.explain(image, arguments.prompt, answer=arguments.answer,
                                    max_new_tokens=arguments.max_new_tokens)
    identifier = arguments.model.removeprefix("hf:")
    name = Path(identifier).expanduser().resolve().name if Path(identifier).expanduser().is_dir() else identifier
    picture, page = write_token_files(explanation, out, title=f"{name}: {arguments.method}", alpha=arguments.alpha,
                                      cmap=arguments.cmap, columns=arguments.columns)
    token_ids = explanation.diagnostics["token_ids"]
    assert isinstance(token_ids, torch.Tensor), "GenerationExplainer records the answer's token ids"
    answer = processor.tokenizer.decode(token_ids[0].tolist(), skip_special_tokens=True)
    print(f"answer: {answer}")
    print(f"{explanation.map_grid.shape[1]} answer token(s) explained ({arguments.method})")
    print(f"figure: {picture}")
    print(f"page: {page} (open {page.resolve().as_uri()})")
    return 0


def _evaluation_data(arguments: argparse.Namespace, loaded: LoadedModel, out: Path) -> Any:
    """--data as evaluate's data: the demo's held-out images with masks, or a class-folder's images in batches
    (``_folder_batches``; the output folder ``out`` left out where it lies inside)."""
    if arguments.data == "demo":
        from .data.synthetic import make_dataset
        from .data.train import EVALUATION_SEED

        if loaded.name not in ("demo", "demo-vit", "demo-vit2", "demo-watermark"):
            raise ValueError(f"--data demo holds the shipped models' synthetic shapes; {loaded.name} was not trained "
                             "on them: give --data FOLDER (one sub-folder per class).")
        data = make_dataset(arguments.images, seed=EVALUATION_SEED)
        inputs = torch.stack([loaded.preprocess(image) for image in data.images])
        return inputs, torch.from_numpy(data.labels), torch.from_numpy(data.masks)
    return _folder_batches(Path(arguments.data), loaded, arguments.batch_size, out, workers=arguments.workers)


PENDING_BATCHES = 4
"""How many batches' worth of images ``_folder_batches`` holds at most while it gathers images of one size."""


class FolderBatches:
    """The batches of ``_folder_batches``, iterated once, with ``dataset``, the labelled image files they hold, so
    that ``evaluate``'s progress bar knows how many images are coming."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], dataset: list[Path]):
        self.batches, self.dataset = batches, dataset

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches


def _folder_batches(folder: Path, loaded: LoadedModel, batch_size: int, out: Optional[Path] = None,
                    workers: int = 0) -> FolderBatches:
    """(inputs (B, C, H, W), labels (B,)) batches of a folder's images, labels from the class folders; the output
    folder ``out`` is left out when it lies inside (as ``explain batch`` does: a rerun must not read the figure it
    wrote as an image of a class). A batch holds images of one size (after the model's preprocessing, which may
    keep each image's size): the images are read in sorted file order, each joins the batch of its size, and a batch
    is given when it is full, when more than ``PENDING_BATCHES`` batches' worth of images are waiting (the one
    started first), or at the end (in the order they were started). The same folder gives the same batches. The
    images are read and preprocessed by ``workers`` worker processes, ahead of the batch being evaluated (0: in this
    process; a preprocess that cannot be sent to them, with a warning)."""
    from .dataset_tools.batch import check_output_outside, image_files
    from .dataset_tools.labels import folder_labels
    from .dataset_tools.pipeline import preprocessed_images, usable_workers

    if out is not None:
        check_output_outside(folder, out)
    files = image_files(folder, exclude=out)
    labels = folder_labels(folder, files, "folders", loaded.class_names, exclude=out)
    assert labels is not None, "labels='folders' always gives labels"
    labelled = [path for path in files if path.relative_to(folder) in labels.by_path]
    if not labelled:
        raise ValueError(f"no labelled image in {folder}: give a folder with one sub-folder per class.")

    by_path = labels.by_path

    def batch(group: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([image for image, _ in group]), torch.tensor([label for _, label in group])

    def batches(workers: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        workers, reason = usable_workers(workers, loaded.preprocess)
        if reason:
            warnings.warn(reason, UserWarning, stacklevel=2)
        waiting: dict[tuple[int, ...], list[tuple[torch.Tensor, int]]] = {}  # by image size, in the order started
        for path, image in zip(labelled, preprocessed_images(labelled, loaded.preprocess, workers)):
            group = waiting.setdefault(tuple(image.shape), [])
            group.append((image, by_path[path.relative_to(folder)]))
            if len(group) == batch_size:
                yield batch(waiting.pop(tuple(image.shape)))
            elif sum(len(images) for images in waiting.values()) > PENDING_BATCHES * batch_size:
                yield batch(waiting.pop(next(iter(waiting))))
        for group in waiting.values():
            yield batch(group)

    return FolderBatches(batches(workers), labelled)


def list_methods(verbose: bool = False) -> str:
    """One line per method; with ``verbose``, each method's --option settings and their defaults."""
    width = max(len(name) for name in REGISTRY)
    lines = []
    for name, cls in sorted(REGISTRY.items()):
        lines.append(f"{name:<{width}}  {cls.summary}")
        if verbose:
            options = method_options(cls)
            settings = " ".join(f"{key}={parameter.default!r}" for key, parameter in options.items()
                                if parameter.default is not inspect.Parameter.empty)
            lines.append(f"{'':<{width}}    --option {settings}" if settings else "")
    return "\n".join(line for line in lines if line)


def describe_method(name: str) -> str:
    """A method's summary and every --option it takes, with its default and meaning."""
    cls = get_method(name)
    docs = parameter_docs(cls.__doc__)
    first = (cls.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"{cls.name} ({cls.__name__}): {cls.summary}", "", first, "",
             f"Options (--option KEY=VALUE; in Python, {cls.__name__}(model{', layer' if cls.needs_layer else ''}, "
             "KEY=VALUE)):"]
    for key, parameter in method_options(cls).items():
        default = "" if parameter.default is inspect.Parameter.empty else f" (default {parameter.default!r})"
        meaning = docs.get(key, "").split(":", 1)[-1].strip()
        lines.append(f"  {key}{default}: {meaning}" if meaning else f"  {key}{default}")
    if cls.needs_layer:
        lines.append("  layer: --layer NAME (default: chosen on the first call)")
    return "\n".join(lines)


def run_batch(argv: Sequence[str]) -> int:
    """``explain batch``: every image of a folder, written to OUT (see explain.dataset_tools.batch). With the images'
    true labels (--labels folders: DIR/<class>/...; --labels FILE.csv: columns path,label), an image
    the model gets wrong is explained for its label and its predicted class (--target both, the
    default), one it gets right for the predicted class; --target label or predicted explains one
    of them, --target CLASS a given class, --topk K the top classes. The same command resumes an
    interrupted run; OUT/run.json records the model, its weights, the method's settings and the
    input files, and a rerun into OUT that differs in any of them is refused. One run at a time
    writes to OUT: a second one started meanwhile stops with an error naming the first."""
    from .dataset_tools.batch import TARGET_MODES

    parser = Parser(prog="explain batch", description=run_batch.__doc__)
    parser.add_argument("folder", type=user_path, help="folder of images (searched recursively)")
    _add_model_options(parser)
    parser.add_argument("--out", required=True, type=user_path,
                        help="output folder: index.csv, run.json, maps/, overlays/, skipped.csv")
    parser.add_argument("--labels", metavar="folders|FILE.csv", type=user_path,
                        help="the images' true classes: 'folders' (the first folder under DIR is the class, matched "
                        "by name to the model's class names, else numbered in sorted order) or a CSV file with the "
                        "columns path,label (path relative to DIR; label a class index or name)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="images explained together in one call (default 16); more is faster on a GPU, until "
                        "its memory runs out")
    parser.add_argument("--workers", type=non_negative_int, metavar="N",
                        help="processes that decode and preprocess the images, the next batches while one is "
                        f"explained (default: min(8, CPU cores - 1), here {default_workers()}; 0: in the main "
                        "process)")
    parser.add_argument("--overlays", action="store_true", help="also write overlay PNGs")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (under torchrun only rank 0 draws one, for its share)")
    for action in parser._actions:
        if action.dest == "target":
            action.help = ("label, predicted or both (with --labels; default both: the label's map and the "
                           "prediction's for a misclassified image), or a class index or name to explain "
                           "(default without labels: the top class)")
    arguments = parser.parse_args(argv)
    device = parse_device(arguments.device)
    check_output_folder(arguments.out)
    mode = arguments.target if arguments.target in TARGET_MODES else None
    if mode is not None and arguments.topk is not None:
        raise ValueError(f"--target {mode} and --topk: give one of them.")
    if mode in ("label", "both") and arguments.labels is None:
        raise ValueError(f"--target {mode} explains the images' true classes: give them with --labels folders (the "
                         "first folder under DIR is the class) or --labels FILE.csv (columns path,label).")
    shard = Shard.from_environment()
    distributed = shard.world_size > 1 and not torch.distributed.is_initialized()
    if distributed:  # launched by torchrun: one shard per process
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend)
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    try:
        loaded = load_from_arguments(arguments)
        loaded.model.to(device)
        explainer = make_explainer(arguments.method, loaded, arguments.layer, arguments.option)
        if (mode is not None or arguments.labels is not None) and loaded.task != "classification":
            asked = " and ".join(option for option in ("--labels" if arguments.labels else "",
                                                       f"--target {mode}" if mode else "") if option)
            raise ValueError(f"{asked}: labels and predictions are classes of a classifier, and {loaded.name} is a "
                             f"{loaded.task} model. Explain it with --target CLASS, without labels.")
        target = mode if mode is not None else command_line_target(arguments, loaded)
        mark = warn_if_random(loaded)
        summary = run(explainer, arguments.folder, arguments.out, target=target, topk=arguments.topk,
                      labels=arguments.labels, batch_size=arguments.batch_size, overlays=arguments.overlays,
                      progress=not arguments.no_progress, shard=shard, model_name=_resolved(arguments.model),
                      weights_name=_resolved(arguments.weights), workers=arguments.workers)
        index = summary.index
        counts = [summary.explained, summary.already_done, len(summary.skipped), summary.labelled,
                  summary.misclassified]
        processes = ""
        if shard.world_size > 1:
            if torch.distributed.is_initialized():  # every rank's counts, added up: rank 0 reports the whole run
                totals = torch.tensor(counts, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
                torch.distributed.all_reduce(totals)
                counts = [int(count) for count in totals.tolist()]
                processes = f" by {shard.world_size} processes ({summary.explained} by rank 0)"
                torch.distributed.barrier()
            if shard.rank == 0:
                index = merge_shard_indexes(arguments.out)
        explained, already_done, skipped_count, labelled_count, misclassified = counts
        merged = shard.world_size > 1 and torch.distributed.is_initialized()
        if merged and shard.rank != 0:  # rank 0 speaks for the run: one report, not one per process
            return 0
        skipped_file = Path(arguments.out) / "skipped.csv" if merged else summary.skipped_file
        skipped = (f"; {skipped_count} file(s) skipped, listed with the reason in {skipped_file}"
                   if skipped_count else "")
        rank = f"rank {shard.rank}: " if shard.world_size > 1 and not merged else ""
        if summary.labels:  # (one line each: a newline of a folder's name as an escape)
            print(one_line(f"{rank}{summary.labels}"))
        labelled = (f"; {labelled_count} of them with a label, {misclassified} misclassified"
                    if summary.labels else "")
        print(one_line(f"{rank}{explained} image(s) explained{processes}{mark}, {already_done} already done"
                       f"{labelled}{skipped}; results in {arguments.out}, index {index}"))
    finally:
        if distributed:
            torch.distributed.destroy_process_group()
    return 0


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", required=True,
                       help="demo, demo-vit, demo-vit2 or demo-watermark (the shipped models, no network), a "
                       "torchvision name (resnet50), timm:NAME (timm:vit_small_patch16_224), hf:ID_OR_DIRECTORY (a "
                       "HuggingFace model), or a file holding a whole model (--allow-pickle); the shipped "
                       "vision-language model, demo-vlm, is `explain vlm`'s")
    model.add_argument("--weights", help="needed by a torchvision or timm architecture: a pretrained name (DEFAULT or "
                       "a torchvision weights name such as IMAGENET1K_V2; 'pretrained' for timm), a state-dict file "
                       "(.pt, .pth, .bin, .safetensors), or 'random' (random weights, to try the command)")
    model.add_argument("--num-classes", type=positive_int, help="classes of a fine-tuned head (with --weights FILE)")
    model.add_argument("--output", help="which output to explain when the model's is not a tensor of class scores "
                       "(a key such as pooler_output; an index)")
    model.add_argument("--allow-pickle", action="store_true",
                       help="load a whole pickled model from --model FILE, or an hf: directory's pickled weights "
                       "(pytorch_model.bin) (unpickling can run code from the file: trust it)")
    model.add_argument("--class-names", metavar="FILE", help="class names: one per line, or a JSON list")
    model.add_argument("--size", type=positive_int, nargs="+", metavar="S",
                       help="input size instead of the model's own: S (shorter side to S, centre crop S×S) or H W")
    model.add_argument("--mean", type=float, nargs="+", help="normalisation mean per channel, in [0, 1] units")
    model.add_argument("--std", type=float, nargs="+", help="normalisation std per channel, in [0, 1] units")
    model.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cpu, cuda, cuda:N or mps (default: cuda when there is a GPU, else cpu)")
    method = parser.add_argument_group("method")
    method.add_argument("--method", default="gradcam", help="a method name (see `explain methods`)")
    method.add_argument("--layer", help="target layer for CAM methods, e.g. layer4 (default: chosen automatically)")
    method.add_argument("--target", help="class index or name to explain (default: the top class)")
    method.add_argument("--topk", type=positive_int, help="explain the k top classes of each image")
    method.add_argument("--instances", metavar="SPEC",
                        help="for a detector: the detected instances to explain, one map each: all (the default), "
                        "K (the K highest-scoring), a score threshold in (0, 1), or boxes x0,y0,x1,y1;...")
    method.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a method option, e.g. --option steps=64 --option baseline=blur (repeatable; "
                        "`explain methods NAME` lists a method's options)")


def load_from_arguments(arguments: argparse.Namespace) -> LoadedModel:
    """The model of the command line's model options."""
    output: Optional[str | int] = arguments.output
    if isinstance(output, str) and output.lstrip("-").isdigit():
        output = int(output)
    if arguments.size is not None and len(arguments.size) > 2:
        raise ValueError(f"--size takes S or H W; got {len(arguments.size)} numbers.")
    if arguments.weights is None and names_an_architecture(arguments.model):
        raise ValueError(f"--model {arguments.model} is an architecture: without --weights its weights would be "
                         "random, and its classes and maps would mean nothing (another class each run). Say which "
                         f"weights: {weights_choices(arguments.model)}.")
    loaded = load_model(arguments.model, arguments.weights, num_classes=arguments.num_classes, output=output,
                        allow_pickle=arguments.allow_pickle, class_names=arguments.class_names, size=arguments.size,
                        mean=arguments.mean, std=arguments.std)
    check_takes_images_alone(loaded)
    return loaded


def _image_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="explain",
        description="Explain images with a vision model and write heatmap overlays.",
        epilog="Other commands (each with its own --help): `explain demo` (no network needed; --debugging: a model "
        "debugged over a data set), `explain methods [--verbose] [NAME]` (a method's options), `explain layers "
        "MODEL` (layer names and output shapes), `explain batch DIR --out OUT` (a whole folder, resumable; "
        "sharded under torchrun), `explain strategies OUT` (a batch run's maps clustered per class, SpRAy), "
        "`explain report OUT` (a batch run as an HTML page), `explain evaluate --methods A B ... --out OUT` (a "
        "method × metric table over a data set), `explain vlm IMAGE --prompt TEXT` (a vision-language model's "
        "answer, a map per token).",
    )
    parser.add_argument("images", nargs="+", help="image files; or one folder: build its concept atlas in --out")
    _add_model_options(parser)
    parser.add_argument("--out", default="explain-out", help="output folder (default: explain-out)")
    parser.add_argument("--alpha", type=float, default=0.5, help="heatmap opacity in [0, 1]")
    parser.add_argument("--cmap", default="jet", help="matplotlib colour map (jet, viridis, cividis, ...)")
    return parser


@contextlib.contextmanager
def escaped_output() -> Iterator[None]:
    """While the command runs, stdout and stderr write what their encoding cannot (a class name's or a file name's
    byte that is not UTF-8, read as a lone surrogate, on a terminal that does not take it back) as a backslash
    escape, instead of failing after the work is done; their way is restored after."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            with contextlib.suppress(ValueError, OSError):  # a closed or detached stream is left as it is
                stream.reconfigure(errors="backslashreplace")
                changed.append(stream)
    try:
        yield
    finally:
        for stream in changed:
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="strict")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with escaped_output():
        return _main(argv)


def _main(argv: list[str]) -> int:
    try:
        if argv and argv[0] == "demo":
            parser = Parser(prog="explain demo", description=run_demo.__doc__)
            parser.add_argument("--out", default="explain-demo.png",
                                help="the figure to write (default explain-demo.png); with --debugging a folder")
            parser.add_argument("--count", type=positive_int, default=6,
                                help="how many held-out images (default 6; with --debugging 400)")
            parser.add_argument("--model", default="demo", choices=sorted(DEMO_METHODS),
                                help="demo (the shipped CNN, Grad-CAM), demo-vit (the shipped transformer, "
                                "gradient-weighted attention rollout) or demo-vit2 (the second, transformer "
                                "attribution)")
            parser.add_argument("--debugging", action="store_true",
                                help="model debugging over a data set instead: held-out images of a model trained "
                                "with a watermark on one class, explained (LRP, labels from the folders), its "
                                "strategies found (SpRAy) and an HTML report; --out is then a folder (default "
                                "explain-debugging), --count the number of images (default 400)")
            arguments = parser.parse_args(argv[1:])
            if arguments.debugging:
                from .data.debugging import describe, run_debugging_demo

                out = "explain-debugging" if arguments.out == "explain-demo.png" else arguments.out
                count = 400 if "--count" not in argv else arguments.count
                print(describe(run_debugging_demo(out, count)))
                return 0
            run_demo(arguments.out, arguments.count, arguments.model)
            return 0
        if argv and argv[0] == "strategies":
            return run_strategies(argv[1:])
        if argv and argv[0] == "evaluate":
            return run_evaluate(argv[1:])
        if argv and argv[0] == "concepts":
            return run_concepts(argv[1:])
        if argv and argv[0] == "vlm":
            return run_vlm(argv[1:])
        if argv and argv[0] == "methods":
            parser = Parser(prog="explain methods", description="List the methods, or describe one.")
            parser.add_argument("name", nargs="?", help="a method: its options, defaults and meaning")
            parser.add_argument("--verbose", "-v", action="store_true", help="each method's options and defaults")
            arguments = parser.parse_args(argv[1:])
            print(describe_method(arguments.name) if arguments.name else list_methods(arguments.verbose))
            return 0
        if argv and argv[0] == "batch":
            return run_batch(argv[1:])
        if argv and argv[0] == "report":
            from .dataset_tools.html_report import main_report  # imports the batch module: loaded for this command only

            return main_report(argv[1:])
        if argv and argv[0] == "layers":
            parser = Parser(prog="explain layers", description="List layer names and output shapes.")
            parser.add_argument("model", help="demo, demo-vit, a torchvision name, timm:NAME or hf:ID_OR_DIRECTORY")
            parser.add_argument("--weights", help="a state-dict file or a pretrained name")
            parser.add_argument("--num-classes", type=positive_int, help="classes of a fine-tuned head")
            parser.add_argument("--allow-pickle", action="store_true", help="MODEL is a trusted whole-model file")
            parser.add_argument("--input-size", type=positive_int, nargs=3, metavar=("C", "H", "W"),
                                help="input size (default: the model's own, else 3 224 224)")
            arguments = parser.parse_args(argv[1:])
            loaded = load_model(arguments.model, arguments.weights, num_classes=arguments.num_classes,
                                allow_pickle=arguments.allow_pickle)
            size = arguments.input_size or loaded.input_size or (3, 224, 224)
            print(format_layers(list_layers(loaded.model, size)))
            return 0
        return run_images(_image_parser().parse_args(argv))
    except (ValueError, TypeError, WeightsUnavailableError, LayerNotRunError, ModelInputError) as error:
        print(f"explain: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a missing file or folder, a full disk, no permission to write
        print(f"explain: error: {_os_error_text(error)}", file=sys.stderr)
        return 2


def _os_error_text(error: OSError) -> str:
    """An OSError as a sentence: its message, and the file it is about (no "[Errno 28]")."""
    if error.strerror is None:
        return str(error)
    text = error.strerror
    if error.filename is not None:
        text += f": {os.fsdecode(error.filename)!r}"
    return text


if __name__ == "__main__":
    sys.exit(main())
