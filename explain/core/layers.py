"""List a model's layers with their output shapes, and choose the layer a CAM explains when none is given."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .capture import ModelInputError, _first_line, model_device, model_dtype, preserved_model_state, run_model
from .forward_call import ForwardCall
from .layouts import ModelTokens, infer_layout, model_tokens
from .scope import CallScope

Run = Callable[[Tensor], Any]
"""Runs the model on a batch with its other inputs, as the explainer does (``Explainer.call_model``)."""
OutputShape = Union[torch.Size, list["OutputShape"], dict[Any, "OutputShape"], str]
"""A layer output's shape: a tensor's torch.Size, kept in the nesting of tuples (as lists), lists and
dicts; the type name of anything else."""
Record = Callable[[str, tuple[object, ...], object], None]
"""Called with (module name, positional inputs, output) after each forward of a module."""


@dataclass
class LayerInfo:
    """name as named_modules() spells it; kind: the module's class; output_shapes: one
    torch.Size (or nested list/dict of them) per call in the forward pass, empty when
    the layer did not run."""

    name: str
    kind: str
    output_shapes: list[OutputShape]

    def shape_text(self) -> str:
        if not self.output_shapes:
            return "(not run)"
        text = _shape_text(self.output_shapes[0])
        return text if len(self.output_shapes) == 1 else f"{text} ×{len(self.output_shapes)} calls"


def _shape_text(value: OutputShape) -> str:
    if isinstance(value, torch.Size):
        return "(" + ", ".join(str(size) for size in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_shape_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_shape_text(item)}" for key, item in value.items()) + "}"
    return str(value)


class _OutputHooks(CallScope[None]):
    """While the block runs, ``record(name, args, output)`` is called after each forward of each
    module (in this thread). The only place this file registers hooks; the call scope removes
    them when the block ends, also on an interrupt."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], record: Record):
        super().__init__()
        self.modules, self.record = modules, record

    def setup(self) -> None:
        for name, module in self.modules:
            self.forward_hook(module, lambda module, args, output, name=name: self.record(name, args, output))


def _run(model: nn.Module, batch: Tensor, run: Optional[Run]) -> Any:
    """``run(batch)``, or ``model(batch)`` without one, with the model's failures as ModelInputError."""
    return run(batch) if run is not None else run_model(model, batch)


def list_layers(
    model: nn.Module,
    input_size: Sequence[int] = (3, 224, 224),
    batch_size: int = 1,
    *,
    example: Optional[Tensor] = None,
    forward_args: Sequence[Any] = (),
    forward_kwargs: Optional[dict[str, Any]] = None,
    input_position: int | str = 0,
) -> list[LayerInfo]:
    """Every named module of the model with the output shape(s) it produces when the model runs
    once, in eval mode without gradients, on ``example`` (a model-ready batch, e.g. (N, C, H, W))
    or else on zeros of ``(batch_size, *input_size)``. The model is left as found.

    forward_args, forward_kwargs, input_position: the model's other inputs and where the example
    goes among them, as in ``Explainer.explain``. Raises ModelInputError when the model fails.
    """

    if example is None:
        example = torch.zeros(batch_size, *input_size, device=model_device(model), dtype=model_dtype(model))
    else:
        example = example.to(model_device(model))
        if example.is_floating_point():
            example = example.to(model_dtype(model))
    run: Optional[Run] = None
    if forward_args or forward_kwargs or input_position != 0:
        call = ForwardCall(tuple(forward_args), dict(forward_kwargs or {}), input_position, example.shape[0])
        run = lambda batch: run_model(model, batch, call.arguments(batch))  # noqa: E731
    named = [(name, module) for name, module in model.named_modules() if name]
    infos = {name: LayerInfo(name, type(module).__name__, []) for name, module in named}

    def record(name: str, args: tuple[object, ...], output: object) -> None:
        infos[name].output_shapes.append(_shape_of(output))

    try:
        with _OutputHooks(named, record), preserved_model_state(model), torch.no_grad():
            _run(model, example, run)
    except ModelInputError as error:  # shape asserts of fixed-size models, missing inputs and the like
        cause = error.__cause__ or error
        raise ModelInputError(
            f"the model could not run on an input of shape {tuple(example.shape)}: {_first_line(cause)}. Give "
            "the input size it expects (--input-size C H W, or input_size=(C, H, W)) or an example input "
            "(example=), and its other inputs (forward_args=, forward_kwargs=, input_position=)."
        ) from cause
    return list(infos.values())


