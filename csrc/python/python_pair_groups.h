// The network kind's pair groups, made by Python (dtorch_ops/_pair_groups.py): the bindings hand
// the maker to the torch glue (ops/kinds/network_pairs.cpp), which calls it, with the GIL, from
// the kind's threads.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace dtorch::python {

// `maker(host, port, prefix, rank, timeout_ms)` returns a 2-rank ProcessGroupGloo; None: this
// process makes none (the store path only).
void SetPairGroupMaker(const pybind11::object& maker);

}  // namespace dtorch::python
