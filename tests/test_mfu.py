"""The peak FLOP/s behind MFU: exact device kinds only; an unknown accelerator says so instead of guessing."""

import types

import pytest

from jaxgpt.training.metrics import peak_flops


def _devices(kind, platform="gpu", n=1):
    return [types.SimpleNamespace(device_kind=kind, platform=platform)] * n


@pytest.mark.parametrize("kind, bf16", [
    ("NVIDIA L40S", 362e12),  # not the L4's figure
    ("NVIDIA L4", 121e12),
    ("NVIDIA H100 PCIe", 756e12),  # not the SXM's
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5", 459e12),  # v5p
])
def test_known_devices_match_exactly(kind, bf16):
    peak, source = peak_flops("bfloat16", devices=_devices(kind, n=2))
    assert peak == 2 * bf16 and kind in source
    assert peak_flops("float32", devices=_devices(kind))[0] == bf16 / 2


@pytest.mark.parametrize("kind", ["NVIDIA A10G", "NVIDIA H100 NVL", "NVIDIA GeForce RTX 4090", "TPU7x"])
def test_unknown_accelerators_have_no_peak(kind):
    peak, why = peak_flops("bfloat16", devices=_devices(kind))
    assert peak is None and repr(kind) in why and "train.peak_flops" in why
    assert peak_flops("bfloat16", 2e14, devices=_devices(kind, n=4))[0] == 8e14  # the override still works


def test_cpu_is_measured():
    peak, source = peak_flops("float32", devices=_devices("cpu", platform="cpu", n=4))
    assert peak > 1e8 and source.startswith("measured float32 matmul")
