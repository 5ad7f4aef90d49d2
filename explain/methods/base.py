"""The pipeline every method shares: inputs → model → targets → method's maps → Explanation."""

from __future__ import annotations

import inspect
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import (
    Any,
    Callable,
    ClassVar,
    Generic,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    TypeVar,
    overload,
)

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.call_record import PassRecord, call_passes
from ..core.caller import warn_at_callers_line
from ..core.capture import (
    ModelInputError,
    check_hookable,
    eager_model,
    is_out_of_memory,
    model_device,
    model_dtype,
    model_input_channels,
    run_model,
)
from ..core.checks import check, deferred_checks
from ..core.forward_call import ForwardCall, PerImage
from ..core.memory_format import channels_last_copies, may_be_layout_error, model_batch, usual_layout_only
from ..core.scope import CallScope
from ..core.targets import (
    OutputSelector,
    Target,
    class_indices_for_names,
    model_class_names,
    select_output,
)
from ..core.units import bind_units
from ..detection.candidates import check_detector, unclipped_box_gradients
from ..detection.instances import InstanceSpec, InstanceTarget, detect
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec, as_preprocess, prepare_inputs
from ..io.loaded_model import ModelSource, loaded_model_parts
from ._eval_batch_norm import contiguous_batch_norm_gradients, warn_of_batch_statistics
from .maps import (
    NORMALIZATIONS,
    Attribution,
    checked_map_extremes,
    map_extremes,
    normalize_maps,
    upsample_maps,
    warn_about_empty_maps,
    without_graph,
)
from .options import probabilities_option
from .passes import PROGRESS_THRESHOLD, check_parameters_usable, out_of_memory_error, reduced_precision, rows_per_pass
from .signatures import document_options, setting_text

Result = TypeVar("Result")


_progress_bars = threading.local()
"""``open``: how many explainers' progress bars this thread has open (an inner call shows none)."""




def warn_about_precision(explainer: "Explainer", precision: Optional[str], instances: bool = False) -> None:
    """One RuntimeWarning when a method whose maps are made of per-pixel gradients
    (``reads_pixel_gradients``) ran in reduced precision: those gradients carry its rounding, which no sum
    in float32 can take back (CAMs average gradients over a layer and change by ≤ 0.02: no warning). instances:
    the call differentiated detected instances' class scores, probabilities that round to 1 (so their gradient
    to 0) in reduced precision: any gradient method warns."""
    if precision is None or not (explainer.reads_pixel_gradients() or instances):
        return
    method = explainer.method_name
    bits = 8 if precision.startswith('bfloat16') else 11
    if instances and not explainer.reads_pixel_gradients():
        reason = (f"a detected instance's class score is a probability, and one above 1 − 2^-{bits} rounds to 1, "
                  "whose gradient is 0: its map can be empty or change entirely (by up to its maximum on a small "
                  "test detector)")
    else:
        reason = ("per-pixel gradients, and maps made of them, differ from the float32 model's (on the shipped demo "
                  "CNN by up to 0.2 of the map's maximum for saliency and guided backprop, 0.1 for Integrated "
                  "Gradients and SmoothGrad, against ≤ 0.02 for Grad-CAM)")
    warn_at_callers_line(
        f"{method} ran in {precision}: the model's forward and backward passes round to {bits} significant bits, so "
        f"{reason}. The sums over steps and samples are kept in float64 and the maps returned in float32. For "
        "float32 maps, call explain outside torch.autocast, or on a float32 copy of the model (model.float()).",
        RuntimeWarning)


Value = TypeVar("Value")


class PerThread(Generic[Value]):
    """An explainer attribute that each thread sees on its own: the state of the call in progress
    (the model's other inputs, layouts), so that one explainer can serve several threads."""

    def __init__(self, default: Optional[Value] = None):
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, explainer: None, owner: type) -> PerThread[Value]: ...

    @overload
    def __get__(self, explainer: Explainer, owner: Optional[type] = None) -> Optional[Value]: ...

    def __get__(self, explainer: Optional[Explainer], owner: Optional[type] = None) -> PerThread[Value] | Value | None:
        if explainer is None:
            return self
        return getattr(explainer._thread_state, self.name, self.default)

    def __set__(self, explainer: Explainer, value: Optional[Value]) -> None:
        setattr(explainer._thread_state, self.name, value)