def _shape_of(value: object) -> OutputShape:
    """A tensor's torch.Size, kept in the nesting of tuples, lists and dicts; other values' type names."""
    if isinstance(value, Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return [_shape_of(item) for item in value]
    if isinstance(value, dict):
        return {key: _shape_of(item) for key, item in value.items()}
    return type(value).__name__


def format_layers(infos: Sequence[LayerInfo]) -> str:
    """A table: indented name, module class, output shape."""
    rows = [(("  " * info.name.count(".")) + info.name, info.kind, info.shape_text()) for info in infos]
    name_width = max(len(row[0]) for row in rows)
    kind_width = max(len(row[1]) for row in rows)
    return "\n".join(f"{name:<{name_width}}  {kind:<{kind_width}}  {shape}" for name, kind, shape in rows)


# ---------------------------------------------------------------------------- automatic layer choice

POOLING = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AvgPool2d, nn.MaxPool2d)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
NORM_CLASS_NAMES = ("LayerNorm", "RMSNorm", "RmsNorm")
FINGERPRINT_SAMPLES = 1 << 16


@dataclass
class _ModuleRun:
    """What one module did in the forward pass. layout: "channels_first", "channels_last" or
    "tokens" when its output (the first tensor of a tuple or ModelOutput) has the batch's N rows
    and can be drawn as maps with h, w ≥ 2, else None. fingerprint: a 0-dim summary of that output."""

    name: str
    module: nn.Module
    calls: int
    is_tensor: bool
    passes_input_through: bool
    layout: Optional[str]
    fingerprint: Optional[Tensor]
    depends_on_image: bool = True
    reaches_output: bool = True
    too_small: bool = False
    read_by_convention: bool = False
    """A 4-D output read channels-last whose channels equal its width (ConvNeXt's first stage at 384 px: 96 channels
    on 96 × 96): either reading fits, so it is no evidence of a transformer's block."""
    """Whether the output has the batch's rows and a map layout, but h or w below 2 (a last stage at a small input)."""
    bypassed: bool = False
    """Whether the module runs inside a block too small to draw that reaches the image by another path too (a
    branch, a shortcut): its maps would show part of the evidence (``_mark_bypassed``)."""
    on_every_path: bool = True
    """Whether every path from what is explained back to the image passes through the output (False: a residual
    connection written in the forward, or a torch.fx GraphModule's block run module by module, goes around it)."""
    layout_error: Optional[str] = None
    """For a norm (LayerNorm, RMSNorm) whose (N, T, D) tokens cannot be laid out on the input's patch grid: why
    (``explain.core.layouts``' message), so that a transformer given an input of the wrong size is told, not explained
    at a layer before its blocks."""

    @property
    def is_candidate(self) -> bool:
        return (self.calls == 1 and self.is_tensor and self.layout is not None and self.depends_on_image
                and self.reaches_output and not self.bypassed and not self.passes_input_through
                and not isinstance(self.module, POOLING))


