"""Train the vision-language demo (``explain.data.demo_vlm``) on synthetic scenes and save its weights.

    python -m explain.data.train_vlm            # trains (a few minutes on 2 CPU cores), prints held-out accuracy
    python -m explain.data.train_vlm --no-save  # the same, without writing explain/data/demo_vlm.pt

Each step draws fresh scenes and asks for the shape's colour; the loss is the answer's colour word and the end
of sequence (teacher forcing). Training stops at ``--steps`` or once held-out accuracy reaches ``--target``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .demo_vlm import (
    QUESTIONS,
    VLM_WEIGHTS_PATH,
    Scene,
    build_model,
    build_processor,
    held_out_scenes,
    local_vision_parameters,
    make_scene,
)

TRAINING_SEED = 7


def prompt_ids(processor: Any, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[question]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    blank = np.zeros((64, 64, 3), dtype=np.uint8)
    return processor(images=[blank], text=[text], return_tensors="pt")["input_ids"][0]


def pixel_batch(processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
    """The processor's pixel values, computed directly (64 px scenes: its resize and crop change nothing); checked
    against the processor itself at the start of training."""
    image_processor = processor.image_processor
    pixels = torch.from_numpy(np.stack([np.asarray(image) for image in images])).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(image_processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(image_processor.image_std).view(1, 3, 1, 1)
    return (pixels - mean) / std


def accuracy(model: torch.nn.Module, processor: Any, scenes: list[Scene], prompts: dict[str, torch.Tensor]) -> float:
    tokenizer = processor.tokenizer
    right = total = 0
    with torch.no_grad():
        for question in QUESTIONS:
            ids = prompts[question]
            for start in range(0, len(scenes), 100):
                chunk = scenes[start:start + 100]
                pixels = pixel_batch(processor, [scene.image for scene in chunk])
                input_ids = ids[None].expand(len(chunk), -1)
                logits = model(input_ids=input_ids, pixel_values=pixels).logits[:, -1]
                answers = tokenizer.convert_ids_to_tokens(logits.argmax(dim=-1).tolist())
                right += sum(answer == scene.answer(question) for answer, scene in zip(answers, chunk))
                total += len(chunk)
    return right / total


def train(steps: int, batch: int, target: float, seed: int = TRAINING_SEED) -> tuple[torch.nn.Module, float]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, processor = build_model(), build_processor()
    tokenizer = processor.tokenizer
    prompts = {question: prompt_ids(processor, question) for question in QUESTIONS}
    names = list(QUESTIONS)
    eos = tokenizer.eos_token_id
    held_out = held_out_scenes(200)
    reference = processor.image_processor(images=[scene.image for scene in held_out[:4]],
                                          return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixel_batch(processor, [scene.image for scene in held_out[:4]]), reference,
                               rtol=1e-5, atol=1e-5)
    frozen = {id(parameter) for parameter in local_vision_parameters(model)}  # stay zero: tokens stay local
    assert len(frozen) == 4, "two vision layers, each an output projection's weight and bias"
    trained = [parameter for parameter in model.parameters() if id(parameter) not in frozen]
    optimizer = torch.optim.AdamW(trained, lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    started, score = time.time(), 0.0
    for step in range(1, steps + 1):
        scenes = [make_scene(rng) for _ in range(batch)]
        asked = [names[int(k)] for k in rng.integers(0, len(names), size=batch)]
        pixels = pixel_batch(processor, [scene.image for scene in scenes])
        answers = torch.tensor([tokenizer.convert_tokens_to_ids(scene.answer(question))
                                for scene, question in zip(scenes, asked)])
        prompt = torch.stack([prompts[question] for question in asked])
        input_ids = torch.cat([prompt, answers[:, None], torch.full((batch, 1), eos)], dim=1)
        logits = model(input_ids=input_ids, pixel_values=pixels).logits
        length = prompt.shape[1]
        loss = (F.cross_entropy(logits[:, length - 1], answers)
                + F.cross_entropy(logits[:, length], torch.full((batch,), eos)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps:
            model.eval()
            score = accuracy(model, processor, held_out, prompts)
            model.train()
            print(f"step {step}: loss {loss.item():.3f}, held-out accuracy {score:.3f}, {time.time() - started:.0f} s",
                  flush=True)
            if score >= target:
                break
    return model.eval(), score


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--target", type=float, default=0.99, help="stop once held-out accuracy reaches this")
    parser.add_argument("--no-save", action="store_true")
    arguments = parser.parse_args(argv)
    model, score = train(arguments.steps, arguments.batch, arguments.target)
    assert all(float(parameter.abs().max()) == 0.0 for parameter in local_vision_parameters(model))
    print(f"held-out accuracy {score:.3f} (200 scenes)")
    if not arguments.no_save:
        torch.save({name: value.half() for name, value in model.state_dict().items()}, VLM_WEIGHTS_PATH)
        print(f"saved {VLM_WEIGHTS_PATH}")


if __name__ == "__main__":
    main()
