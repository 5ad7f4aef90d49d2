"""The public capture API: read and change any layer's inputs, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torchvision
from conftest import ConvGapLinear, assert_state_equal, hook_count, model_state
from torch import nn

import explain
from explain.cli import main


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


def test_captured_outputs_equal_the_model_rewritten_by_hand(resnet):
    x = torch.randn(2, 3, 64, 64)
    with explain.capture(resnet, ["layer1.1.conv2", "layer1.1", "layer2"], inputs=True) as captured:
        resnet(x)
    with torch.no_grad():  # the same network, written out by hand
        stem = resnet.maxpool(resnet.relu(resnet.bn1(resnet.conv1(x))))
        block0 = resnet.layer1[0](stem)
        block = resnet.layer1[1]
        conv2 = block.conv2(block.relu(block.bn1(block.conv1(block0))))
        block1 = block.relu(block.bn2(conv2) + block0)
        layer2 = resnet.layer2(block1)
    torch.testing.assert_close(captured["layer1.1.conv2"].output, conv2)
    torch.testing.assert_close(captured["layer1.1"].output, block1)
    torch.testing.assert_close(captured["layer1.1"].args[0], block0)
    torch.testing.assert_close(captured["layer2"].output, layer2)
    assert list(captured) == ["layer1.1.conv2", "layer1.1", "layer2"]
    assert hook_count(resnet) == 0


def test_captured_gradient_equals_autograd_at_the_layer_output_even_before_an_inplace_relu():
    torch.manual_seed(0)
    model = ConvGapLinear(relu=True).eval()  # conv → ReLU(inplace=True) → pool → fc
    x = torch.randn(3, 3, 8, 8)
    with explain.capture(model, "conv", grads=True) as captured:
        model(x)[:, 1].sum().backward()
    # independent: the conv output as an explicit leaf, the rest of the network by hand
    conv_out = model.conv(x).detach().requires_grad_(True)
    score = model.fc(model.pool(torch.relu(conv_out)).flatten(1))[:, 1].sum()
    (expected,) = torch.autograd.grad(score, conv_out)
    torch.testing.assert_close(captured["conv"].grad, expected)
    torch.testing.assert_close(captured["conv"].output, conv_out.detach())  # pre-ReLU values, negatives kept
    assert (captured["conv"].output < 0).any()
    assert hook_count(model) == 0


def test_a_module_called_twice_yields_two_records_in_call_order():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(self.linear(x) * 10)

    model = Twice()
    x = torch.randn(1, 2)
    with explain.capture(model, "linear", inputs=True) as captured:
        model(x)
    record = captured["linear"]
    assert len(record.calls) == 2
    torch.testing.assert_close(record.calls[0].args[0], x)
    torch.testing.assert_close(record.calls[1].args[0], record.outputs[0] * 10)
    with pytest.raises(explain.LayerNotRunError, match="ran 2 times"):
        _ = record.output


def test_captured_tensors_are_safe_from_later_inplace_changes_and_can_move_device():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
    x = torch.randn(4, 3)
    with explain.capture(model, "0", to="cpu") as captured:
        model(x)
    torch.testing.assert_close(captured["0"].output, model[0](x).detach())
    assert (captured["0"].output < 0).any() and captured["0"].output.device.type == "cpu"


def test_detach_false_lets_a_loss_on_captured_features_train_the_model():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    target_features = torch.randn(5, 8)
    with explain.capture(student, "0", detach=False) as captured:
        student(torch.randn(5, 4))
    loss = nn.functional.mse_loss(captured["0"].output, target_features)
    loss.backward()
    assert student[0].weight.grad is not None and student[0].weight.grad.abs().sum() > 0
    with explain.capture(student, "0") as detached:
        student(torch.randn(5, 4))
    assert not detached["0"].output.requires_grad


def test_glob_and_type_selection(resnet):
    with explain.capture(resnet, "layer*") as by_glob:
        resnet(torch.randn(1, 3, 32, 32))
    assert list(by_glob) == ["layer1", "layer2", "layer3", "layer4"]
    with explain.capture(resnet, nn.BatchNorm2d) as by_type:
        resnet(torch.randn(1, 3, 32, 32))
    assert len(by_type) == 20 and all(len(record.calls) == 1 for record in by_type.values())


def test_last_k_transformer_blocks():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    with explain.capture(vit, "encoder.layers.*") as captured:
        vit(x)
    last_two = [record.output for record in list(captured.values())[-2:]]
    with torch.no_grad():  # by hand: class token, position embedding, then the blocks one after the other
        tokens = torch.cat([vit.class_token.expand(2, -1, -1), vit._process_input(x)], dim=1)
        tokens = tokens + vit.encoder.pos_embedding
        hidden_states = []
        for block in vit.encoder.layers:
            tokens = block(tokens)
            hidden_states.append(tokens)
    assert len(captured) == 4
    for captured_state, expected in zip(last_two, hidden_states[-2:]):
        assert captured_state.shape == (2, 17, 32)
        torch.testing.assert_close(captured_state, expected)


def test_edit_changes_the_output_and_restores_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    x = torch.randn(5, 3)
    before = model_state(model)
    plain = model(x)
    with explain.edit(model, "0", lambda t: torch.zeros_like(t)):
        ablated = model(x)
    torch.testing.assert_close(ablated, model[2](torch.zeros(5, 4)).expand(5, 2))
    with explain.edit(model, "2", lambda t: t + 1, where="input"):
        shifted = model(x)
    torch.testing.assert_close(shifted, model[2](model[1](model[0](x)) + 1))
    torch.testing.assert_close(model(x), plain)
    assert_state_equal(before, model_state(model))
    with pytest.raises(RuntimeError, match="inside"):
        with explain.edit(model, "0", lambda t: t * 0):
            raise RuntimeError("inside the block")
    torch.testing.assert_close(model(x), plain)
    assert_state_equal(before, model_state(model))


def test_edit_grad_fn_doubles_the_gradient_flowing_back_through_a_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(2, 3)
    model(x).sum().backward()
    plain = model[0].weight.grad.clone()
    model.zero_grad()
    with explain.edit(model, "0", grad_fn=lambda gradient: 2 * gradient):
        model(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, 2 * plain)
    assert hook_count(model) == 0
    with pytest.raises(ValueError, match="give fn"):
        with explain.edit(model, "0"):
            pass


def test_explain_layers_lists_names_with_shapes(capsys):
    assert main(["layers", "resnet18"]) == 0
    printed = capsys.readouterr().out
    assert "layer4  " in printed and "(1, 512, 7, 7)" in printed and "layer1.0.relu" in printed
    assert "×2 calls" in printed  # BasicBlock's relu runs twice
    assert main(["layers", "vit_b_16"]) == 0
    printed = capsys.readouterr().out
    assert "encoder.layers.encoder_layer_11.ln_1" in printed and "(1, 197, 768)" in printed
    assert main(["layers", "vit_b_16", "--input-size", "3", "160", "160"]) == 2
    assert "--input-size" in capsys.readouterr().err
    infos = {info.name: info for info in explain.list_layers(torchvision.models.resnet18(), (3, 64, 64))}
    assert tuple(infos["layer4"].output_shapes[0]) == (1, 512, 2, 2)
