// ReceivedFuture<T>: the future of the kinds whose value comes from another process as a codec's
// header and a payload (core/kinds/file, core/kinds/network), read by a ValueCodec<T> (torch-free).
//
// Receiving is destructive (the file kind unlinks what it received; the network kind's bytes are
// taken from its state), so the future takes the value once, when it is first asked for (Get or
// Value), and keeps the completion for Value() (SharedState's semantics). The pair's callbacks run
// in its WaitUntil, which is called before mu_ is taken: a callback may read this future.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "promise_future.h"
#include "value_codec.h"

namespace dtorch::core {

// A value as the consumer's end hands it over: the codec's header and the payload's bytes (null
// when there are none), kept alive by keep_alive.
struct ReceivedValue {
  std::string header;
  void* payload = nullptr;
  size_t payload_bytes = 0;
  std::shared_ptr<void> keep_alive;
};

// The consumer's end of such a pair, as its future uses it.
class ReceivedSource {
 public:
  virtual ~ReceivedSource() = default;
  // FutureBackend semantics (promise_future.h); WaitUntil throws kNoState once the value was
  // taken.
  virtual bool WaitUntil(Deadline deadline) const = 0;
  virtual bool IsReady() const = 0;
  virtual void OnReady(std::function<void()> callback) = 0;
  // Blocks until complete, then takes the value (throws the error instead); consumes.
  virtual ReceivedValue Take() = 0;
  // The future is gone: nobody will read the value.
  virtual void FutureDropped() {}
};

template <typename T>
class ReceivedFuture final : public FutureBackend<T> {
 public:
  ReceivedFuture(std::shared_ptr<ReceivedSource> source,
                 std::shared_ptr<const ValueCodec<T>> codec)
      : source_(std::move(source)), codec_(std::move(codec)) {}
  ~ReceivedFuture() override { source_->FutureDropped(); }

  T Get() override {
    WaitUntil(Deadline::max());
    std::lock_guard<std::mutex> lock(mu_);
    if (taken_) throw FutureError(FutureErrc::kNoState, kConsumedDetail);
    taken_ = true;
    return ReceivedLocked().CopyOrThrow();
  }
  T Value() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (received_) return received_->CopyOrThrow();
    }
    if (!SourceWaitUntil(Deadline())) {  // (a poll)
      throw FutureError(FutureErrc::kNotReady, kNotReadyDetail);
    }
    std::lock_guard<std::mutex> lock(mu_);
    return ReceivedLocked().CopyOrThrow();
  }
  bool WaitUntil(Deadline deadline) const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (received_) return true;  // (also once taken: complete)
    }
    return SourceWaitUntil(deadline);
  }
  bool IsReady() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return received_ || source_->IsReady();  // (taken: received, so complete)
  }
  bool Valid() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !taken_;
  }
  void OnReady(std::function<void()> callback) override { source_->OnReady(std::move(callback)); }

 private:
  // The source's WaitUntil, or true if another thread received the completion meanwhile (the
  // source then says it was taken).
  bool SourceWaitUntil(Deadline deadline) const {
    try {
      return source_->WaitUntil(deadline);
    } catch (const FutureError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (e.code() == FutureErrc::kNoState && received_) return true;
      throw;
    }
  }

  // The completion, taken from the source on first use (precondition: complete, its callbacks
  // run). Any failure to read it becomes the completion's error.
  const Result<T>& ReceivedLocked() {
    if (!received_) {
      try {
        ReceivedValue taken = source_->Take();
        received_ = Result<T>::Value(codec_->Read(taken.header, taken.payload,
                                                  taken.payload_bytes,
                                                  std::move(taken.keep_alive)));
      } catch (const FutureError& e) {
        received_ = Result<T>::Error(ErrorInfo{e.code(), e.detail(), e.origin()});
      } catch (const std::exception& e) {
        received_ = Result<T>::Error(FutureErrc::kInvalidHandle,
                                     std::string("the published value could not be read: ") +
                                         e.what());
      }
    }
    return *received_;
  }

  const std::shared_ptr<ReceivedSource> source_;
  const std::shared_ptr<const ValueCodec<T>> codec_;
  mutable std::mutex mu_;
  std::optional<Result<T>> received_;  // guarded by mu_: the completion, once received
  bool taken_ = false;                 // guarded by mu_: Get() took it
};

// The future of a cross-process pair whose consumer end is `consumer` (FileConsumer,
// NetworkConsumer): only in the process that created the pair, and once. `kind` names it in
// errors.
template <typename T, typename Consumer>
std::unique_ptr<FutureBackend<T>> FutureOfPair(const std::shared_ptr<Consumer>& consumer,
                                               std::shared_ptr<const ValueCodec<T>> codec,
                                               const char* kind) {
  if (!consumer || !consumer->InCreatorProcess()) {
    throw FutureError(FutureErrc::kFutureAlreadyRetrieved,
                      std::string("the future of a ") + kind + " pair stays with the process "
                      "that created it; this promise was deserialized or inherited by a forked "
                      "child");
  }
  if (!consumer->RetrieveFuture()) {
    throw FutureError(FutureErrc::kFutureAlreadyRetrieved, kFutureRetrievedDetail);
  }
  return std::make_unique<ReceivedFuture<T>>(consumer, std::move(codec));
}

}  // namespace dtorch::core
