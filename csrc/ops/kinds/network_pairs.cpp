// The network kind's point-to-point links (core/kinds/network/links.h) over torch.distributed's
// Gloo: a PairLink is a 2-rank c10d Backend (ProcessGroupGloo) whose send/recv carry the bytes.
// The groups are made by Python (the wheel ships no Gloo headers: the bindings pass a maker,
// csrc/python/python_pair_groups.cpp); this file is Python-free.
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/from_blob.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "../../core/kinds/network/network_kind.h"
#include "../internal_api.h"

namespace dtorch {
namespace {

// A receive waits this long for its message (in effect forever: Abort wakes it; a Gloo wait that
// runs out would close the pair).
constexpr std::chrono::milliseconds kReceiveForever{std::chrono::hours(24 * 365)};

class GlooPairLink final : public core::PairLink {
 public:
  GlooPairLink(c10::intrusive_ptr<c10d::Backend> group, int rank)
      : group_(std::move(group)), peer_(1 - rank) {}
  ~GlooPairLink() override = default;

  void Send(const void* data, size_t bytes, uint32_t tag,
            std::chrono::milliseconds timeout) override {
    // (Gloo reads the tensor's bytes only.)
    std::vector<at::Tensor> tensors{Bytes(const_cast<void*>(data), bytes)};
    Run([&] { return group_->send(tensors, peer_, static_cast<int>(tag)); }, timeout);
  }
  void Receive(void* data, size_t bytes, uint32_t tag) override {
    std::vector<at::Tensor> tensors{Bytes(data, bytes)};
    Run([&] { return group_->recv(tensors, peer_, static_cast<int>(tag)); }, kReceiveForever);
  }
  void Abort() noexcept override {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = true;
      work = work_;
    }
    if (work) {
      try {
        work->abort();
      } catch (...) {
      }
    }
  }

 private:
  static at::Tensor Bytes(void* data, size_t bytes) {
    return at::from_blob(data, {static_cast<int64_t>(bytes)},
                         at::TensorOptions().dtype(at::kByte));
  }
  template <typename Start>
  void Run(const Start& start, std::chrono::milliseconds timeout) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) throw std::runtime_error("the link was closed");  // (nothing posted)
    }
    try {
      work = start();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("the link failed: ") + e.what());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) {
        work->abort();
        throw std::runtime_error("the link was closed");
      }
      work_ = work;
    }
    const auto done = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      work_.reset();
    };
    try {
      if (!work->wait(timeout)) throw std::runtime_error("the link timed out");
    } catch (const std::exception& e) {
      done();
      throw std::runtime_error(std::string("the link failed: ") + e.what());
    }
    done();
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) throw std::runtime_error("the link was closed");
  }

  const c10::intrusive_ptr<c10d::Backend> group_;
  const int peer_;
  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> work_;  // guarded by mu_: the call in progress
  bool aborted_ = false;                 // guarded by mu_
};

}  // namespace

namespace internal {

void SetPairGroupMaker(PairGroupMaker maker) {
  if (!maker) {
    core::SetPairLinkFactory(nullptr);
    return;
  }
  core::SetPairLinkFactory([maker = std::move(maker)](const core::StoreAddress& store,
                                                      const std::string& prefix, int rank,
                                                      std::chrono::milliseconds timeout)
                               -> std::unique_ptr<core::PairLink> {
    c10::intrusive_ptr<c10d::Backend> group =
        maker(store.host, store.port, prefix, rank, timeout.count());
    if (!group) throw std::runtime_error("no pair group was made");
    return std::make_unique<GlooPairLink>(std::move(group), rank);
  });
}

}  // namespace internal
}  // namespace dtorch
