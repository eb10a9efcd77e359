"""Log a training loop's loss every step without `.item()`.

`loss.item()` makes Python wait until the device has computed the loss, every step: the loop
cannot queue the next step meanwhile. A future of the loss returns at once instead, and its value
is read when it has arrived. This example trains a small model twice:

1. eagerly: each step asks for a host copy of its loss (`to_torch_async(..., device="cpu")`) and
   registers a callback (`then`) that logs the value when it lands;
2. compiled (`torch.compile(fullgraph=True)`): the step returns a future of its loss made inside
   the graph, and logs a second metric through a promise it is given (a value that is not one of
   the graph's outputs); the loop harvests the futures that are ready every few steps.

Each logged value is checked against what `.item()` gives. On a CPU the values are ready at once;
on a GPU (used when present) the same code does not stall the loop. The first run on a machine
takes longer: inductor compiles its C++ kernels once, and torch caches them for later runs.

Run: python examples/training_logging.py
"""
import functools
import math

import torch

import dtorch_ops

STEPS = 12
HARVEST_EVERY = 4  # the compiled loop collects the futures that are ready every 4 steps
TIMEOUT_S = 60.0  # every wait is bounded


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)


def make_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(64, 16, generator=generator)
        batches.append((x.to(device), x[:, :1].sin().to(device)))
    return batches


def train_eager(device: torch.device) -> tuple[dict[int, float], list[torch.Tensor]]:
    """Returns the losses logged by callbacks (by step) and the losses themselves (to check)."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: dict[int, float] = {}
    logging: list[dtorch_ops.ObjectFuture] = []
    kept: list[torch.Tensor] = []

    def log_loss(step: int, future: dtorch_ops.TensorFuture) -> None:
        # Runs once the host copy has landed (at once on a CPU; on a GPU on the library's
        # thread). value() reads the future without consuming it; the tensor is on the CPU, so
        # .item() does not wait for a device.
        logged[step] = future.value().item()

    for step, (x, y) in enumerate(make_batches(device)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # Returns at once: a CPU copy of the loss, made without blocking (on a GPU, queued on the
        # current stream); detached, so the future never keeps the autograd graph alive.
        future = dtorch_ops.to_torch_async(loss, device="cpu")
        # then(): as add_done_callback, and a future that completes once the callback has run.
        logging.append(future.then(functools.partial(log_loss, step)))
        kept.append(loss.detach())
    dtorch_ops.wait_all(logging, timeout=TIMEOUT_S)  # at the end: the last callbacks have run
    return logged, kept


def train_compiled(
    device: torch.device,
) -> tuple[dict[int, float], dict[int, float], list[torch.Tensor], list[torch.Tensor]]:
    """Returns the logged losses and mean absolute errors (by step), the returned losses and the
    model's mean absolute errors computed eagerly before each step (to check)."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(fullgraph=True)  # no graph break: the dtorch_ops calls are ops of the graph
    def step_fn(x: torch.Tensor, y: torch.Tensor, mae_promise: dtorch_ops.TensorPromise
                ) -> tuple[torch.Tensor, dtorch_ops.TensorFuture]:
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        # A metric that is not returned: it reaches us only through the promise.
        dtorch_ops.get_tensor((pred - y).abs().mean(), mae_promise)  # (yielded detached)
        # A future made inside the graph, returned with the loss.
        return loss, dtorch_ops.to_torch_async(loss, device="cpu")

    logged_loss: dict[int, float] = {}
    logged_mae: dict[int, float] = {}
    pending: list[tuple[int, dtorch_ops.TensorFuture, dtorch_ops.TensorFuture]] = []
    returned: list[torch.Tensor] = []
    expected_mae: list[torch.Tensor] = []

    def harvest(block: bool) -> None:
        """Logs the steps whose values are ready; block=True: all of them (bounded)."""
        if block:
            dtorch_ops.wait_all([f for _, lf, mf in pending for f in (lf, mf)],
                                timeout=TIMEOUT_S)
        waiting = []
        for step, loss_future, mae_future in pending:
            if loss_future.done() and mae_future.done():  # never blocks
                logged_loss[step] = loss_future.get().item()  # CPU values: no device wait
                logged_mae[step] = mae_future.get().item()
            else:
                waiting.append((step, loss_future, mae_future))
        pending[:] = waiting

    for step, (x, y) in enumerate(make_batches(device)):
        with torch.no_grad():  # the check only: the metric computed eagerly
            expected_mae.append((model(x) - y).abs().mean())
        promise = dtorch_ops.TensorPromise()  # made outside the graph, passed in
        loss, loss_future = step_fn(x, y, promise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pending.append((step, loss_future, promise.get_future()))
        returned.append(loss.detach())
        if (step + 1) % HARVEST_EVERY == 0:
            harvest(block=False)  # never waits: takes what has arrived
    harvest(block=True)
    return logged_loss, logged_mae, returned, expected_mae


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"training {STEPS} steps on {device}")

    logged, kept = train_eager(device)
    reference = [k.item() for k in kept]  # what .item() in the loop would have logged
    assert [logged[s] for s in range(STEPS)] == reference, (logged, reference)
    print(f"eager: {len(logged)} losses logged by callbacks, equal to .item(): "
          f"{reference[0]:.5f} -> {reference[-1]:.5f}")

    logged_loss, logged_mae, returned, expected_mae = train_compiled(device)
    reference = [r.item() for r in returned]
    assert [logged_loss[s] for s in range(STEPS)] == reference, (logged_loss, reference)
    print(f"compiled: {len(logged_loss)} losses from in-graph futures, equal to .item(): "
          f"{reference[0]:.5f} -> {reference[-1]:.5f}")
    expected = [m.item() for m in expected_mae]
    assert all(math.isclose(logged_mae[s], expected[s], rel_tol=1e-4, abs_tol=1e-6)
               for s in range(STEPS)), (logged_mae, expected)
    print(f"compiled: {len(logged_mae)} mean absolute errors through promises (not graph "
          f"outputs), equal to eager: {expected[0]:.5f} -> {expected[-1]:.5f}")
    print("training_logging: OK")


if __name__ == "__main__":
    main()
