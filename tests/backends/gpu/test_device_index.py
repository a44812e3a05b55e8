"""An accelerator named without an index ("cuda") is kept under the index its tensors report
("cuda:0"): the kernels' once-per-process checks, the layers' chosen products and the device the
CLI picks. Otherwise a product chosen before a compiled or graph-captured frame step is chosen
again inside it at the first call (the inputs report "cuda:0"), which breaks the graph."""

import gguf
import pytest
import torch

from mm3.backends import device as mm3_device
from mm3.backends.gpu import kernels
from mm3.backends import products
from mm3.weights import layers as gguf_ops
from mm3.weights.binding import indexed_device

Q = gguf.GGMLQuantizationType


@pytest.fixture
def current_cuda_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_indexed_device(current_cuda_is_one):
    assert indexed_device("cuda") == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda", 0)) == torch.device("cuda", 0)  # a named index stays
    assert indexed_device("cpu") == torch.device("cpu") and indexed_device("cpu").index is None
    assert indexed_device("mps") == torch.device("mps", 0)
    assert indexed_device("meta") == torch.device("meta")


@pytest.mark.parametrize("module", ["kernels", "layout_kernels"])
def test_a_kernel_is_checked_once_per_device_however_it_is_named(module, monkeypatch, current_cuda_is_one):
    if module == "layout_kernels":
        pytest.importorskip("triton", reason="this torch installation has no Triton")
        from mm3.backends.gpu import layout_kernels as target
    else:
        target = kernels
    checked = []
    monkeypatch.setattr(target, "_WORKS", {})
    monkeypatch.setattr(target, "_check", lambda qtype, dtype, device: checked.append(device) or True)
    assert target.works(Q.Q8_0, torch.float32, torch.device("cuda"))
    assert target.works(Q.Q8_0, torch.float32, torch.device("cuda", 1))
    assert target.works(Q.Q8_0, torch.float32, "cuda:1")
    assert checked == [torch.device("cuda", 1)]


def test_layers_keep_their_product_under_the_indexed_device(monkeypatch, current_cuda_is_one):
    monkeypatch.setattr(products, "for_linear", lambda layer, dtype, device: ("linear", device))
    monkeypatch.setattr(products, "for_fused", lambda fused, dtype, device: ("fused", device))
    parts = []
    for n in (4, 2):
        layer = gguf_ops.Linear(32, n, bias=False)
        layer.set_stored("weight", Q.Q8_0, torch.zeros(n, 34, dtype=torch.uint8))
        parts.append(layer)
    dtype, device, product = parts[0].choose(torch.float32, torch.device("cuda"))
    assert device == torch.device("cuda", 1) and product == ("linear", torch.device("cuda", 1))
    chosen = gguf_ops.Fused(parts).choose(torch.float32, "cuda")
    assert chosen[1] == torch.device("cuda", 1) and chosen[3] == ("fused", torch.device("cuda", 1))


def test_pick_device_names_the_index(monkeypatch, current_cuda_is_one):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mm3_device.pick_device() == torch.device("cuda", 1)
    assert mm3_device.pick_device("cuda") == torch.device("cuda", 1)
    assert mm3_device.pick_device("cuda:0") == torch.device("cuda", 0)
    assert mm3_device.pick_device("cpu") == torch.device("cpu")
    assert mm3_device.pick_device(torch.device("cuda")) == torch.device("cuda", 1)  # as the pipeline takes one


def test_pick_device_refuses_a_missing_one_by_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' is not available here"):
        mm3_device.pick_device(torch.device("cuda"))


def test_a_device_torch_cannot_reach_is_left_as_named(monkeypatch):
    def no_cuda():
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert indexed_device("cuda") == torch.device("cuda") and indexed_device("cuda").index is None


def test_pick_device_takes_a_torch_device_of_a_type_it_does_not_list():
    assert mm3_device.pick_device(torch.device("hpu")) == torch.device("hpu")  # an API caller's own device
    with pytest.raises(ValueError, match="device 'hpu' is not available here"):
        mm3_device.pick_device("hpu")  # a name is checked against the list


def test_choose_products_makes_the_biases_ready_where_the_step_reads_them(current_cuda_is_one):
    layer = gguf_ops.Linear(32, 4, bias=True)
    layer.set_stored("weight", Q.Q8_0, torch.zeros(4, 34, dtype=torch.uint8))
    layer.set_float("bias", torch.randn(4))
    gguf_ops.choose_products([layer], torch.float32, torch.device("cpu"))
    assert ("bias", torch.float32, torch.device("cpu")) in layer._ready  # no state made at the step's first call