def default_layer(model: nn.Module, batch: Tensor, run: Optional[Run] = None, *, whole_score: bool = False) -> str:
    """The layer a CAM explains when none is given: the one a practitioner would pick, found from
    what runs when the model is run on ``batch`` (N, C, H, W) the way the explainer runs it
    (``run(batch)``, with the model's other inputs; ``model(batch)`` without ``run``).

    Candidates are the modules that ran once and output a tensor that
    - has N rows, the batch's (not N × windows or N × patch area, not another input's batch),
    - can be drawn as maps with h, w ≥ 2: (N, C, h, w), (N, h, w, C) or tokens (N, T, D) on the
      input's patch grid, read as ``explain.core.layouts`` reads them for the CAM,
    - changes when the image does (a second run, on a noisy copy, tells: not a position bias,
      not a text tower), is computed rather than passed through (Identity, eval-mode Dropout),
      and is not a pooling layer,
    - reaches what is explained (the output as ``run`` selects it): not an auxiliary head whose output
      goes elsewhere (torchvision's segmentation ``aux_classifier``).

    Transformers. A block is an entry of a Sequential, ModuleList or ModuleDict (the innermost
    such entry, not the stage that holds blocks) whose output is tokens or channels-last maps;
    (N, C, h, w) marks a conv block, as in ConvNeXt. The choice is the first norm (LayerNorm,
    RMSNorm) to run in the last block to finish: ``ln_1`` (torchvision), ``norm1`` (timm),
    ``layernorm_before``, ``layer_norm1`` (HuggingFace), for plain (ViT, DeiT, CLIP) and
    hierarchical (Swin, Segformer's encoder) transformers alike; what runs after the last block
    (final norm, pooling, class-token readout, a decode head) is head. The last block's *output*
    is a poor layer for a ViT: only the class token feeds the head after it, so the gradient there
    is zero on every patch token; at the block's first norm it reaches the patches through the
    block's attention.

    Otherwise (CNNs, and hybrids without such blocks, as LeViT and MobileViT, whose attention
    runs on N × patch-area rows): the last candidate to finish. Global pooling and the classifier
    give no maps, so that is the last stage before them (``layer4`` on a ResNet, ``features`` on
    VGG, DenseNet, MobileNet, EfficientNet and ConvNeXt, ``stages`` or ``final_conv`` in timm); a
    container finishes after its children, so a stage wins over its last block. Where a block's output is too
    small to draw (h or w below 2: the last stage at a small input), no layer inside it is chosen unless the
    layer is on the block's only path: its branches or shortcut would bypass it (``_mark_bypassed``). Where what is
    explained also reaches the image around that last candidate (a residual sum written in the forward; a torch.fx
    GraphModule, whose blocks never run as modules), no layer is chosen: a ValueError says so and names the layers.

    Dense prediction (the output explained is (N, K, h, w) maps, as a segmentation model's logits) by a model with
    a ``backbone`` child (torchvision's FCN, DeepLabV3 and LRASPP): the last candidate
    inside the backbone, its last stage (``backbone.layer4``, ``backbone.16``). What runs after it is the
    segmentation head, whose last candidate computes the logits themselves (FCN's ``classifier``), not features.

    whole_score: for methods whose attributions sum to the score's change only where the whole score flows through
    the layer (Layer Integrated Gradients, Layer Conductance): in a transformer, the output of the block before the
    last (the last block's input) instead of the last block's first norm, which its residual connection bypasses.

    Raises ModelInputError when the model fails on the batch, ValueError when no layer qualifies.
    """
    runs, dense_output = _trace(model, batch, run)
    _mark_image_dependence(model, batch, run, runs)
    candidates = [module_run for module_run in runs.values() if module_run.is_candidate]
    norm = _last_block_first_norm(model, runs, candidates)
    if norm is not None:
        before = _block_before_the_norms(model, norm, runs) if whole_score else None
        return before if before is not None else norm
    stage = _last_backbone_stage(model, candidates) if dense_output else None
    if stage is not None:
        return stage
    modules = dict(model.named_modules())
    unplaced = [module_run for module_run in runs.values()
                if module_run.layout_error is not None and _block_of(module_run.name, modules) is not None]
    if unplaced:  # a transformer whose tokens do not fit this input: a layer before its blocks would be chosen
        last_block = _block_of(unplaced[-1].name, modules)
        last = next(module_run for module_run in unplaced if _block_of(module_run.name, modules) == last_block)
        raise ValueError(
            f"{str(last.layout_error).rstrip('.')}. A transformer's default layer is its last block's first norm "
            f"({last.name} here), and no layer of its blocks can be drawn on this input, so none is chosen (a "
            "layer before the blocks, such as the patch embedding, would explain almost nothing of the model). "
            "Resize the image to a size the model's patches tile (the size it was trained at: --size S or H W on "
            "the command line, size= in explain.load_model), pass reshape=(h, w) for the patch grid, or name a "
            "layer (--layer, layer=)."
        )
    if not candidates:
        raise ValueError(
            f"no layer gives feature maps of the batch's {batch.shape[0]} images to explain (a spatial "
            "(N, C, h, w), (N, h, w, C) or token (N, T, D) output that depends on the image); pass one "
            "explicitly (`explain layers MODEL` or explain.list_layers(model) lists them with their shapes)."
        )
    if not candidates[-1].on_every_path:
        raise ValueError(_bypassed_message(model, candidates))
    return candidates[-1].name


