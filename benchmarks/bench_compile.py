"""A torch.compile'd training step (MLP, synthetic data): per-step time with the loss logged
through a future (dtorch_ops.get_tensor inside the compiled step, values read later by a logger)
vs no logging vs loss.item() every step. On a GPU the target is <= 2% over no logging and faster
than .item(); on CPU .item() does not stall, so the three should be close."""
import statistics
import time

import torch
import torch._dynamo

import dtorch_ops


def _make(device, backend, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def forward(x, y, promise):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if promise is not None:
            dtorch_ops.get_tensor(loss.detach(), promise)
        return loss

    compiled = torch.compile(forward, fullgraph=True, backend=backend)
    x = torch.randn(256, 512, device=device)
    y = torch.randn(256, 1, device=device)
    pending = []

    def step():
        promise = dtorch_ops.TensorPromise() if mode == "future" else None
        loss = compiled(x, y, promise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mode == "item":
            pending.append(loss.item())
        elif mode == "future":
            pending.append(promise.get_future())

    def drain():  # the logger reads the values later, off the step's critical path
        for f in pending:
            if not isinstance(f, float):
                f.wait(60_000)
        pending.clear()

    return step, drain


def main(steps=30, rounds=5, backend="inductor"):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.reset()
    runners = {mode: _make(device, backend, mode) for mode in ("none", "future", "item")}
    for step, drain in runners.values():  # compile and warm up
        for _ in range(3):
            step()
        drain()
    samples = {mode: [] for mode in runners}
    for _ in range(rounds):
        for mode, (step, drain) in runners.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            samples[mode].append((time.perf_counter() - start) / steps * 1e3)
            drain()
    m = {mode: statistics.median(v) for mode, v in samples.items()}
    print(f"\ncompiled training step on {device} ({backend}; ms per step, median of {rounds} "
          f"rounds x {steps} steps)")
    labels = {"none": "no logging", "future": "loss via get_tensor + future",
              "item": "loss.item() every step"}
    for mode, label in labels.items():
        print(f"  {label:>34}: {m[mode]:8.3f} ms")
    print(f"  => future logging vs no logging: {m['future'] / m['none']:.3f}x "
          "(target on GPU <= 1.02x)")
    print(f"  => future logging vs .item():    {m['future'] / m['item']:.3f}x (target < 1x on GPU)")


if __name__ == "__main__":
    main()
