"""A simulated accelerator for a CPU-only machine: run the engine's device path on the meta device
while a dispatch mode checks every op's tensors.

Tensors on "meta" have shapes and no data, like tensors on a GPU seen from the host: every op that
mixes one with a host tensor (other than a 0-dim scalar) is the mistake a CUDA run would hit
(`index_copy_` with a host index) or pay for silently (a host index tensor in `gather`, which CUDA
copies at each call). DeviceCheckMode raises on those, counts host-to-device and device-to-host
copies, and answers device-to-host copies with zeros (the host cannot know what a GPU computed).
Reading a device tensor's values any other way (`.item()`, `.tolist()`, `bool(t)`) fails, as a
hidden device sync should.

Why not FakeTensorMode on device "cuda": on a CPU-only torch 2.13 build, Python slicing of a fake
CUDA tensor, copy_ into one, nn.Linear's initialisation and torch.Generator("cuda") raise "PyTorch
is not linked with support for cuda devices", so no real step runs through it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
DEVICE = "meta"


class HostTensorOnDeviceError(AssertionError):
    pass


class DeviceCheckMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.host_to_device = 0
        self.device_to_host = 0
        self.calls: Counter[str] = Counter()  # op name ("llmctl::group_quantized_mm") -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls[func.name().split(".")[0]] += 1
        if func.overloadpacket in (aten._to_copy, aten.to):
            source = args[0]
            target = kwargs.get("device") or next(
                (a for a in args[1:] if isinstance(a, (torch.device, str))), source.device
            )
            dtype = kwargs.get("dtype") or next(
                (a for a in args[1:] if isinstance(a, torch.dtype)), source.dtype
            )
            if source.device.type == DEVICE and torch.device(target).type == "cpu":
                self.device_to_host += 1
                return torch.zeros(source.shape, dtype=dtype)
            if source.device.type == "cpu" and torch.device(target).type == DEVICE:
                self.host_to_device += 1
            return func(*args, **kwargs)
        if func in (aten.copy_.default, aten.copy.default):
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == DEVICE:
                self.device_to_host += 1
                return dst.zero_() if func is aten.copy_.default else torch.zeros_like(dst)
            if dst.device.type == DEVICE and src.device.type == "cpu":
                self.host_to_device += 1
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == DEVICE]
        on_host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and on_host:
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in on_host)
            raise HostTensorOnDeviceError(f"{func}: host tensor(s) [{shapes}] in a device op")
        return func(*args, **kwargs)