def _bypassed_message(model: nn.Module, candidates: Sequence[_ModuleRun]) -> str:
    """Why no layer is chosen where what is explained reaches the image around the last candidate, and what to do."""
    last = candidates[-1].name
    through = [module_run.name for module_run in candidates if module_run.on_every_path]
    if isinstance(model, torch.fx.GraphModule):
        why = ("The model is a torch.fx GraphModule, which runs each block's modules one by one: its blocks and "
               "stages (a ResNet's 'layer4') never run as modules, and the module that gives a block's output (the "
               "activation after a residual sum) runs more than once, so no layer that runs once holds a stage's "
               "output. Explain the model as it was before torch.fx.symbolic_trace, or name a layer")
    else:
        why = "Name the layer to explain"
    option = f", or {through[-1]!r}, which every path goes through" if through else ""
    return (f"the last layer that runs once and gives maps, {last!r}, is bypassed: what is explained also reaches "
            "the image by a path around it (a residual connection such as `x + block(x)` written in the forward), "
            f"so its map would show only part of the evidence and no layer is chosen. {why} (layer=, --layer): "
            f"{last!r} for the evidence that goes through it{option}.")


def _trace(model: nn.Module, batch: Tensor, run: Optional[Run]) -> tuple[dict[str, _ModuleRun], bool]:
    """One run of the model on ``batch``: per module, in the order modules first finish, what it did; and whether
    the output explained is dense, (N, K, h, w) maps of the batch's N images with h, w ≥ 2 (segmentation logits)."""
    named = [(name, module) for name, module in model.named_modules() if name]
    modules = dict(named)
    runs: dict[str, _ModuleRun] = {}
    count, input_size = batch.shape[0], tuple(batch.shape[-2:])

    graph_nodes: dict[str, Any] = {}  # the autograd node of each map-like output, while the run's graph lives
    small_nodes: dict[str, Any] = {}  # the same for outputs too small to draw
    tokens = model_tokens(model)  # read once, not in each module's hook

    def record(name: str, args: tuple[object, ...], output: object) -> None:
        if name in runs:
            runs[name].calls += 1
            return
        main = _main_tensor(output)
        grid = None if main is None else _map_grid(main, modules[name], count, input_size, tokens)
        layout = None if grid is None or min(grid[1:]) < 2 else grid[0]
        if main is not None and layout is not None and main.grad_fn is not None:
            graph_nodes[name] = main.grad_fn
        if main is not None and grid is not None and layout is None and main.grad_fn is not None:
            small_nodes[name] = main.grad_fn
        runs[name] = _ModuleRun(
            name, modules[name], calls=1, is_tensor=isinstance(output, Tensor),
            passes_input_through=_passes_input_through(modules[name], args, output), layout=layout,
            fingerprint=None if main is None or layout is None else _fingerprint(main.detach()),
            too_small=grid is not None and layout is None,
            read_by_convention=(layout == "channels_last" and main is not None and main.dim() == 4
                                and main.shape[1] == main.shape[3]),
            layout_error=None if grid is not None or main is None else _token_layout_error(
                main, modules[name], name, count, input_size, tokens),
        )

    inputs = batch.detach().requires_grad_(batch.is_floating_point())
    with _OutputHooks(named, record), preserved_model_state(model), torch.enable_grad(), _graph_without_tensors():
        output = _run(model, inputs.clone(), run)  # a copy: a model may edit its input in place
    reached = _graph_ancestors(output)
    if reached:  # what is explained depends on the image: a map-like output that it does not descend from is not
        for name, node in graph_nodes.items():  # a candidate (an auxiliary head whose output goes elsewhere)
            runs[name].reaches_output = id(node) in reached
        on_every_path = _nodes_on_every_path([tensor.grad_fn for tensor in _tensors_of(output)
                                              if tensor.grad_fn is not None], inputs)
        if on_every_path:  # empty: the output does not reach the image
            for name, node in graph_nodes.items():
                runs[name].on_every_path = id(node) in on_every_path
    _mark_bypassed(runs, graph_nodes, small_nodes, inputs)
    main = _main_tensor(output)
    dense = main is not None and main.dim() == 4 and main.shape[0] == count and min(main.shape[-2:]) >= 2
    return runs, dense


