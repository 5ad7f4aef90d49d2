"""Session 10: torchvision's pretrained weights download (torch.hub) has no timeout, so on a network that drops
connections `load_model("resnet18", "DEFAULT")` would wait forever. The weights' server is probed first (a
connection within ``HUB_PROBE_SECONDS``), unless the file is already in torch's cache."""

from __future__ import annotations

import socket

import pytest
import torch
import torchvision

from explain import models
from explain.models import WeightsUnavailableError, load_model


class GetModelCalled(Exception):
    pass


def test_an_unanswering_weights_server_fails_at_once_without_starting_the_download(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))  # nothing cached
    timeouts: list[float] = []

    def dropped(address, timeout=None, *args, **kwargs):  # what a firewall that drops packets gives, after timeout
        timeouts.append(timeout)
        raise socket.timeout("timed out")

    def get_model(name, **kwargs):
        raise GetModelCalled(kwargs.get("weights"))

    monkeypatch.setattr(socket, "create_connection", dropped)
    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    with pytest.raises(WeightsUnavailableError) as raised:
        load_model("resnet18", "DEFAULT")
    message = str(raised.value)
    assert "download.pytorch.org could not be reached (no answer within 3 s)" in message
    assert "--weights /path/to/resnet18-f37072fd.pth" in message
    assert timeouts == [models.HUB_PROBE_SECONDS]


def test_weights_already_in_the_cache_are_loaded_without_a_probe(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "resnet18-f37072fd.pth").write_bytes(b"cached")

    def no_probe(*args, **kwargs):
        raise AssertionError("the server was probed though the weights are cached")

    def get_model(name, **kwargs):
        raise GetModelCalled(str(kwargs.get("weights")))

    monkeypatch.setattr(socket, "create_connection", no_probe)
    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    with pytest.raises(WeightsUnavailableError, match="ResNet18_Weights.IMAGENET1K_V1") as raised:
        load_model("resnet18", "DEFAULT")
    assert isinstance(raised.value.__cause__, GetModelCalled)  # torchvision's loader was reached


def test_behind_a_proxy_the_proxy_is_probed(monkeypatch):
    """A network reachable only through a proxy (HTTPS_PROXY): the download goes through it, so it is the proxy
    that must answer, not the weights' server."""
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    addresses: list[tuple[str, int]] = []

    class Connection:
        def close(self):
            pass

    def connect(address, timeout=None, *args, **kwargs):
        addresses.append(address)
        return Connection()

    monkeypatch.setattr(socket, "create_connection", connect)
    assert models.url_reachable("https://download.pytorch.org/models/resnet18-f37072fd.pth")
    assert addresses == [("proxy.example", 3128)]
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.delenv("https_proxy", raising=False)
    assert models.url_reachable("https://download.pytorch.org/models/x.pth")
    assert addresses[-1] == ("download.pytorch.org", 443)
