#include "python_pair_groups.h"

#include <memory>
#include <stdexcept>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "../ops/internal_api.h"
#include "python_waits.h"

namespace py = pybind11;

namespace dtorch::python {
void SetPairGroupMaker(const py::object& maker) {
  if (maker.is_none()) {
    internal::SetPairGroupMaker(nullptr);
    return;
  }
  // (Leaked: the kind's threads may call it until the process ends, after the interpreter's
  // teardown has begun; it is then not called.)
  auto* held = new py::object(maker);
  internal::SetPairGroupMaker([held](const std::string& host, int port,
                                     const std::string& prefix, int rank,
                                     int64_t timeout_ms) -> c10::intrusive_ptr<c10d::Backend> {
    // (The exit gate: once the exit handler ran, a library thread must not take the GIL.)
    GilUnlessExiting gil;
    if (!gil) throw std::runtime_error("the interpreter is exiting");
    try {
      py::object group = (*held)(host, port, prefix, rank, timeout_ms);
      return group.cast<c10::intrusive_ptr<c10d::Backend>>();
    } catch (py::error_already_set& e) {
      const std::string what = e.what();
      e.restore();
      PyErr_Clear();
      throw std::runtime_error("the pair group could not be made: " + what);
    } catch (const py::cast_error& e) {
      throw std::runtime_error(std::string("the pair group maker returned no Backend: ") +
                               e.what());
    }
  });
}

}  // namespace dtorch::python