def _last_backbone_stage(model: nn.Module, candidates: Sequence[_ModuleRun]) -> Optional[str]:
    """The last candidate inside the model's ``backbone`` child, or None (no such child, or none of its layers can
    be drawn on this input)."""
    if not isinstance(dict(model.named_children()).get("backbone"), nn.Module):
        return None
    inside = [module_run.name for module_run in candidates
              if module_run.name == "backbone" or module_run.name.startswith("backbone.")]
    return inside[-1] if inside else None


def _mark_bypassed(runs: dict[str, _ModuleRun], graph_nodes: dict[str, Any], small_nodes: dict[str, Any],
                   inputs: Tensor) -> None:
    """Mark the map-like outputs inside a block whose output is too small to draw (a last stage at a small input)
    that the block's output reaches the image without: Inception's branches, a residual block's layers beside its
    shortcut, ShuffleNet's split. A layer on the block's only path (a plain sequence, a whole stage inside a
    wrapper that pools) stays a candidate. Blocks that are containers run their children in sequence: skipped."""
    for block, block_node in small_nodes.items():
        if runs[block].calls != 1 or isinstance(runs[block].module, CONTAINERS):
            continue
        for name, node in graph_nodes.items():
            if name.startswith(block + ".") and _reaches_input_avoiding(block_node, node, inputs):
                runs[name].bypassed = True


def _reaches_input_avoiding(start: Any, avoided: Any, inputs: Tensor) -> bool:
    """Whether the autograd graph leads from node ``start`` back to the leaf ``inputs`` without passing ``avoided``."""
    seen: set[int] = set()
    pending = [start]
    while pending:
        node = pending.pop()
        if node is avoided or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "variable", None) is inputs:
            return True
        pending.extend(parent for parent, _ in node.next_functions if parent is not None)
    return False


