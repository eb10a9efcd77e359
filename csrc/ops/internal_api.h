// What libdtorch_ops.so exports to the project's own other binaries, besides the public API
// (<dtorch/dtorch.h>): the Python module dtorch_ops._C and the simulated device of the tests.
// Every such symbol is declared here, and only here, with DTORCH_INTERNAL_API. Not installed and
// not a stable interface: C++ users must not rely on it. (The library is built with
// -fvisibility=hidden: a symbol not marked DTORCH_API or DTORCH_INTERNAL_API stays inside it.)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <dtorch/dtorch.h>

#include "../core/lifecycle.h"
#include "../core/settings.h"
#include "device_completion.h"
#include "runtime_hooks.h"

namespace c10d {
class Backend;
}  // namespace c10d

#define DTORCH_INTERNAL_API __attribute__((visibility("default")))

namespace dtorch {

namespace core {
class NativeError;
class ReadyNotifier;
}

// ---- The embedding runtime (_C): installs its hooks once, when it loads (runtime_hooks.h).
DTORCH_INTERNAL_API void SetRuntimeHooks(const RuntimeHooks& hooks);

// ---- Device backends (device_completion.h). Registered at load time by a backend's static
// initialiser (CUDA's in csrc/cuda/, the simulated device of the tests); each registration replaces
// the type's previous one, and what it points to lives for the process. Thread-safe.

// The type's own event recorder: values whose event is recorded from then on are waited for on
// its DeviceEvents (a detector sleeps in DeviceEvent::Wait); nullptr opts the type out again (its
// c10::Events are polled with back-off).
DTORCH_INTERNAL_API void RegisterDeviceEvents(c10::DeviceType type, DeviceEvents* events);

// The type's graph-capture query: get_tensor, to_torch_async, the host copy and sync refuse a
// stream it reports capturing (CheckNotCapturing). nullptr: never refused.
DTORCH_INTERNAL_API void RegisterCaptureCheck(c10::DeviceType type, StreamCaptureQuery query);

// A device type's interprocess memory sharing (CUDA: the caching allocator's IPC handles, as
// torch.multiprocessing uses). Thread-safe.
class DeviceIpc {
 public:
  virtual ~DeviceIpc() = default;
  // Producer, on a library thread, after the work writing `block` has finished (no event
  // travels). `block` is a dense tensor the caller keeps alive until the consumer has released it;
  // the record covers its bytes from its first element to the end of its storage. Returns an
  // opaque record (at most kMaxRecordBytes) another process of this host can open. Throws
  // c10::Error when the memory cannot be shared (CUDA: not from torch's caching allocator, or in
  // an expandable segment).
  virtual std::string Export(const at::Tensor& block) = 0;
  // Consumer: opens a record (untrusted: its size and format are validated, and the bytes the view
  // spans must fit the exported size) as a view of dtype/sizes/strides (strides >= 0) on device
  // `index` of this type. The returned tensor keeps the mapping open for as long as it (its
  // storage) lives; `on_release` (may be empty) runs once after that storage is freed and the work
  // queued on the freeing thread's current stream of that device by then has finished (as
  // torch.multiprocessing's rule: work on other streams must be synchronised by the user), on a
  // library thread; it must not throw or take the GIL. Not run if that work fails or the process
  // exits or forks first (the mapping is then kept). Throws c10::Error for a bad record or a
  // failed open.
  virtual at::Tensor Open(std::string_view record, c10::DeviceIndex index, c10::ScalarType dtype,
                          c10::IntArrayRef sizes, c10::IntArrayRef strides,
                          std::function<void()> on_release) = 0;
  // The index, in this process, of the device that holds the record's memory (the same physical
  // device: processes may number devices differently, e.g. under CUDA_VISIBLE_DEVICES), or -1 when
  // this process does not see that device, the record is bad, or the type cannot tell.
  virtual c10::DeviceIndex LocalIndex(std::string_view record) { return -1; }

