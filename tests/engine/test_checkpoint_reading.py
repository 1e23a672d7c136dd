"""Reading a safetensors checkpoint (engine/model_loader/weights.py): the slices a tensor-parallel
rank asks for, in every dtype, equal safetensors' own reading; a tensor's pages of the mapped file
leave the resident set once the loader moves to the next tensor (so the loading peak is the
model's weights, not the weights plus the whole file); a damaged header is a typed error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.model_loader.weights import iterate_weights


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randn(512, 1024, generator=g) for i in range(4)
    }  # 2 MiB each
    tensors["embed.weight"] = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    tensors["norm.weight"] = torch.randn(7, generator=g).to(torch.float16)
    tensors["positions"] = torch.arange(5, dtype=torch.int64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_reads_equal_safetensors_in_every_dtype(checkpoint):
    directory, _ = checkpoint
    theirs = load_file(str(directory / "model.safetensors"))
    seen = {}
    for name, tensor in iterate_weights(directory):
        seen[name] = tensor.load()
        assert seen[name].dtype == theirs[name].dtype and torch.equal(seen[name], theirs[name])
        if name == "embed.weight":  # a column-parallel rank's rows, a row-parallel one's columns
            assert torch.equal(tensor.narrow(0, 100, 50), theirs[name][100:150])
            assert torch.equal(tensor.narrow(1, 32, 32), theirs[name][:, 32:])
            assert torch.equal(tensor.T.narrow(0, 0, 8), theirs[name].T[:8])
    assert seen.keys() == theirs.keys()
    seen["layers.0.weight"].add_(1)  # each read is the caller's own copy
    again = dict(iterate_weights(directory))["layers.0.weight"].load()
    assert torch.equal(again, theirs["layers.0.weight"])


PEAK = """
import sys, torch
from llmctl.engine.model_loader.weights import iterate_weights

def peak_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) >> 10

before = peak_mib()
# as the loader fills its parameters: a copy of each tensor, kept
kept = [torch.empty(t.shape).copy_(t.load()) for _, t in iterate_weights(sys.argv[1])]
print(peak_mib() - before, sum(k.numel() * k.element_size() for k in kept) >> 20)
"""


def test_loading_peaks_at_the_weights_not_the_weights_and_the_file(tmp_path):
    """A tensor's pages of the mapped file leave the resident set once the loader moves on; kept
    mapped (safetensors' reader), the whole file came on top of the weights: 2.0x at the peak."""
    g = torch.Generator().manual_seed(0)
    save_file(
        {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(32)},
        str(tmp_path / "model.safetensors"),
    )  # 128 MiB, 4 MiB a tensor
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    peak, weights = (int(v) for v in done.stdout.split())
    assert weights == 128
    assert peak <= 1.35 * weights, f"loading 128 MiB of weights raised the peak RSS {peak} MiB"


def test_a_damaged_header_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelLoadError) as err:
        list(iterate_weights(tmp_path))
    assert "model.safetensors" in err.value.message and "header" in err.value.message
    assert "corrupt or truncated" in err.value.hint
    weights.write_bytes((6).to_bytes(8, "little") + b"{nope}")
    with pytest.raises(ModelLoadError, match="not JSON"):
        list(iterate_weights(tmp_path))
