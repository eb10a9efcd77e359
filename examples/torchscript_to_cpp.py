"""A TorchScript module that calls dtorch's ops, saved for a C++ program (examples/cpp).

The raw ops and classes (`torch.ops.dtorch.get_tensor_async`, `torch.classes.dtorch.TensorFuture`)
are TorchScript's: a scripted module that uses them is saved with `torch.jit.save` and runs
wherever `libdtorch_ops.so` is loaded, in Python (`torch.jit.load` after `import dtorch_ops`) or
in a libtorch program linked with it. This example scripts a module whose forward returns
`x * 2` through a future, saves it, loads it back to check it, and prints how to run it from C++
(`examples/cpp/main.cpp` loads the module given as its argument and checks forward(x) == x * 2).

Run: python examples/torchscript_to_cpp.py [path.pt]   (default: a new temporary directory)
"""
import os
import sys
import tempfile

import torch

import dtorch_ops  # registers torch.ops.dtorch.* and torch.classes.dtorch.*


class Doubler(torch.nn.Module):
    """forward(x) = x * 2, through the future of the raw op (what examples/cpp expects)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fut = torch.ops.dtorch.get_tensor_async(x * 2)  # a torch.classes.dtorch.TensorFuture
        value: torch.Tensor = fut.wait(1000)  # at most 1 s (a timeout raises); not consumed
        return value


def save_scripted_doubler(path: str) -> str:
    """Scripts Doubler, checks it, saves it to `path` (for torch::jit::load) and returns path."""
    scripted = torch.jit.script(Doubler())
    x = torch.arange(4, dtype=torch.float32)
    assert torch.equal(scripted(x), x * 2)
    torch.jit.save(scripted, path)
    return path


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:  # kept after the run, for the C++ program
        path = os.path.join(tempfile.mkdtemp(prefix="dtorch_example_"), "doubler.pt")
    save_scripted_doubler(path)
    print(f"saved the scripted module to {path}")

    loaded = torch.jit.load(path)  # needs dtorch_ops imported (its ops), as C++ needs the library
    x = torch.arange(4, dtype=torch.float32)
    y = loaded(x)
    assert torch.equal(y, x * 2)
    print(f"reloaded in Python: forward({x.tolist()}) = {y.tolist()}")
    print(f"(the module's code:\n{loaded.code.strip()}\n)")

    prefix = f"{torch.utils.cmake_prefix_path};{dtorch_ops.cmake_prefix_path()}"
    print("to run it from C++ (examples/cpp/main.cpp loads it and checks x * 2):")
    print(f"  cmake -S examples/cpp -B build/cpp -DCMAKE_PREFIX_PATH='{prefix}'")
    print("  cmake --build build/cpp -j2")
    print(f"  build/cpp/dtorch_cpp_example {path}")
    print("torchscript_to_cpp: OK")


if __name__ == "__main__":
    main()