  static constexpr size_t kMaxRecordBytes = 256;
};
// `ipc` lives for the process.
DTORCH_INTERNAL_API void RegisterDeviceIpc(c10::DeviceType type, DeviceIpc* ipc);
// The type's DeviceIpc, nullptr when it has none (the simulated device has none). Inside the
// library only.
DTORCH_INTERNAL_API DeviceIpc* FindDeviceIpc(c10::DeviceType type);

// ---- Event loops (asyncio's `await`).
// torch.classes.dtorch.ReadyNotifier: an event loop's wake-up channel, an eventfd
// (core/ready_notifier.h). One per asyncio loop; futures post tokens to it when they complete.
class DTORCH_INTERNAL_API ReadyNotifier : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "ReadyNotifier";
  ReadyNotifier();
  ~ReadyNotifier() override;
  std::string Kind() const { return "eventfd"; }
  int64_t FileNo() const;
  std::vector<int64_t> Drain();
  // Pending completion callbacks hold it weakly (NotifyWhenReady): this object owns the eventfd.
  const std::shared_ptr<core::ReadyNotifier>& core() const { return core_; }

 private:
  const std::shared_ptr<core::ReadyNotifier> core_;
};

// The callback that posts `token` to `notifier`. It holds the notifier weakly: a notifier dropped
// with its event loop closes its eventfd at once, and a late completion posts nothing; nor does a
// completion in a fork child of the process that registered it.
DTORCH_INTERNAL_API std::function<void()> ReadyPoster(
    const c10::intrusive_ptr<ReadyNotifier>& notifier, int64_t token);

// Posts `token` to `notifier` once `waitable` (any future class, a VoidFutureCollect) is ready, at
// once if it is: how an event loop awaits it. Never consumes.
template <typename Waitable>
void NotifyWhenReady(const c10::intrusive_ptr<Waitable>& waitable,
                     const c10::intrusive_ptr<ReadyNotifier>& notifier, int64_t token) {
  waitable->OnReady(ReadyPoster(notifier, token));
}