def _nodes_on_every_path(roots: list[Any], inputs: Tensor) -> set[int]:
    """The ids of the autograd nodes that every path from ``roots`` back to the leaf ``inputs`` passes through
    (empty where none reaches it). In a topological order of the nodes on such paths, a node is on every path
    exactly when no edge jumps over its position: one walk of the graph, not one per node. A path whose first step
    from the image reduces it to a statistic (``_reads_image_statistic``: its mean colour) carries no maps, and is
    left out: a term of the output computed from it is no residual around a layer."""
    image = _ImageNodes(inputs)

    def parents_of(node: Any) -> list[Any]:
        parents = _all_parents(node)
        return [parent for parent in parents if not (image.holds(parent) and _reads_image_statistic(node, inputs))]

    post_order: list[Any] = []
    reaches: dict[int, bool] = {}
    for root in roots:
        if id(root) in reaches:
            continue
        reaches[id(root)] = False
        stack = [(root, parents_of(root))]
        while stack:
            node, parents = stack[-1]
            # lists, not generators: a generator left suspended is closed later, where an interrupt is lost
            unvisited = ([parent for parent in parents if id(parent) not in reaches] or [None])[0]
            if unvisited is not None:
                reaches[id(unvisited)] = False  # the graph is acyclic: read only once the node is finished
                stack.append((unvisited, parents_of(unvisited)))
                continue
            stack.pop()
            reaches[id(node)] = (getattr(node, "variable", None) is inputs
                                 or any([reaches[id(parent)] for parent in parents]))
            post_order.append(node)
    order = [node for node in reversed(post_order) if reaches[id(node)]]  # from the output towards the image
    if not order:
        return set()
    position = {id(node): index for index, node in enumerate(order)}
    jumps = [0] * (len(order) + 1)  # jumps[p]: edges that start before position p, less those that end there
    for root in roots:  # a virtual root before position 0 leads to every root
        if id(root) in position:
            jumps[0] += 1
            jumps[position[id(root)]] -= 1
    for node in order:
        for parent in parents_of(node):
            if id(parent) in position:
                jumps[position[id(node)] + 1] += 1
                jumps[position[id(parent)]] -= 1
    on_every_path, jumped = set(), 0
    for index, node in enumerate(order):
        jumped += jumps[index]
        if jumped == 0:
            on_every_path.add(id(node))
    return on_every_path


def _all_parents(node: Any) -> list[Any]:
    """The autograd nodes that ``node``'s inputs come from."""
    return [parent for parent, _ in node.next_functions if parent is not None]


def _output_shape(node: Any) -> Optional[tuple[int, ...]]:
    """The shape of the tensor an autograd node's forward operation gave, where torch records it (None otherwise)."""
    metadata = getattr(node, "_input_metadata", None)  # the gradients it takes: one per output of the operation
    try:
        return tuple(int(size) for size in metadata[0].shape) if metadata else None
    except (AttributeError, TypeError, IndexError, RuntimeError):
        return None


def _reads_image_statistic(node: Any, inputs: Tensor) -> bool:
    """Whether ``node``'s operation gives at most one value per channel of each image (the image's mean colour, its
    brightness): read from the image, such a value holds no map."""
    shape = _output_shape(node)
    if shape is None or inputs.dim() < 3 or not shape or shape[0] != inputs.shape[0]:
        return shape is not None and len(shape) == 0 and inputs.dim() >= 3  # a scalar of the whole batch
    per_image = math.prod(shape[1:])
    return per_image <= inputs.shape[1]


class _ImageNodes:
    """Which autograd nodes give the image itself: the leaf ``inputs``, and operations of its shape computed from
    the image alone (copies, casts, a normalisation inside the model), a few steps deep."""

    DEPTH = 8

    def __init__(self, inputs: Tensor):
        self.inputs = inputs
        self.known: dict[int, bool] = {}

    def holds(self, node: Any, depth: int = 0) -> bool:
        if id(node) not in self.known:
            if getattr(node, "variable", None) is self.inputs:
                found = True
            else:
                parents = _all_parents(node)
                found = (depth < self.DEPTH and bool(parents) and _output_shape(node) == tuple(self.inputs.shape)
                         and all([self.holds(parent, depth + 1) for parent in parents]))
            self.known[id(node)] = found
        return self.known[id(node)]


