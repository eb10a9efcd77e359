"""The host copy: a tensor's value on the CPU without waiting for the device.

`loss.item()` (or `loss.cpu()`) on a GPU tensor makes Python wait until the device has computed it
and copied it back: a training loop that logs every step stalls every step.
`dtorch_ops.to_torch_async(t, device="cpu")` returns a future at once instead: it queues a
non-blocking copy into pinned host memory on t's current stream and is ready once the copy has
landed (no device-wide sync). A list, `to_torch_async([loss, acc], device="cpu")`, gives one
`TensorListFuture` of all the copies. The values are detached from autograd.

On a CPU tensor there is nothing to copy: the future yields the tensor itself (no copy), ready at
once. This example runs on a GPU when one is present, else on the CPU.

Run: python examples/host_copy.py
"""
import torch

import dtorch_ops

TIMEOUT_S = 30.0  # every wait is bounded


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(device)
    x = torch.randn(64, 8, device=device)
    labels = torch.randint(0, 3, (64,), device=device)

    logits = model(x)  # on a GPU: queued, not computed yet
    loss = torch.nn.functional.cross_entropy(logits, labels)
    acc = (logits.argmax(1) == labels).float().mean()

    # One tensor: a TensorFuture of its CPU copy.
    loss_future = dtorch_ops.to_torch_async(loss, device="cpu")  # returns at once
    # A list: one TensorListFuture; its value is the list of CPU copies, in order.
    both_future = dtorch_ops.to_torch_async([loss, acc], device="cpu")

    # ... a training loop would queue its next steps here, and read the values later:
    loss_cpu = loss_future.wait(timeout=TIMEOUT_S)  # wait() does not consume; get() does
    loss_again, acc_cpu = both_future.get()  # already landed here: returns at once
    print(f"loss on {loss_cpu.device}: {loss_cpu.item():.5f} (requires_grad "
          f"{loss_cpu.requires_grad}); [loss, acc]: [{loss_again.item():.5f}, "
          f"{acc_cpu.item():.5f}]")
    assert loss_cpu.device.type == "cpu" and not loss_cpu.requires_grad
    assert loss_cpu.item() == loss.item() == loss_again.item()  # what .item() gives
    assert acc_cpu.item() == acc.item()

    # A CPU tensor's "copy" is the tensor itself (detached): clone it if you will write to it.
    if device.type == "cpu":
        same = dtorch_ops.to_torch_async(acc, device="cpu").get().data_ptr() == acc.data_ptr()
        print(f"on the CPU the future yields the tensor itself: {same}")
        assert same

    # Logging every step of a loop: queue the copies, read them when they have landed.
    futures: list[dtorch_ops.TensorFuture] = []
    for step in range(5):
        step_loss = torch.nn.functional.cross_entropy(model(x * (step + 1)), labels)
        futures.append(dtorch_ops.to_torch_async(step_loss, device="cpu"))
    logged = [t.item() for t in dtorch_ops.wait_all(futures, timeout=TIMEOUT_S)]
    expected = [torch.nn.functional.cross_entropy(model(x * (s + 1)), labels).item()
                for s in range(5)]
    print(f"5 steps logged from host copies: {[round(v, 4) for v in logged]}")
    assert logged == expected
    print("host_copy: OK")


if __name__ == "__main__":
    main()