class Explainer(ABC):
    """Base class of every method: ``Method(model, ...).explain(inputs, target=...)``.

    model: any ``nn.Module``; it is run in eval mode during a call and left exactly
        as found afterwards (modes, flags, hooks), also when the call raises.
    preprocess: turns an RGB image (PIL) into model input: a callable (torchvision's
        ``weights.transforms()``) or a HuggingFace image processor; default: ImageNet mean/std
        normalisation with the size kept. Tensors are taken as model input and skip it. For a model whose
        first convolution takes 1 channel, images are grayscale (PIL mode "L"; the default normalisation's
        statistics averaged over the channels) and colour images are refused.
    normalize: "max" (default: each map divided by its largest |value|, so maps lie in [0, 1],
        signed ones in [-1, 1]), "minmax" ([0, 1]) or None (raw values).
    class_names: names of the model's classes, for titles.
    output: which part of the model's output holds the scores when it is not a plain tensor
        (a key, an index or a callable); None picks it automatically (see ``select_output``).
    progress: a progress bar for calls that run many passes through the model (path points, noisy
        copies, perturbed inputs): True, False, or None (default: when a call needs more than
        ``PROGRESS_THRESHOLD`` passes). A call made inside another's bar shows none of its own.
    probabilities: how ``Explanation.probabilities`` come from the class scores: "softmax" (over the classes,
        for a single-label classifier) or "sigmoid" (each class's own, for a multi-label one); a one-logit
        model's is the sigmoid either way. None (default): "softmax", or a wrapped explainer's option.
    """

    name: ClassVar[str] = ""
    """Registry name, as the command line's ``--method`` takes it."""
    needs_layer: ClassVar[bool] = False
    """Whether the constructor takes a target layer after the model (CAM methods)."""
    uses_gradients: ClassVar[bool] = True
    """Whether the method differentiates the model's scores (False: perturbations, attention, D-RISE)."""
    explains_instances: ClassVar[bool] = False
    """Whether the method explains detected instances only (``explain(image, instances=...)`` on a detector: ODAM,
    D-RISE); the others explain classes and, on detectors, instances too."""
    scores_are_outputs: ClassVar[bool] = True
    """Whether ``Explanation.scores`` are the model's (selected) outputs for the classes explained (Finer-CAM's are
    its contrastive scores)."""
    summary: ClassVar[str] = ""
    """One line for ``explain methods``."""
    records_the_forward: ClassVar[bool] = True
    """Whether the method hooks the model's modules or changes how its functions compute during a call,
    which code compiled in place (``module.compile()``) would skip: such a model is refused (see
    ``explain.core.capture.eager_model``). False for methods that only differentiate the output."""
    _forward_call: PerThread[ForwardCall] = PerThread()
    """The model's other inputs during a call (None for a model with one input)."""

    def __init__(
        self,
        model: ModelSource,
        *,
        preprocess: PreprocessSpec = None,
        normalize: Optional[str] = "max",
        class_names: Optional[Sequence[str]] = None,
        output: OutputSelector = None,
        progress: Optional[bool] = None,
        probabilities: Optional[str] = None,
    ):
        model, preprocess, class_names, output = loaded_model_parts(model, preprocess, class_names, output)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
        check_hookable(model)
        # torch.compile(model): the module it wraps; code compiled in place only where nothing is recorded
        model = eager_model(model, type(self).__name__, compiled_code_runs=not self.records_the_forward)
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
        self.model = model
        self.preprocess = as_preprocess(preprocess, model)
        self.normalize = normalize
        if isinstance(class_names, str) or not (class_names is None or isinstance(class_names, Sequence)):
            raise TypeError(f"class_names must be a list of names, one per class (index i: class i's name); got "
                            f"{type(class_names).__name__}.")
        self.class_names = class_names if class_names is not None else model_class_names(model)
        self.output = output
        if progress not in (None, True, False):
            raise ValueError(f"progress must be True, False or None (on long calls); got {progress!r}.")
        self.progress = progress
        self.probabilities = probabilities_option(probabilities)
        if self.probabilities == "sigmoid":
            self._check_sigmoid_scores()
        self.rows_that_fit: dict[str, int] = {}
        """Per device, the rows per pass that fitted in memory after a pass ran out of it (see
        ``row_passes``); later calls start there."""
        self._thread_state = threading.local()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        document_options(cls)

    setting_attributes: ClassVar[Mapping[str, str]] = {}
    """Options kept under another attribute name (option → attribute), for ``settings``."""

    def settings(self) -> dict[str, str]:
        """What the explainer computes with, as short texts that are the same in every process: each constructor
        option it keeps (under the option's name or ``setting_attributes``) except those that do not change a map
        (``class_names``, ``progress``, ``probabilities``), and the explainers it wraps. Two explainers of one class
        with equal settings compute the same maps; ``explain.evaluate`` and ``explain.run`` record them so that a
        resumed run never mixes two settings of a method."""
        texts = {}
        for option in inspect.signature(type(self)).parameters:
            attribute = self.setting_attributes.get(option, option)
            if option not in ("model", "class_names", "progress", "probabilities") and attribute in self.__dict__:
                texts[option] = setting_text(self.__dict__[attribute])
        for attribute, value in self.__dict__.items():
            if isinstance(value, Explainer) and attribute not in texts:
                texts[attribute] = setting_text(value)
        return texts

    def probability_function(self) -> str:
        """How this explainer's probabilities come from the class scores: its ``probabilities`` option, or where it
        was not given the option of the explainers it wraps ("softmax" where none was given one)."""
        return self._given_probabilities() or "softmax"

    def _given_probabilities(self) -> Optional[str]:
        """The ``probabilities`` option given to this explainer or to one it wraps (None: to none of them); a
        ValueError where a wrapper and an explainer it wraps were given different ones."""
        given = {value._given_probabilities() for value in self.__dict__.values() if isinstance(value, Explainer)}
        given.discard(None)
        if self.probabilities is None:
            if len(given) > 1:
                raise ValueError(f"the explainers that {self.method_name} wraps were given different probabilities= "
                                 f"({', '.join(sorted(map(repr, given)))}); give them the same.")
            return next(iter(given), None)
        different = given - {self.probabilities}
        if different:
            raise ValueError(f"{self.method_name} was given probabilities={self.probabilities!r} and the explainer it "
                             f"wraps probabilities={different.pop()!r}; give the option to one of them, or the same to "
                             "both.")
        return self.probabilities

    def _check_sigmoid_scores(self) -> None:
        """Refuse probabilities="sigmoid" for a method whose scores are not the model's class scores."""
        if not self.scores_are_outputs:
            raise ValueError(f"{type(self).__name__}'s scores are its own, not the model's class scores, so "
                             "probabilities='sigmoid' cannot be taken from them; leave probabilities out (the "
                             "softmax over the model's classes).")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_thread_state"]  # per-call state (copy.deepcopy, pickle) is not copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("rows_that_fit", {})
        self.__dict__.setdefault("probabilities", None)  # pickled before the option
        self._thread_state = threading.local()

    def row_passes(self, rows: int, batch_size: Optional[int], device: torch.device,
                   compute: Callable[[slice], Result], row_values: Optional[int] = None
                   ) -> Iterator[tuple[slice, Result]]:
        """Run ``compute`` on consecutive slices of ``range(rows)``, ``rows_per_pass`` at a time (rows of
        ``row_values`` input values each, when given), yielding (slice, its result) in order. ``compute`` must only
        compute: the caller adds up the results, so that a pass can be run again.

        With ``batch_size`` None, a pass that runs out of memory is run again with half its rows (down to
        one), and the explainer remembers the largest pass that fitted for its later calls on the device
        (``rows_that_fit``). A ``batch_size`` given by the caller is kept: running out of memory then
        raises, with a hint.
        """
        per_pass = rows_per_pass(batch_size, device, row_values)
        if batch_size is None:
            per_pass = min(per_pass, self.rows_that_fit.get(str(device), per_pass))
        with self.progress_bar(-(-rows // per_pass), rows, "row") as bar:
            largest_fitted = 0
            start = 0
            while start < rows:
                chunk = slice(start, min(start + per_pass, rows))
                tried = chunk.stop - chunk.start
                failed = False
                try:
                    result = compute(chunk)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    if batch_size is not None or tried == 1:
                        advised = out_of_memory_error(error, self.method_name, device, tried, batch_size)
                        if advised is error:
                            raise
                        raise advised from error
                    failed = True  # run again below, once the error's frames (and their tensors) are released
                if failed:
                    per_pass = tried // 2
                    self.rows_that_fit[str(device)] = max(per_pass, largest_fitted)
                    continue
                largest_fitted = max(largest_fitted, tried)
                bar.update(tried)
                yield chunk, result
                start = chunk.stop

    @contextmanager
    def progress_bar(self, passes: int, total: int, unit: str) -> Iterator[tqdm]:
        """A tqdm bar of ``total`` units for a call of ``passes`` passes, shown as ``progress`` says
        (None: when passes > ``PROGRESS_THRESHOLD``), never inside another explainer's bar in this thread."""
        show = self.progress if self.progress is not None else passes > PROGRESS_THRESHOLD
        nested = getattr(_progress_bars, "open", 0) > 0
        with progress_shown_by_caller(), tqdm(total=total, desc=self.method_name, unit=unit,
                                              disable=not show or nested, leave=False) as bar:
            yield bar

    def call_model(self, inputs: Tensor, rows: Optional[Tensor] = None) -> Any:
        """The model's scores for a batch: its forward pass (with the call's other arguments), then
        the output selector. rows: for a batch of copies, the image each row is a copy of.

        The model gets a copy of the batch (inside the autograd graph when it requires grad): a
        model that edits its input in place changes neither the caller's tensor nor the batch
        that the method's other forward passes use. The copy is channels-last where that runs
        faster (``explain.core.memory_format``)."""
        inputs = model_batch(self.model, inputs)
        call = self._forward_call
        record: Optional[PassRecord] = getattr(call_passes, "record", None)
        try:
            if call is None:
                output = run_model(self.model, inputs)
            else:
                if rows is not None:
                    call = call.for_rows(rows)
                output = run_model(self.model, inputs, call.arguments(inputs))
        except ModelInputError as error:
            if record is None or error.model_error is None:
                raise
            failure = record.failure(error, inputs)
            if failure is error:
                raise
            raise failure from error.model_error
        if record is not None:
            record.ran(inputs)
        scores = select_output(output, self.output)
        self._check_class_names(scores)
        return scores

    def _check_class_names(self, scores: Any) -> None:
        """Warn, once per call, when the model's (N, C) class scores have another number of columns than
        ``class_names`` has names: each map would be titled with another class's name."""
        names = self.class_names
        if names is None or not isinstance(scores, Tensor) or scores.dim() != 2:
            return
        if getattr(self._thread_state, "class_names_checked", False):
            return
        self._thread_state.class_names_checked = True
        if scores.shape[1] == len(names):
            return
        binary = (" A one-logit binary model's score is its positive class: give that class's name alone."
                  if scores.shape[1] == 1 else "")
        warn_at_callers_line(
            f"the model's scores have {scores.shape[1]} classes and class_names has {len(names)} names, so the "
            f"maps' class names are not the model's classes. Pass class_names= with one name per output class, "
            f"in the order of the model's outputs.{binary}")

    @property
    def method_name(self) -> str:
        return type(self).__name__

    def reads_pixel_gradients(self) -> bool:
        """Whether the maps are made of per-pixel (or per-unit) gradients, which a model computing in
        reduced precision changes materially (see ``warn_about_precision``); CAMs average theirs."""
        return False

    def explain(
        self,
        inputs: Inputs,
        target: Target = None,
        *,
        topk: Optional[int] = None,
        forward_args: Sequence[Any] = (),
        forward_kwargs: Optional[dict[str, Any]] = None,
        input_position: int | str = 0,
        per_image: Optional[PerImage] = None,
        instances: Optional[InstanceSpec] = None,
    ) -> Explanation:
        """Explain N images for one or K targets each.

        inputs: a path, PIL image, (H, W, 3) ndarray, (C, H, W) or (N, C, H, W)
            tensor, or a list of these (see ``explain.io.inputs``).
        target: None (top-1 class), an int, one int per image, K ints per image,
            a callable ``f(output) -> Tensor[N]`` (see ``explain.core.targets``), or a hidden unit
            (``explain.Channel``, ``explain.Neuron``).
        topk: explain each image's k highest-scoring classes.
        forward_args, forward_kwargs: the model's other inputs, for models with several; the
            explained batch goes at ``input_position`` (an index among the positional arguments,
            or a keyword name).
        per_image: which of those inputs hold one row per image (positions in ``forward_args``,
            names in ``forward_kwargs``): a method that runs copies of the images gives each copy
            its image's row of these, and the whole of the others. ``[]``: all shared (CLIP's
            prompts). Needed by such methods when a tensor input has N rows, where it could be either.
        instances: for a detector (torchvision, a transformers DETR-style model, an Ultralytics YOLO DetectionModel,
            or a model returning {"boxes", "scores"}): explain detected instances, one map each: "all", an int k
            (the k highest-scoring), a score threshold in (0, 1), boxes, or ``explain.detection.Instances`` (see
            ``explain.detection.InstanceSpec``). Each instance is found again in every forward pass the method
            makes (``explain.detection.InstanceTarget``); the Explanation's ``boxes`` hold their boxes. Not with
            ``target`` or ``topk``.
        Returns an Explanation whose maps are (N, H, W), or (N, K, H, W) for K targets per image.
        """
        if instances is not None:
            check_detector(self.model)  # before the scope changes anything (the YOLO wrapper's train() trains)
        scope = CallScope(self.model)
        with scope, deferred_checks() as checks:  # the checks of values: one host sync, at the end of the call
            scope.add_undo(self._per_thread_state_restorer())  # added first: undone last, after every other undo
            if torch.is_inference_mode_enabled():  # the caller's inference_mode(): no graph could be built
                scope.enter(torch.inference_mode(False))
            device = model_device(self.model)
            prepared = prepare_inputs(inputs, self.preprocess, device, model_dtype(self.model),
                                      channels=model_input_channels(self.model))
            outer_call = self._forward_call  # this explainer's call in progress, when it is called inside it
            outer_passes = getattr(call_passes, "record", None)
            call_passes.record = PassRecord(prepared.batch.shape[0], tuple(prepared.batch.shape[1:]))
            scope.add_undo(lambda: setattr(call_passes, "record", outer_passes))
            probability_function = self.probability_function()
            if probability_function == "sigmoid":
                self._check_sigmoid_scores()  # a wrapper taking a wrapped explainer's option
            self._thread_state.class_names_checked = False  # once per call (``_check_class_names``)
            scope.add_undo(lambda: setattr(self, "_forward_call", outer_call))
            self._forward_call = ForwardCall.stated(forward_args, {} if forward_kwargs is None else forward_kwargs,
                                                    input_position, prepared.batch.shape[0], per_image)
            modules = list(self.model.modules())
            scope.eval_mode(self.model, modules)
            scope.without_gradient_checkpointing(self.model, modules)
            warn_of_batch_statistics(scope, modules)
            if device.type == "cpu":  # torch's CPU BatchNorm backward (see _eval_batch_norm)
                self.guard_batch_norm_gradients(scope, modules)
            if instances is not None:
                if target is not None or topk is not None:
                    raise ValueError("give instances= (detected instances) or target= / topk=, not both.")
                target = self.instance_target(prepared.batch, instances)
            elif isinstance(target, InstanceTarget):
                target = target.for_call()  # its counts of missing instances are this call's
            target = class_indices_for_names(target, self.class_names)
            target = bind_units(target, self.model, scope)  # a Channel / Neuron: its layer recorded for the call
            try:
                attribution = self._attribute_in_a_layout_the_model_takes(scope, prepared.batch, target, topk)
            except Exception as error:
                checks.run()  # a check that fails (a NaN input or score) is the cause to report
                if isinstance(error, RuntimeError):
                    check_parameters_usable(self.model, error)  # parameters made in inference mode: say so
                raise
            raw = upsample_maps(without_graph(attribution.maps), prepared.batch.shape[-2:])
            extremes = map_extremes(raw, self.normalize, attribution.nonnegative_maps, keepdim=True)
            empty: list[bool] = []
            check(extremes, lambda values: empty.extend(checked_map_extremes(values, extremes.shape, self.normalize,
                                                                             self.method_name)))
            checks.run()
            if any(empty) and not getattr(self._thread_state, "empty_maps_expected", False):
                every_empty_map = torch.tensor(empty).view(raw.shape[:2])
                empty_maps: Optional[Tensor] = every_empty_map
                if isinstance(target, InstanceTarget):  # padding (an image with fewer instances) is empty by design
                    empty_maps = self._without_padding(every_empty_map, attribution, target)
                if empty_maps is not None:
                    warn_about_empty_maps(empty_maps, attribution, self.method_name)
            if self.reads_pixel_gradients() or (isinstance(target, InstanceTarget) and self.uses_gradients):
                warn_about_precision(self, reduced_precision(self.model, prepared.batch, modules),
                                     instances=isinstance(target, InstanceTarget))
            selected = attribution.selected
            boxes, class_indices = None, selected.class_indices
            scores, probabilities = without_graph(selected.scores).float(), selected.probabilities
            if isinstance(target, InstanceTarget):
                target.warn_about_missing(self.method_name)
                boxes, class_indices = target.explained_boxes(), target.instances.classes
            elif probability_function == "sigmoid" and probabilities is not None and class_indices is not None:
                probabilities = scores.sigmoid()  # the scores are the explained classes' logits (scores_are_outputs)
            return Explanation(
                map_grid=normalize_maps(raw, self.normalize, extremes),
                raw_map_grid=raw,
                scores=scores,
                class_indices=class_indices,
                display=prepared.display,
                method=self.method_name,
                layer=attribution.layer,
                keep_target_dim=selected.keep_target_dim,
                low_res_maps=attribution.low_res_maps,
                probabilities=probabilities,
                probability_function=probability_function,
                attributions=(None if attribution.attributions is None
                              else without_graph(attribution.attributions).contiguous()),
                diagnostics=attribution.diagnostics,
                class_names=self.class_names,
                boxes=boxes,
            )

    def _per_thread_state_restorer(self) -> Callable[[], None]:
        """What puts this thread's per-call state (``PerThread`` attributes, flags) of this explainer and of the
        explainers it wraps back as it is now: called when the call ends, also when it raises midway (a bad target, a
        model's error, Ctrl-C), so that no layouts, flags or tensors of the call stay on the explainer after it."""
        saved = [(state, dict(state.__dict__)) for state in self._thread_states()]

        def restore() -> None:
            for state, before in saved:
                state.__dict__.clear()
                state.__dict__.update(before)

        return restore

    def _thread_states(self) -> list[threading.local]:
        """The ``_thread_state`` of this explainer and of every explainer it wraps (attributes, lists or dicts of
        them), each once."""
        states: list[threading.local] = []
        seen: set[int] = set()
        pending: list[Any] = [self]
        while pending:
            value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, Explainer):
                state = value.__dict__.get("_thread_state")
                if state is not None:
                    states.append(state)
                pending.extend(value.__dict__.values())
            elif isinstance(value, (list, tuple)):
                pending.extend(value)
            elif isinstance(value, dict):
                pending.extend(value.values())
        return states

    @staticmethod
    def _without_padding(empty_maps: Tensor, attribution: Attribution, target: InstanceTarget) -> Optional[Tensor]:
        """The empty maps (and empty regions) of instances present, padding left out; None where none is left."""
        present = target.instances.present.cpu()
        if attribution.selected.empty_region is not None:
            attribution.selected.empty_region = attribution.selected.empty_region.cpu() & present
        empty_maps = empty_maps & present
        return empty_maps if bool(empty_maps.any()) else None

    def instance_target(self, batch: Tensor, instances: InstanceSpec) -> InstanceTarget:
        """The target of ``explain(..., instances=...)``: the instances found in ``batch`` (one forward pass without
        a graph), each scored by its class score in every forward pass of the call."""
        with torch.no_grad():
            output = self.call_model(batch)
        return InstanceTarget(detect(self.model, batch, instances, output), self.model, batch.shape[-2:])

    def guard_batch_norm_gradients(self, scope: CallScope, modules: list[nn.Module]) -> None:
        """On the CPU, for the call (``scope``): every BatchNorm module among ``modules`` (the model's) that the call
        differentiates hands its backward a contiguous gradient (``_eval_batch_norm``); here, all of them. A method
        that knows which of them its backward passes can reach may guard those alone."""
        contiguous_batch_norm_gradients(scope, modules)

    def _attribute_in_a_layout_the_model_takes(self, scope: CallScope, batch: Tensor, target: Target,
                                               topk: Optional[int]) -> Attribution:
        """``attribute``, run again in the batch's usual layout when the model refused a channels-last copy. A box
        coordinate of a torchvision detector's instance is differentiated before the detector clips it to the image
        (``unclipped_box_gradients``: clipped to a side, it is a constant, its map empty)."""
        if isinstance(target, InstanceTarget) and target.quantity != "score" and target.family == "torchvision":
            scope.enter(unclipped_box_gradients())
        copies_before = channels_last_copies()
        try:
            return self.attribute(batch, target, topk)
        except (RuntimeError, AssertionError, ValueError) as error:
            if channels_last_copies() == copies_before or not may_be_layout_error(error):
                raise
        scope.enter(usual_layout_only())
        return self.attribute(batch, target, topk)

    @abstractmethod
    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        """The method itself: a prepared (N, C, H, W) batch → raw (N, K, h, w) maps."""


@contextmanager
def progress_shown_by_caller() -> Iterator[None]:
    """Inside: explainers called by this thread show no progress bar of their own (the caller shows one,
    such as an explainer wrapping another, or ``explain.run`` over a dataset)."""
    _progress_bars.open = getattr(_progress_bars, "open", 0) + 1
    try:
        yield
    finally:
        _progress_bars.open -= 1