namespace internal {

// ---- Promises from the bindings.
// Python's set_exception(exc): fails `promise` with a producer error set from an exception, its
// `message`, type name and traceback text, and `native` (the exception object itself: a consumer
// in this process raises it as it is). Throws as Promise::SetException.
DTORCH_INTERNAL_API void SetExceptionObject(const c10::intrusive_ptr<TensorPromise>& promise,
                                            const std::string& message,
                                            const std::string& exception_type,
                                            const std::string& traceback,
                                            std::shared_ptr<const core::NativeError> native);
DTORCH_INTERNAL_API void SetExceptionObject(const c10::intrusive_ptr<VoidPromise>& promise,
                                            const std::string& message,
                                            const std::string& exception_type,
                                            const std::string& traceback,
                                            std::shared_ptr<const core::NativeError> native);
// This process holds `promise`, received without deserializing it (a forked multiprocessing
// child's arguments): for the kinds that cross processes it registers as a holder, as
// deserializing does. Never throws.
DTORCH_INTERNAL_API void RegisterHolder(const c10::intrusive_ptr<TensorPromise>& promise);
DTORCH_INTERNAL_API void RegisterHolder(const c10::intrusive_ptr<VoidPromise>& promise);
// Whether setting a CPU value on `promise` now would wake nobody and copy nothing (a memory pair
// that nobody waits on): a binding then sets it without releasing the GIL. A hint.
DTORCH_INTERNAL_API bool CompletesQuietly(const c10::intrusive_ptr<TensorPromise>& promise);
DTORCH_INTERNAL_API bool CompletesQuietly(const c10::intrusive_ptr<VoidPromise>& promise);
// Fails `promise` with FutureErrc::kTimeout and `detail` once timeout_ms has passed, unless it was
// completed by then (a timer of the completion pool: no thread of its own). Holds it weakly.
// Returns what cancels the timer (callable from any thread; call it once the promise is set).
DTORCH_INTERNAL_API std::function<void()> FailAfter(const c10::intrusive_ptr<VoidPromise>& promise,
                                                    int64_t timeout_ms, std::string detail);

// ---- Tracing: a future that fails with `message` (what fake kernels return for a list of host
// copies, so that reading a traced stand-in raises instead of yielding no tensors).
DTORCH_INTERNAL_API c10::intrusive_ptr<TensorListFuture> FailedTensorListFuture(
    const std::string& message);

// ---- Threads, fork and exit (core/lifecycle.h, core/completion_pool.h).
DTORCH_INTERNAL_API uint64_t ForkGeneration();
// Runs `work` on the pool, one at a time and in posting order (one strand, made again in a fork
// child).
DTORCH_INTERNAL_API void PostInOrder(std::function<void()> work);
DTORCH_INTERNAL_API void StopLibraryThreads();
// Threads of each lifecycle participant, by its name.
DTORCH_INTERNAL_API std::map<std::string, size_t> CountLibraryThreads();
// The diagnostics of each lifecycle participant (core/lifecycle.h), by its name.
DTORCH_INTERNAL_API std::map<std::string, core::Diagnostics> LibraryDiagnostics();
// The next `count` detector thread starts fail (as if the system refused a thread).
DTORCH_INTERNAL_API void FailDetectorThreadStartsForTesting(int count);

// In a child process about to exit without the library's exit handler (multiprocessing's fork
// start): every lifecycle participant's ending_without_exit_handler (the consumers of its
// cross-process promises then read "producer exited" once it is gone).
DTORCH_INTERNAL_API void AtChildExit();
// The file kind's test hook (ops/kinds/file.cpp): takes the interprocess lock of the serialized
// file promise and never returns.
[[noreturn]] DTORCH_INTERNAL_API void HoldFilePromiseLockForTesting(const std::string& serialized);
// Test-only, the tensor codec of file promises (tensor_codec.h) alone: the header and payload a
// producer publishes for `value` (a device value is staged to the host as it would be), and the
// tensor a consumer with `value_options` makes of a header and payload from another process
// (untrusted input: a bad one raises InvalidHandleError).
DTORCH_INTERNAL_API std::pair<std::string, std::string> EncodeTensorForTesting(
    const at::Tensor& value);
DTORCH_INTERNAL_API at::Tensor DecodeTensorForTesting(const std::string& header,
                                                      const std::string& payload,
                                                      const std::string& value_options);

// ---- Kinds (ops/kinds.h): whether the kind named `kind` may be set in another process (false for
// a name no kind has).
DTORCH_INTERNAL_API bool KindCrossesProcesses(std::string_view kind);

// ---- The network kind's point-to-point links (ops/kinds/network_pairs.cpp): `maker(host, port,
// prefix, rank, timeout_ms)` makes this process's end of a 2-rank group on a PrefixStore(prefix)
// of the store at host:port (blocking until both ends connected; throws on failure). Set by the
// bindings where torch.distributed's Gloo is there; an empty maker: the store path only.
using PairGroupMaker = std::function<c10::intrusive_ptr<c10d::Backend>(
    const std::string& host, int port, const std::string& prefix, int rank, int64_t timeout_ms)>;
DTORCH_INTERNAL_API void SetPairGroupMaker(PairGroupMaker maker);

// ---- Settings (core/settings.h: the one table dtorch_ops.config is built from). SetSetting
// throws std::invalid_argument for a value out of range, std::out_of_range for an unknown name.
DTORCH_INTERNAL_API std::vector<core::Setting> AllSettings();
DTORCH_INTERNAL_API int64_t GetSetting(const std::string& name);
DTORCH_INTERNAL_API void SetSetting(const std::string& name, int64_t value);

}  // namespace internal
}  // namespace dtorch