def _graph_without_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Within: autograd records the graph's structure but keeps none of the tensors a backward would
    need (the trace only walks the graph; no backward runs on it), so it costs no activation memory."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, lambda saved: saved)


def _graph_ancestors(output: object) -> set[int]:
    """The ids of the autograd nodes that the tensors of a model output were computed from."""
    reached: set[int] = set()
    pending = [tensor.grad_fn for tensor in _tensors_of(output) if tensor.grad_fn is not None]
    while pending:
        node = pending.pop()
        if id(node) not in reached:
            reached.add(id(node))
            pending.extend(parent for parent, _ in node.next_functions if parent is not None)
    return reached


def _tensors_of(value: object) -> list[Tensor]:
    """The tensors of a model output: a tensor, or those in its (nested) tuples, lists and mappings."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_of(item)]
    if isinstance(value, Mapping):
        return [tensor for item in value.values() for tensor in _tensors_of(item)]
    return []


def _mark_image_dependence(model: nn.Module, batch: Tensor, run: Optional[Run], runs: dict[str, _ModuleRun]) -> None:
    """Run the model once more on a perturbed copy of ``batch`` and mark the outputs that stay the same."""
    if not batch.is_floating_point():
        return
    expected = {name: module_run.fingerprint for name, module_run in runs.items() if module_run.fingerprint is not None}
    compared = [(name, runs[name].module) for name in expected]
    if not compared:
        return
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(batch.shape, generator=generator).to(batch.device, batch.dtype)
    spread = float(batch.detach().float().std()) if batch.numel() > 1 else 0.0
    perturbed = batch.detach() + noise * (spread if 0.0 < spread < float("inf") else 1.0)
    fingerprints: dict[str, Tensor] = {}

    def record(name: str, args: tuple[object, ...], output: object) -> None:
        main = _main_tensor(output)
        if name not in fingerprints and main is not None:
            fingerprints[name] = _fingerprint(main)

    try:
        with _OutputHooks(compared, record), preserved_model_state(model), torch.no_grad():
            _run(model, perturbed, run)
    except ModelInputError:  # a model that refuses the noisy copy (a range check): no layer is ruled out
        return
    names = [name for name, _ in compared if name in fingerprints]
    if names:
        before = torch.stack([expected[name] for name in names])
        after = torch.stack([fingerprints[name].to(before.device) for name in names])
        changed = (before - after).abs() > 1e-6 * torch.maximum(before.abs(), after.abs())
        for name, depends in zip(names, changed.tolist()):
            runs[name].depends_on_image = depends


def _last_block_first_norm(
    model: nn.Module, runs: dict[str, _ModuleRun], candidates: list[_ModuleRun]
) -> Optional[str]:
    """The first norm of the last transformer block (see ``default_layer``), or None."""
    modules = dict(model.named_modules())
    first_norms: dict[str, str] = {}  # block → its first norm, in the order the norms ran
    for candidate in candidates:
        if candidate.layout in ("tokens", "channels_last") and _is_norm(candidate.module) \
                and not candidate.read_by_convention:
            block = _block_of(candidate.name, modules)
            if block is not None and block not in first_norms:
                first_norms[block] = candidate.name
    blocks = [
        block for block in first_norms
        if block in runs and runs[block].calls == 1 and runs[block].layout in ("tokens", "channels_last")
        and not runs[block].read_by_convention
        and not any(other.startswith(block + ".") for other in first_norms)  # a stage holding blocks
    ]
    if not blocks:
        return None
    order = {name: index for index, name in enumerate(runs)}
    last = max(blocks, key=lambda block: order[block])
    return first_norms[last]


def _block_before_the_norms(model: nn.Module, norm: str, runs: dict[str, _ModuleRun]) -> Optional[str]:
    """The block before the one holding ``norm`` in their container (its input, where each block feeds the next),
    if it ran once and is a candidate; None otherwise (the first block, blocks that are not a chain)."""
    modules = dict(model.named_modules())
    block = _block_of(norm, modules)
    if block is None:
        return None
    parent, _, own = block.rpartition(".")
    siblings = [name for name, _ in modules[parent].named_children()]
    index = siblings.index(own)
    if index == 0:
        return None
    before = f"{parent}.{siblings[index - 1]}" if parent else siblings[index - 1]
    found = runs.get(before)
    return before if found is not None and found.is_candidate and found.calls == 1 else None


def _block_of(name: str, modules: dict[str, nn.Module]) -> Optional[str]:
    """The nearest strict ancestor of ``name`` that is an entry of a Sequential, ModuleList or
    ModuleDict (a repeated unit of the model), or None."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if isinstance(modules[".".join(parts[: end - 1])], CONTAINERS):
            return ".".join(parts[:end])
    return None


