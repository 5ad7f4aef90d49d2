"""Time and memory of ``explain.GenerationExplainer`` on LLaVA-shaped models, and an estimate for LLaVA-1.5-7B.

    OMP_NUM_THREADS=1 python benchmarks/vlm_cost.py            # the ladder below: 5–10 minutes on 2 shared cores
    OMP_NUM_THREADS=1 python benchmarks/vlm_cost.py --quick    # three small models, T = 4: about a minute
    python benchmarks/vlm_cost.py --no-write --json out.json    # print (and keep the raw numbers), RESULTS.md alone

The models are LlavaForConditionalGeneration built from configs (random weights, CPU): a CLIP vision tower of a
fixed modest size (hidden 256, 2 layers, patch 14; 336 px: 576 image tokens) and a Llama language model of the
ladder's sizes (head size 64, no grouped-query attention, intermediate = hidden · 11008 / 4096, vocabulary 32000,
as Llama-2). A character tokenizer padded to 32000 tokens stands in for Llama's. The prompt is ``<image>`` and a
22-character question; the answer is given (``answer=``), T characters = T tokens.

Each ladder size runs in a fresh process, which measures one after another, in float32:

- "forward": one no-grad forward over image, prompt and answer, logits at the answer's T + 1 rows (the floor: what
  explain's own forward computes);
- "generate": greedy generation of T tokens (``GenerationExplainer.generate``, with its cache);
- each method "per token" (T targets: one forward, T backward passes over one retained graph), "span" (the whole
  answer as one target, ``spans=[answer]``: one forward, one backward) and "span, frozen weights" (the span with
  the parameters' ``requires_grad`` off for the call: what the forward keeps when no weight gradient is possible);

then, the model cast to bfloat16, the forward and each method's span (for the saved tensors' sizes in half
precision: Llama's RMSNorm and softmax keep float32 copies, so it is not half of float32).

Memory: the peak resident memory during the call (Linux VmHWM, reset before each call through
/proc/self/clear_refs) minus the resident memory just before it, so the weights are not counted; glibc is told to
give every freed block of 64 KiB or more back to the system (``MALLOC_MMAP_THRESHOLD_``), so that one call's peak
does not hide in memory kept from an earlier one. Time: the measured call (or the median of ``--repeats`` more),
divided by a forward timed just before it (the machine is shared; its load drifts).

Fits (``analyse``): memory growth = a · S + b · L·S·H + c · L·H·S² (S the sequence, L layers, H hidden; c: the
(heads, S, S) attention matrices the attention method keeps, heads = H / 64), non-negative least squares; a
method's time in forwards = p + q · f · n for n backward passes, f the language model's share of the forward's
multiply-adds (the backward passes never reach the vision tower). Each fit is also made without the largest model,
predicting it (its error is reported). The 7B estimate applies the fits to LLaVA-1.5-7B's shapes and adds the
weights. Writes the "Vision-language models: cost (CPU)" section at the end of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METHODS = ("input_x_gradient", "attention", "attnlrp")
VOCAB = 32000
HEAD_SIZE = 64
VISION = {"hidden": 256, "intermediate": 1024, "layers": 2, "heads": 4, "patch": 14}
PROMPT = "<image>\nwhat is in the image?"
ANSWER_TEXT = "a small red car parked on a quiet street next to a tree"
MIB = 2 ** 20


@dataclass(frozen=True)
class Size:
    """One language model of the ladder: hidden size, layers, and the image's side in pixels (336: 576 tokens)."""

    hidden: int
    layers: int
    image: int = 336

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_SIZE

    @property
    def intermediate(self) -> int:
        return self.hidden * 11008 // 4096

    @property
    def image_tokens(self) -> int:
        return (self.image // VISION["patch"]) ** 2

    @property
    def label(self) -> str:
        return f"H{self.hidden} L{self.layers} {self.image_tokens} img"


LADDER = (Size(256, 2), Size(512, 4), Size(512, 4, 224), Size(256, 2, 448), Size(1024, 8))
"""The largest last: the leave-one-out check predicts it from the others. 224 / 448 px vary the sequence length."""
QUICK = (Size(128, 2, 224), Size(256, 2, 224), Size(256, 2, 336))
LLAVA_7B = {"hidden": 4096, "layers": 32, "heads": 32, "intermediate": 11008, "image_tokens": 576,
            "parameters": 7_063_427_072}
"""LLaVA-1.5-7B: Llama-2-7B (6.74 B), CLIP ViT-L/14-336 (0.30 B) and the two-layer projector (0.02 B)."""


# ---------------------------------------------------------------------------------------------- models


def tokenizer_of_32000() -> Any:
    """One token per character (``<image>`` one token), the vocabulary padded with unused tokens to 32000."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    characters = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:'\n")
    tokens = ["<pad>", "<s>", "</s>", "<unk>", "<image>"] + characters
    tokens += [f"<unused{index}>" for index in range(VOCAB - len(tokens))]
    tokenizer = Tokenizer(models.WordLevel({token: index for index, token in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"})


def build(size: Size, seed: int = 0) -> tuple[Any, Any]:
    """A LLaVA of ``size`` (random weights, float32, eval mode) and its processor (no chat template)."""
    import torch
    import transformers

    tokenizer = tokenizer_of_32000()
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": size.image},
                                                      crop_size={"height": size.image, "width": size.image})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            patch_size=VISION["patch"], num_additional_image_tokens=1,
                                            vision_feature_select_strategy="default")
    vision = transformers.CLIPVisionConfig(hidden_size=VISION["hidden"], intermediate_size=VISION["intermediate"],
                                           num_hidden_layers=VISION["layers"], num_attention_heads=VISION["heads"],
                                           image_size=size.image, patch_size=VISION["patch"])
    text = transformers.LlamaConfig(hidden_size=size.hidden, intermediate_size=size.intermediate,
                                    num_hidden_layers=size.layers, num_attention_heads=size.heads,
                                    num_key_value_heads=size.heads, vocab_size=VOCAB, max_position_embeddings=4096,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    return model, processor


def multiply_adds(hidden: int, layers: int, intermediate: int, sequence: int, image_tokens: int, logit_rows: int,
                  vision: Optional[dict] = None) -> tuple[float, float]:
    """Multiply-adds of one forward: (the language model's, the vision tower's and projector's). The language model:
    its linear layers, attention (QKᵀ and A·V over the whole (S, S) square, as the kernels compute it) and the
    logits at ``logit_rows`` positions; the backward passes of explain run through this part only."""
    vision = vision or VISION
    linear = sequence * layers * (4 * hidden * hidden + 3 * hidden * intermediate)
    attention = layers * 2 * sequence * sequence * hidden
    v_hidden, v_tokens = vision["hidden"], image_tokens + 1
    tower = vision["layers"] * (v_tokens * (4 * v_hidden ** 2 + 2 * v_hidden * vision["intermediate"])
                                + 2 * v_tokens ** 2 * v_hidden) + image_tokens * 3 * 14 * 14 * v_hidden
    projector = image_tokens * (v_hidden * hidden + hidden * hidden)
    return float(linear + attention + logit_rows * hidden * VOCAB), float(tower + projector)


# ---------------------------------------------------------------------------------------------- one size


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line.split(":")[0]] = int(line.split()[1]) * 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current VmRSS


def measured(call: Callable[[], object], repeats: int, floor: Optional[Callable[[], object]] = None) -> dict:
    """Memory growth of one call (peak minus before, bytes) and its time: the median of ``repeats`` more calls, or
    the measured call's when ``repeats`` is 0. ``floor``: a forward timed just before (the machine is shared: its
    load drifts, so each row is divided by a forward timed next to it)."""
    floor_seconds = None
    if floor is not None:
        started = time.perf_counter()
        floor()
        floor_seconds = time.perf_counter() - started
    gc.collect()
    before, _ = resident()
    reset_peak()
    started = time.perf_counter()
    call()
    first = time.perf_counter() - started
    _, peak = resident()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times) if times else first
    return {"seconds": seconds, "first_seconds": first, "growth": max(peak - before, 0),
            "floor_seconds": floor_seconds if floor_seconds is not None else seconds}


def forwards(result: dict, name: str) -> float:
    """A row's time in forwards: over the forward timed just before it."""
    row = result["rows"][name]
    return row["seconds"] / row["floor_seconds"]


def measure_size(size: Size, answer_tokens: int, repeats: int) -> dict:
    """Every measurement of one ladder size (run in a fresh process): float32, then bfloat16 (memory only)."""
    import torch

    from explain.vlm.generation import GenerationExplainer

    model, processor = build(size)
    parameters = sum(p.numel() for p in model.parameters())
    image = np.random.default_rng(0).integers(0, 256, (size.image, size.image, 3), dtype=np.uint8)
    answer = ANSWER_TEXT[:answer_tokens]
    sequence_inputs = processor(images=[image], text=[PROMPT + answer], return_tensors="pt")
    sequence = int(sequence_inputs["input_ids"].shape[1])
    rows: dict[str, dict] = {}

    def forward() -> object:  # the logits of the answer's rows only, as explain computes them
        with torch.no_grad():
            return model(**sequence_inputs, use_cache=False, logits_to_keep=answer_tokens + 1).logits

    def note(name: str) -> None:
        print(f"  {name}: {rows[name]}", file=sys.stderr, flush=True)

    forward()  # warm-up: thread pools, first allocations
    rows["forward"] = measured(forward, repeats)
    note("forward")
    generator = GenerationExplainer(model, processor)
    prepared = generator.prepare(image, PROMPT)
    model.generation_config.min_new_tokens = answer_tokens  # exactly T tokens, end of sequence or not
    generated: list[int] = []
    rows["generate"] = measured(lambda: generated.append(generator.generate(prepared, answer_tokens).numel()),
                                repeats, forward)
    rows["generate"]["tokens"] = generated[0]
    model.generation_config.min_new_tokens = None
    note("generate")
    for method in METHODS:
        explainer = GenerationExplainer(model, processor, method)
        span = functools.partial(explainer.explain, image, PROMPT, answer=answer, spans=[answer])
        per_token = functools.partial(explainer.explain, image, PROMPT, answer=answer)
        rows[f"{method} per token"] = measured(per_token, 0, forward)
        note(f"{method} per token")
        rows[f"{method} span"] = measured(span, repeats, forward)
        note(f"{method} span")
        model.requires_grad_(False)
        try:
            rows[f"{method} span, frozen weights"] = measured(span, 0, forward)
        finally:
            model.requires_grad_(True)
        note(f"{method} span, frozen weights")
    floors = [row["floor_seconds"] for row in rows.values()]  # the forward, timed next to every row
    rows["forward"]["seconds"] = rows["forward"]["floor_seconds"] = statistics.median(floors)

    model.to(torch.bfloat16)  # the saved tensors' sizes in half precision (RMSNorm and softmax upcast to float32)
    sequence_inputs["pixel_values"] = sequence_inputs["pixel_values"].to(torch.bfloat16)
    forward()
    rows["forward, bfloat16"] = measured(forward, repeats)
    note("forward, bfloat16")
    for method in METHODS:
        explainer = GenerationExplainer(model, processor, method)
        rows[f"{method} span, bfloat16"] = measured(
            functools.partial(explainer.explain, image, PROMPT, answer=answer, spans=[answer]), 0, forward)
        note(f"{method} span, bfloat16")
    return {"size": asdict(size), "parameters": parameters, "sequence": sequence, "answer_tokens": answer_tokens,
            "threads": torch.get_num_threads(), "rows": rows}


def run_in_fresh_process(size: Size, answer_tokens: int, repeats: int, threads: int) -> Optional[dict]:
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads),
                   "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--one", json.dumps(asdict(size)), str(answer_tokens), str(repeats),
               "--threads", str(threads)]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    if completed.returncode != 0:
        print(f"{size.label}: failed\n{completed.stderr[-3000:]}", flush=True)
        return None
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - started
    print(f"{size.label}: done in {result['process_seconds']:.0f} s", flush=True)
    return result


