// Python callbacks run when a future completes: add_done_callback, and through it then(),
// collect_all() and to_torch_future() (dtorch_ops/futures.py).
//
// Where a callback runs: registered on a complete future, at once on the registering thread (as
// torch.futures.Future). Otherwise on the thread that completes the future when that is a Python
// thread (set_value, get_tensor on CPU: it takes the GIL there), else on the library's pool (the
// completion came from a detector or the doorbell watcher, which must not wait for the GIL), one
// at a time and in completion order there. Never under a lock of the library: futures run their
// callbacks outside their locks.
//
// Exceptions a callback raises go to sys.unraisablehook ("Exception ignored in: <callback>", as
// Python reports an exception in a finalizer): reported, never lost, and never passed on to the
// producer.
//
// Lifetime: the pending callback holds the callable and its argument (the future's wrapper) until
// it has run; dropped unrun, it releases them with the GIL. A callback belongs to the process that
// registered it (a forked child does not run its parent's callbacks). Exit: once the exit gate is
// closed (python_waits.h) a callback that has not started is not run and keeps its references to
// the process's end (Python is being finalized); one running on a library thread is waited for
// (a warning after config.exit_timeout_s), unless it waits in a library wait (it then parks).
//
// Thread-safety: AddDoneCallback may be called from any thread holding the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>

namespace dtorch::python {

// Calls fn(arg) once `on_ready` fires its callback (see above). `on_ready` registers a callback
// with a future (its OnReady). Raises TypeError if fn is not callable.
void AddDoneCallback(const std::function<void(std::function<void()>)>& on_ready,
                     pybind11::handle fn, pybind11::handle arg);

}  // namespace dtorch::python