def _passes_input_through(module: nn.Module, args: tuple[object, ...], output: object) -> bool:
    """Whether the module returned its input as it was (Identity, eval-mode Dropout); an in-place
    activation returns its input too, but changed."""
    return bool(args) and output is args[0] and not getattr(module, "inplace", False)


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm or RMSNorm (torch's, or a library's of that name)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(NORM_CLASS_NAMES)


def _main_tensor(output: object) -> Optional[Tensor]:
    """The output itself when it is a tensor, else the first item of a tuple, list or mapping
    (HuggingFace ModelOutput) when that is a tensor."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        first = output[0]
    elif isinstance(output, Mapping) and output:
        first = next(iter(output.values()))
    else:
        return None
    return first if isinstance(first, Tensor) else None


def _map_grid(tensor: Tensor, module: nn.Module, count: int, input_size: Sequence[int],
              tokens: Optional[ModelTokens]) -> Optional[tuple[str, int, int]]:
    """(layout kind, h, w) as a CAM would read the module's output ``tensor`` (of a model stating ``tokens``)
    when the tensor has ``count`` rows and lays out as maps, else None. Maps are drawable where h, w ≥ 2."""
    if (tensor.dim() not in (3, 4) or tensor.shape[0] != count or not tensor.is_floating_point()
            or tensor.layout != torch.strided):
        return None
    try:
        layout = infer_layout(tensor, input_size, module=module, model=tokens)
    except ValueError:
        return None
    if layout.kind == "tokens":
        assert layout.grid is not None, "a token layout is made with its grid"
        height, width = layout.grid
    elif layout.kind == "channels_last":
        height, width = tensor.shape[1:3]
    else:
        height, width = tensor.shape[2:]
    return layout.kind, int(height), int(width)


def _token_layout_error(tensor: Tensor, module: nn.Module, name: str, count: int, input_size: Sequence[int],
                        tokens: Optional[ModelTokens]) -> Optional[str]:
    """Why the (N, T, D) tokens a norm outputs cannot be laid out on the input's patch grid (``infer_layout``'s
    message), where the model states a vision transformer's tokens (``model_tokens``: a CNN with a sequence model
    on top keeps its own default layer); None for any other module or output, and for tokens that can."""
    if (tokens is None or not _is_norm(module) or tensor.dim() != 3 or tensor.shape[0] != count
            or not tensor.is_floating_point() or tensor.layout != torch.strided):
        return None
    try:
        infer_layout(tensor, input_size, name=name, module=module, model=tokens)
    except ValueError as error:
        return str(error)
    return None


def _fingerprint(tensor: Tensor) -> Tensor:
    """A 0-dim summary that changes when the tensor does: a fixed pseudo-random weighting of up to
    FINGERPRINT_SAMPLES evenly spread elements (a plain sum would not do: a LayerNorm's output sums
    to the same value for every input)."""
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)].float()
    weights = torch.arange(sample.numel(), device=sample.device, dtype=torch.float32).mul_(0.6180339887).frac_()
    return torch.dot(sample, weights)