# ---------------------------------------------------------------------------------------------- fits


def memory_features(layers: int, hidden: int, sequence: int) -> np.ndarray:
    """[S, L·S·H, L·H·S²] (the heads' (S, S) probabilities: L · heads · S² = L·H·S² / 64)."""
    return np.array([sequence, layers * sequence * hidden, layers * hidden * sequence ** 2 / HEAD_SIZE], float)


def nonnegative_least_squares(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """argmin ‖features · c − targets‖ over c ≥ 0, by relative error (each row divided by its target)."""
    from scipy.optimize import nnls

    weights = 1.0 / np.maximum(np.abs(targets), 1e-12)
    scale = np.maximum(np.abs(features).max(axis=0), 1e-30)
    solution, _ = nnls(features * weights[:, None] / scale, targets * weights)
    return solution / scale


def point_features(result: dict) -> tuple[np.ndarray, float, float]:
    """A measured model's memory features, its forward's multiply-adds and the language model's share of them."""
    size = Size(**result["size"])
    features = memory_features(size.layers, size.hidden, result["sequence"])
    language, vision = multiply_adds(size.hidden, size.layers, size.intermediate, result["sequence"],
                                     size.image_tokens, result["answer_tokens"] + 1)
    return features, language + vision, language / (language + vision)


def backward_cost(result: dict, method: str) -> float:
    """q: one more target's time, (per token − span) / (T − 1), in forwards of the language model alone (the
    backward passes do not reach the vision tower)."""
    extra = forwards(result, f"{method} per token") - forwards(result, f"{method} span")
    return extra / max(result["answer_tokens"] - 1, 1) / point_features(result)[2]


def rest_cost(result: dict, method: str) -> float:
    """p: the span's time in forwards less its one backward pass (q · the language model's share)."""
    return forwards(result, f"{method} span") - backward_cost(result, method) * point_features(result)[2]


@dataclass
class Fit:
    """The fitted coefficients of one quantity; ``loo`` the prediction of the last point from the others."""

    coefficients: np.ndarray
    loo_prediction: float
    loo_measured: float

    @property
    def loo_error(self) -> float:
        return self.loo_prediction / self.loo_measured - 1.0


def fit_rows(results: list[dict], features: Callable[[dict], np.ndarray], value: Callable[[dict], float]) -> Fit:
    matrix = np.stack([features(result) for result in results])
    targets = np.array([value(result) for result in results])
    held_out = nonnegative_least_squares(matrix[:-1], targets[:-1])
    return Fit(nonnegative_least_squares(matrix, targets), float(matrix[-1] @ held_out), float(targets[-1]))


def analyse(results: list[dict]) -> dict:
    """Fits over the measured points and the 7B estimate."""
    answer_tokens = results[0]["answer_tokens"]
    fits: dict[str, Fit] = {}
    fits["forward seconds"] = fit_rows(results, lambda r: np.array([point_features(r)[1]]),
                                       lambda r: r["rows"]["forward"]["seconds"])
    memory_rows = [name for name in results[0]["rows"] if name not in ("forward",)]
    for name in ["forward"] + memory_rows:
        fits[f"{name} memory"] = fit_rows(results, lambda r: point_features(r)[0],
                                          lambda r, name=name: float(r["rows"][name]["growth"]))
    share = point_features(results[-1])[2]
    for method in METHODS:
        # explain's time in forwards = p + q · f · (backward passes), f the language model's share of the forward
        backward = fits[f"{method} backward forwards"] = fit_rows(
            results, lambda r: np.array([1.0]), lambda r, method=method: backward_cost(r, method))
        rest = fits[f"{method} rest forwards"] = fit_rows(
            results, lambda r: np.array([1.0]), lambda r, method=method: rest_cost(r, method))
        for mode in ("per token", "span"):
            passes = answer_tokens if mode == "per token" else 1
            fits[f"{method} {mode} forwards"] = Fit(
                rest.coefficients + passes * share * backward.coefficients,
                rest.loo_prediction + passes * share * backward.loo_prediction,
                forwards(results[-1], f"{method} {mode}"))
    seven = LLAVA_7B
    sequence_7b = seven["image_tokens"] + (results[0]["sequence"] - Size(**results[0]["size"]).image_tokens)
    features_7b = memory_features(seven["layers"], seven["hidden"], sequence_7b)
    clip_large = {"hidden": 1024, "intermediate": 4096, "layers": 24, "heads": 16, "patch": 14}
    language_7b, vision_7b = multiply_adds(seven["hidden"], seven["layers"], seven["intermediate"], sequence_7b,
                                           seven["image_tokens"], answer_tokens + 1, clip_large)
    multiply_adds_7b, share_7b = language_7b + vision_7b, language_7b / (language_7b + vision_7b)
    estimate = {"sequence": sequence_7b, "answer_tokens": answer_tokens, "multiply_adds": multiply_adds_7b,
                "language_share": share_7b,
                "cpu_forward_seconds": float(fits["forward seconds"].coefficients[0] * multiply_adds_7b),
                "weights_float32": seven["parameters"] * 4, "weights_half": seven["parameters"] * 2, "rows": {}}
    for name in ["forward"] + memory_rows:
        estimate["rows"][name] = {"growth_float32": float(features_7b @ fits[f"{name} memory"].coefficients)}
    half = {"forward": estimate["rows"]["forward, bfloat16"]["growth_float32"],
            "generate": estimate["rows"]["generate"]["growth_float32"] / 2}
    for method in METHODS:
        measured_half = estimate["rows"][f"{method} span, bfloat16"]["growth_float32"]
        span = estimate["rows"][f"{method} span"]["growth_float32"]
        for mode in ("per token", "span", "span, frozen weights"):
            name = f"{method} {mode}"
            half[name] = measured_half * estimate["rows"][name]["growth_float32"] / span
    for name in list(estimate["rows"]):
        if name.endswith("bfloat16"):
            del estimate["rows"][name]
        else:
            estimate["rows"][name]["growth_half"] = half[name]
    for method in METHODS:
        rest = float(fits[f"{method} rest forwards"].coefficients[0])
        backward = float(fits[f"{method} backward forwards"].coefficients[0])
        estimate["rows"][f"{method} per token"]["forwards"] = rest + answer_tokens * share_7b * backward
        estimate["rows"][f"{method} per token"]["forwards_32"] = rest + 32 * share_7b * backward
        estimate["rows"][f"{method} span"]["forwards"] = rest + share_7b * backward
        estimate["rows"][f"{method} span"]["forwards_32"] = rest + share_7b * backward
    return {"fits": fits, "estimate": estimate}


# ---------------------------------------------------------------------------------------------- report


def report(results: list[dict], analysis: dict, command: str, loads: tuple[str, str], minutes: float,
           digest: str) -> str:
    answer_tokens = results[0]["answer_tokens"]
    names = list(results[0]["rows"])
    lines = [
        f"Date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}. Machine: "
        f"{os.cpu_count()} CPU cores shared with other agents' test runs, {results[0]['threads']} torch thread; "
        f"`uptime` at the start: `{loads[0]}`; at the end: `{loads[1]}`. Command: `{command}` ({minutes:.1f} min). "
        f"explain/vlm/generation.py measured: sha256 {digest[:12]}.",
        "",
        "LlavaForConditionalGeneration from configs, random weights, float32, CPU: a CLIP vision tower (hidden 256, "
        "2 layers, patch 14) and Llama language models of hidden H, L layers, H / 64 heads, intermediate "
        f"H · 11008 / 4096, vocabulary 32000. Prompt `<image>` + 22 characters; the answer given, T = {answer_tokens} "
        "tokens; S = the sequence (image tokens + prompt + answer). \"per token\": T maps (one forward, T backward "
        "passes over one retained graph); \"span\": `spans=[answer]`, one map (one backward); \"frozen\": the span "
        "with the parameters' requires_grad set off around the call; \"bfloat16\": the model cast to bfloat16 "
        "(for its memory: this CPU's bfloat16 speed says nothing of a GPU's). Time: one call (the measured one; "
        "more with `--repeats`: their median); × fwd: over a no-grad forward over the same sequence (logits at the "
        "answer's T + 1 rows, as explain computes them) timed just before it (the machine's load drifts); the "
        "forward row's time: the median of those forwards. Memory: peak "
        "resident growth during the measured call over the memory held before it (the weights not "
        "counted); × fwd: over the forward's growth (in the same dtype). Each model: one fresh process.",
        "",
        "| model | S | parameters | what | time (s) | s per map | × fwd | memory growth (MiB) | × fwd |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        size = Size(**result["size"])
        for name in names:
            row = result["rows"][name]
            floor = result["rows"]["forward, bfloat16" if name.endswith("bfloat16") else "forward"]
            label = name.replace(", frozen weights", ", frozen")
            maps = answer_tokens if name.endswith("per token") else 1
            per_map = f"{row['seconds'] / maps:.2f}" if not name.startswith(("forward", "generate")) else ""
            if name == "generate":
                label = f"generate {row['tokens']} tokens"
            lines.append(f"| {size.label} | {result['sequence']} | {result['parameters'] / 1e6:.0f} M | {label} | "
                         f"{row['seconds']:.2f} | {per_map} | {forwards(result, name):.1f} | "
                         f"{row['growth'] / MIB:.0f} | {row['growth'] / max(floor['growth'], 1):.1f} |")
    fits = analysis["fits"]
    last = Size(**results[-1]["size"])
    shares = [point_features(result)[2] for result in results]
    lines += [
        "",
        "**Fitted model.** Forward time = k · multiply-adds (counted from the shapes: the language model's linear "
        "layers, attention over the whole S × S square, the logits at T + 1 rows, projector and vision tower); "
        f"k = {fits['forward seconds'].coefficients[0] * 1e9:.3f} s per 10⁹ here. Explain's time in forwards = "
        "p + q · f · n for n backward passes (the span: n = 1; T per-token targets: n = T), f the language "
        "model's share of the forward's multiply-adds (the backward passes stop at the image tokens' embeddings: "
        f"they never reach the vision tower; f = {min(shares):.2f}–{max(shares):.2f} here, "
        f"{analysis['estimate']['language_share']:.2f} for LLaVA-1.5-7B); per model q = (per token − span) / "
        "((T − 1) · f) and p = span − q · f; each the mean over the models. Memory growth (bytes) = a · S + b · L·S·H "
        "+ c · L·H·S² (a: the logits and per-token buffers, b: the activations each layer keeps, c: (S, S) "
        "attention matrices kept, heads = H / 64), non-negative least squares on relative error over all models. "
        f"Leave-one-out: the same fits over all models but the largest, predicting it ({last.label}, S "
        f"{results[-1]['sequence']}).",
        "",
        "| quantity | fit on all | predicted (others) | measured | error |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, fit in fits.items():
        if name.endswith("memory"):
            a, b, c = fit.coefficients
            lines.append(f"| {name} | a {a / 1024:.0f} KiB, b {b:.1f} B, c {c:.2f} B | "
                         f"{fit.loo_prediction / MIB:.0f} MiB | {fit.loo_measured / MIB:.0f} MiB | "
                         f"{fit.loo_error:+.0%} |")
        elif name.endswith("seconds"):
            lines.append(f"| {name} | k {fit.coefficients[0] * 1e9:.3f} s / 10⁹ | {fit.loo_prediction:.2f} s | "
                         f"{fit.loo_measured:.2f} s | {fit.loo_error:+.0%} |")
        elif name.endswith(("backward forwards", "rest forwards")):
            letter = "q" if "backward" in name else "p"
            lines.append(f"| {name} | {letter} {fit.coefficients[0]:.2f} | {fit.loo_prediction:.2f} | "
                         f"{fit.loo_measured:.2f} | {fit.loo_error:+.0%} |")
        else:
            lines.append(f"| {name} (T = {answer_tokens}) | {fit.coefficients[0]:.2f} | {fit.loo_prediction:.2f} | "
                         f"{fit.loo_measured:.2f} | {fit.loo_error:+.0%} |")
    estimate = analysis["estimate"]
    gib = 2 ** 30
    lines += [
        "",
        f"**Estimate for LLaVA-1.5-7B** (Llama-2-7B: H 4096, 32 layers, 32 heads, intermediate 11008; CLIP "
        f"ViT-L/14-336: 576 image tokens; S = {estimate['sequence']}), stated as estimates: extrapolations over "
        f"{LLAVA_7B['parameters'] / results[-1]['parameters']:.0f}× the largest measured model's parameters, not "
        "measurements. Memory: the fits above at its shapes. The fp16/bf16 column: the bfloat16 fits for the forward "
        "and the spans; per token and frozen: the bfloat16 span times their float32 ratio to the float32 span; "
        "generation: half the float32 figure. Peak = weights + that growth; a GPU adds its own workspace (cuBLAS, "
        "the caching allocator's rounding). Time in forwards: p + q · f · n from the fit, assuming a backward pass "
        "costs on a GPU what it costs here relative to a forward (both are dominated by the same matrix products; "
        "per-call overheads weigh more on a GPU at small sizes, less at 7B). Weights: "
        f"{estimate['weights_half'] / gib:.1f} GiB in float16, {estimate['weights_float32'] / gib:.1f} GiB in "
        f"float32. One forward is {estimate['multiply_adds'] / 1e12:.1f} × 10¹² multiply-adds: about "
        f"{estimate['cpu_forward_seconds']:.0f} s in float32 on one thread of this CPU by k.",
        "",
        f"| what | time, T = {answer_tokens} (× forward) | time, T = 32 (× forward) | growth, fp16/bf16 (GiB) | "
        "peak with weights, fp16/bf16 GPU (GiB) | growth, fp32 (GiB) | peak with weights, fp32 CPU (GiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in estimate["rows"].items():
        ratio = f"{row['forwards']:.1f}" if "forwards" in row else ("1" if name == "forward" else "")
        ratio_32 = f"{row['forwards_32']:.1f}" if "forwards_32" in row else ratio
        lines.append(f"| {name} | {ratio} | {ratio_32} | {row['growth_half'] / gib:.2f} | "
                     f"{(row['growth_half'] + estimate['weights_half']) / gib:.1f} | "
                     f"{row['growth_float32'] / gib:.2f} | "
                     f"{(row['growth_float32'] + estimate['weights_float32']) / gib:.1f} |")
    return "\n".join(lines + ["", summary(results, analysis)])


def summary(results: list[dict], analysis: dict) -> str:
    """A paragraph of what the numbers say, computed from them."""
    largest, rows = results[-1], analysis["estimate"]["rows"]
    gib = 2 ** 30
    saved = [1 - largest["rows"][f"{method} span, frozen weights"]["growth"] / largest["rows"][f"{method} span"]
             ["growth"] for method in METHODS]
    attention = analysis["fits"]["attention span memory"].coefficients
    seven = LLAVA_7B
    square = attention[2] * seven["layers"] * seven["hidden"] * analysis["estimate"]["sequence"] ** 2 / HEAD_SIZE
    per_token = [rows[f"{method} per token"]["forwards"] for method in METHODS]
    spans = [rows[f"{method} span"]["forwards"] for method in METHODS]
    k = analysis["fits"]["forward seconds"]
    backward = [float(analysis["fits"][f"{method} backward forwards"].coefficients[0]) for method in METHODS]
    return (
        "**What the numbers say.** The whole answer as one span costs one forward and one backward pass: "
        f"{min(spans):.1f}–{max(spans):.1f} forwards estimated for 7B, against {min(per_token):.1f}–"
        f"{max(per_token):.1f} for T = {analysis['estimate']['answer_tokens']} per-token maps (each more token one "
        f"more backward pass, {min(backward):.1f}–{max(backward):.1f} forwards of the language model); per-token "
        "maps keep the graph for all T "
        "backward passes but add little memory over the span, except for the attention method, whose gradients "
        "of every layer's (heads, S, S) probabilities are held at once. Activation memory grows as L · S · H, the "
        "attention method's also as L · heads · S² (at 7B in float32 that term is "
        f"{square / gib:.1f} GiB of its span's {rows['attention span']['growth_float32'] / gib:.1f} GiB). The "
        "explainer turns the parameters' requires_grad off for its call (with it on, as loaded, the forward kept "
        "every linear layer's input for weight gradients that explain never computes: 17–32 % more growth on the "
        "largest model, measured before that change); the \"frozen weights\" rows, with it already off before "
        f"the call, differ from the spans by {min(saved):.0%} to {max(saved):.0%}. The forward-time fit's error "
        f"({k.loo_error:+.0%} on the largest model) shows small models running fewer multiply-adds per second: the "
        "CPU time of a 7B forward above is likely high; the memory fits and the time ratios carry over better "
        "(their leave-one-out errors above). All timings were taken while other agents' tests shared the 2 cores."
    )


def append_section(body: str) -> None:
    """Replace (or append at the end) the "Vision-language models: cost (CPU)" section of RESULTS.md."""
    import re

    from common import RESULTS

    title = "Vision-language models: cost (CPU)"
    section = f"## {title}\n\n{body.strip()}\n"
    text = RESULTS.read_text()
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")


def source_digest() -> str:
    """The sha256 of explain/vlm/generation.py: which version of it the numbers are of."""
    import hashlib

    source = Path(__file__).resolve().parent.parent / "explain" / "vlm" / "generation.py"
    return hashlib.sha256(source.read_bytes()).hexdigest()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three small models, T = 4: a smoke run of a minute")
    parser.add_argument("--answer-tokens", type=int, default=None, help="T (default 8; 4 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls after the measured one, for the forward, generation and spans "
                             "(default 0: the measured call's time)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each measuring process")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw measurements here")
    parser.add_argument("--one", nargs=3, metavar=("SIZE", "T", "REPEATS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        import torch

        torch.set_num_threads(arguments.threads)
        size_json, answer_tokens, repeats = arguments.one
        result = measure_size(Size(**json.loads(size_json)), int(answer_tokens), int(repeats))
        print(json.dumps(result))
        return
    if not os.access("/proc/self/clear_refs", os.W_OK):
        raise SystemExit("vlm_cost.py measures peak memory through Linux's /proc/self/clear_refs and VmHWM, which "
                         "this system does not offer: run it on Linux.")
    ladder = QUICK if arguments.quick else LADDER
    answer_tokens = arguments.answer_tokens or (4 if arguments.quick else 8)
    if not 2 <= answer_tokens <= len(ANSWER_TEXT):
        raise SystemExit(f"--answer-tokens must be between 2 (the fit needs one backward pass more than the span's) "
                         f"and {len(ANSWER_TEXT)}; got {answer_tokens}.")
    repeats = arguments.repeats if arguments.repeats is not None else 0
    load, digest = uptime(), source_digest()
    started = time.perf_counter()
    results = []
    for size in ladder:
        print(f"{size.label}: measuring", flush=True)
        result = run_in_fresh_process(size, answer_tokens, repeats, arguments.threads)
        if result is not None:
            results.append(result)
    if len(results) < 3:
        raise SystemExit("fewer than three sizes were measured: nothing to fit.")
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=1))
    options = [f"--answer-tokens {answer_tokens}" if arguments.answer_tokens else "",
               f"--repeats {repeats}" if repeats else "", f"--threads {arguments.threads}" if arguments.threads != 1
               else "", "--quick" if arguments.quick else ""]
    command = " ".join(["OMP_NUM_THREADS=1 python benchmarks/vlm_cost.py"] + [option for option in options if option])
    if source_digest() != digest:
        raise SystemExit("explain/vlm/generation.py changed during the run: the numbers mix two versions; run again.")
    body = report(results, analyse(results), command, (load, uptime()), (time.perf_counter() - started) / 60,
                  digest)
    print(body)
    if not arguments.no_write:
        append_section(body)


if __name__ == "__main__":
    main()
