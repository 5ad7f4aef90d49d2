"""Hostile-user attacks on ``GenerationExplainer`` and ``explain vlm`` (tiny random-weight models, nothing downloaded).

Each test states the correct behaviour; the ones marked "bug" fail on the code they were written against:

1. (bug) a model whose parameters were made inside ``torch.inference_mode()`` crashes deep in autograd with torch's
   "Inference tensors cannot be saved for backward" instead of the toolkit's clear refusal
   (``check_parameters_usable``, used by every other explainer);
2. (bug) a (1, 3, H, W) uint8 tensor is refused with a message saying (N, 3, H, W) is accepted, while a (1, 3, H, W)
   float tensor of the same image is accepted;
3. (bug) ``explain vlm --model demo-vlm --dtype bfloat16`` silently runs in float32 (the option is dropped);
4. (holds) a given answer equal to the generated one gives bit-identical maps and the scores are the
   log-probabilities ``model.generate(output_scores=True)`` gives; the model, its configs and the processor are
   left bit-identical; tokens that cannot depend on the image get all-zero (finite) maps.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from vlm_tiny import picture, tiny_llava, tiny_paligemma  # noqa: E402

import explain  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]


# ------------------------------------------------------------------ bugs


def test_a_model_made_inside_inference_mode_is_refused_with_the_toolkits_clear_message():
    """Bug: GenerationExplainer never calls check_parameters_usable; the call generates, then dies in autograd with
    "Inference tensors cannot be saved for backward" (no word of the model's parameters or how to fix them)."""
    _, processor = tiny_llava()
    with torch.inference_mode():
        model, _ = tiny_llava()
    assert next(model.parameters()).is_inference()
    before = {name: (parameter.clone(), parameter.requires_grad) for name, parameter in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"parameters were created inside torch\.inference_mode"):
        explain.GenerationExplainer(model, processor).explain(picture(), "hi", max_new_tokens=2)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name][0]) and parameter.requires_grad == before[name][1]


def test_a_batch_of_one_uint8_tensor_gives_the_maps_of_the_same_image_as_a_float_tensor():
    """Bug: as_pil_image squeezes a leading batch of 1 for float tensors only; the uint8 (1, 3, H, W) tensor is
    refused with "channels first: (3, H, W) or (N, 3, H, W)", which names its own shape as accepted."""
    model, processor = tiny_llava()
    explainer = explain.GenerationExplainer(model, processor)
    pixels = torch.from_numpy(np.asarray(picture()).copy()).permute(2, 0, 1)[None]  # (1, 3, H, W) uint8
    as_float = explainer.explain(pixels.float() / 255.0, "hi", max_new_tokens=2)
    as_uint8 = explainer.explain(pixels, "hi", max_new_tokens=2)
    assert torch.equal(as_uint8.raw_maps, as_float.raw_maps)
    assert torch.equal(as_uint8.diagnostics["token_ids"], as_float.diagnostics["token_ids"])


def test_explain_vlm_demo_with_dtype_bfloat16_runs_in_bfloat16_or_refuses(tmp_path, capsys):
    """Bug: run_vlm applies --dtype only to hf: models; for demo-vlm it is dropped and the run is float32 with no
    word. Correct: the demo is cast (and the reduced-precision warning says so) or the option is refused."""
    from explain.cli import main

    image = tmp_path / "scene.png"
    picture(64, 64).save(image)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["vlm", str(image), "--model", "demo-vlm", "--prompt", "what color is it ?", "--dtype",
                     "bfloat16", "--out", str(tmp_path / "out"), "--device", "cpu"])
    error = capsys.readouterr().err
    ran_in_bf16 = any("bfloat16" in str(warning.message) for warning in caught)
    refused = code == 2 and "dtype" in error
    assert ran_in_bf16 or refused, (code, error)


# ------------------------------------------------------------------ what held up (kept as regression checks)


@pytest.mark.parametrize("family", [tiny_llava, tiny_paligemma])
def test_scores_are_generates_log_probabilities_and_a_given_answer_gives_the_generated_maps(family):
    model, processor = family()
    explainer = explain.GenerationExplainer(model, processor)
    generated = explainer.explain(picture(), "what?", max_new_tokens=4)
    ids = generated.diagnostics["token_ids"][0]
    prepared = explainer.prepare(picture(), "what?")
    with torch.no_grad():
        output = model.generate(**prepared.inputs, max_new_tokens=4, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
    plain = output.sequences[0, prepared.prompt_length:]
    assert torch.equal(plain, ids)
    log_probabilities = torch.stack([torch.log_softmax(step[0].float(), -1)[token]
                                     for step, token in zip(output.scores, plain)])
    torch.testing.assert_close(generated.scores[0], log_probabilities, rtol=1e-5, atol=1e-5)
    given = explainer.explain(picture(), "what?", answer=processor.tokenizer.decode(ids.tolist()))
    assert torch.equal(given.diagnostics["token_ids"][0], ids)
    assert torch.equal(given.raw_maps, generated.raw_maps)


def test_model_configs_processor_and_rng_are_left_bit_identical_by_every_method():
    model, processor = tiny_llava()
    model.generation_config.do_sample, model.generation_config.max_new_tokens = True, 3
    generation, config = model.generation_config.to_json_string(), model.config.to_json_string()
    processor_state = processor.to_json_string()
    parameters = {name: (p.clone(), p.requires_grad) for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("input_x_gradient", "attention", "attnlrp"):
            explain.GenerationExplainer(model, processor, method=method).explain(picture(), "hi", max_new_tokens=2)
    assert model.generation_config.to_json_string() == generation
    assert model.config.to_json_string() == config
    assert processor.to_json_string() == processor_state
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, parameters[name][0]) and parameter.requires_grad == parameters[name][1]
        assert parameter.grad is None


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp"])
def test_tokens_that_cannot_depend_on_the_image_get_zero_finite_maps(method):
    """The projector's last layer zeroed: every image token's embedding is 0 whatever the pixels."""
    model, processor = tiny_llava()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.zero_()
        model.model.multi_modal_projector.linear_2.bias.zero_()
    result = explain.GenerationExplainer(model, processor, method=method).explain(picture(), "hi", max_new_tokens=2)
    assert torch.equal(result.raw_maps, torch.zeros_like(result.raw_maps))
    assert torch.equal(result.maps, torch.zeros_like(result.maps))
