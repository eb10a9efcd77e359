// simdev: a simulated asynchronous accelerator for tests, registered through PrivateUse1 (in the
// spirit of PyTorch's OpenReg test backend). Test-only: built by tests/simdev/__init__.py, never
// shipped.
//
// Two devices (simdev:0, simdev:1). Memory is host memory. Each stream is a worker thread that runs its queued kernels in order,
// so a kernel call returns before its work is done, and an event completes only when the worker
// reaches it. Kernels: empty, copies to/from CPU (a non-blocking copy into pinned host memory, as
// t.to("cpu", non_blocking=True) makes it, stays asynchronous on the stream, as on CUDA; other
// copies touching host memory wait for their turn), fill_, add, mul, views, and ops in the simdev
// namespace: sleep(ms) (a kernel that takes ms milliseconds), fail(message) (a kernel that faults,
// like a device-side error: the stream's later events report it), streams, synchronize, and the
// live allocation count. Its events can be waited for without spinning: it registers its own event
// recorder with dtorch (dtorch::RegisterDeviceEvents), which the tests can switch off to exercise
// the polling path, or to untimed waits (as CUDA's cudaEventSynchronize). A stream can be marked
// as capturing (set_capturing, as in a CUDA graph capture): dtorch's registered capture
// check refuses to wait for it. For the benchmarks: a kernel that stamps the time it ran, and an
// anchor wake chain (kernel -> relay thread -> caller, two condition-variable hops).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "ops/internal_api.h"  // dtorch's device-event and capture registrations (libdtorch_ops)

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

namespace simdev {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

// ---- streams: one worker thread each, kernels run in order ----

class StreamWorker {
 public:
  StreamWorker() : thread_([this] { Run(); }) { thread_.detach(); }

  void Enqueue(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      ++enqueued_;
    }
    cv_.notify_all();
  }

  // Blocks until everything enqueued so far has run.
  void Synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    cv_.wait(lock, [&] { return done_ >= target; });
  }

  bool Idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ == enqueued_;
  }

  // The first fault on this stream, if any ("sticky", like a device-side error).
  std::optional<std::string> Fault() {
    std::lock_guard<std::mutex> lock(mu_);
    return fault_;
  }

  void SetFault(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fault_) fault_ = message;
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        task();
      } catch (const std::exception& e) {
        SetFault(e.what());
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  uint64_t enqueued_ = 0;                    // guarded by mu_
  uint64_t done_ = 0;                        // guarded by mu_
  std::optional<std::string> fault_;         // guarded by mu_
  std::thread thread_;
};

class Runtime {
 public:
  static Runtime& Get() {
    static Runtime* runtime = new Runtime();  // leaked: workers outlive static destruction
    return *runtime;
  }

  StreamWorker& Stream(c10::DeviceIndex device, c10::StreamId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& worker = workers_[{device, id}];
    if (!worker) worker = std::make_unique<StreamWorker>();
    return *worker;
  }

  c10::StreamId NewStream() { return next_stream_.fetch_add(1); }

  void SynchronizeAll() {
    std::vector<StreamWorker*> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : workers_) all.push_back(entry.second.get());
    }
    for (auto* worker : all) worker->Synchronize();
  }

  size_t StreamCount(std::optional<c10::DeviceIndex> device = std::nullopt) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t count = 0;
    for (const auto& entry : workers_) count += !device || entry.first.first == *device;
    return count;
  }

 private:
  std::mutex mu_;
  // guarded by mu_: one worker per (device, stream)
  std::map<std::pair<c10::DeviceIndex, c10::StreamId>, std::unique_ptr<StreamWorker>> workers_;
  std::atomic<c10::StreamId> next_stream_{1};                       // 0 is the default stream
};

constexpr c10::DeviceIndex kDeviceCount = 2;
thread_local c10::DeviceIndex current_device = 0;
thread_local std::array<c10::StreamId, kDeviceCount> current_stream{};  // per device; 0: default

c10::Device DeviceAt(c10::DeviceIndex index) { return c10::Device(kType, index); }

// The current stream of `device` (of the current device by default) on this thread.
StreamWorker& CurrentWorker(std::optional<c10::DeviceIndex> device = std::nullopt) {
  const auto index = device.value_or(current_device);
  return Runtime::Get().Stream(index, current_stream[index]);
}

// The current stream of the device a tensor lives on: where kernels on it run.
StreamWorker& WorkerFor(const at::Tensor& t) { return CurrentWorker(t.device().index()); }

// ---- events ----

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;                // guarded by mu: versions scheduled
  uint64_t completed = 0;               // guarded by mu: versions the stream reached
  std::optional<std::string> fault;     // guarded by mu: a fault seen before the version

  void ThrowIfFaultLocked() {
    TORCH_CHECK(!fault, "simdev: device-side error: ", *fault);
  }
};

struct Event {
  std::shared_ptr<EventState> state = std::make_shared<EventState>();
};

// Schedules the next version of `state` on `stream`: it completes when the stream reaches it.
void RecordOn(const std::shared_ptr<EventState>& state, const c10::Stream& stream) {
  uint64_t version;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    version = ++state->recorded;
  }
  StreamWorker& worker = Runtime::Get().Stream(stream.device_index(), stream.id());
  worker.Enqueue([state, version, &worker] {
    auto fault = worker.Fault();
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->completed = std::max(state->completed, version);
      if (fault) state->fault = fault;
    }
    state->cv.notify_all();
  });
}

// ---- allocator ----

std::mutex live_mu;
std::set<uintptr_t> live;  // guarded by live_mu: addresses of allocations not yet freed

struct SimAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? std::malloc(nbytes) : nullptr;
    TORCH_CHECK(!nbytes || data, "simdev: out of memory allocating ", nbytes, " bytes");
    if (data) {
      std::lock_guard<std::mutex> lock(live_mu);
      live.insert(reinterpret_cast<uintptr_t>(data));
    }
    return {data, data, &Free, DeviceAt(current_device)};
  }
  static void Free(void* data) {
    if (data) {
      std::lock_guard<std::mutex> lock(live_mu);
      live.erase(reinterpret_cast<uintptr_t>(data));
    }
    std::free(data);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    default_copy_data(dest, src, count);
  }
};

SimAllocator allocator;
REGISTER_ALLOCATOR(kType, &allocator);

// Pinned host memory (the hooks' pinned allocator; torch asks for it when a non-blocking copy to
// the CPU starts): plain host memory whose ranges are remembered, so that isPinnedPtr and the copy
// kernel can tell it from pageable memory.
std::mutex pinned_mu;
std::map<uintptr_t, size_t> pinned;  // guarded by pinned_mu: start -> size, of live blocks

bool IsPinnedHere(const void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(pinned_mu);
  auto after = pinned.upper_bound(address);
  if (after == pinned.begin()) return false;
  const auto block = std::prev(after);
  return address < block->first + std::max<size_t>(block->second, 1);
}

// Pinned by us, or by CUDA: where CUDA is present torch takes its pinned memory from CUDA's host
// allocator (it asks CUDA first), and asks us (the registered accelerator) whether a pointer is
// pinned.
bool IsPinned(const void* data) {
  return IsPinnedHere(data) ||
         (at::globalContext().hasCUDA() && at::detail::getCUDAHooks().isPinnedPtr(data));
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = std::malloc(std::max<size_t>(nbytes, 1));
    TORCH_CHECK(data, "simdev: out of pinned memory allocating ", nbytes, " bytes");
    {
      std::lock_guard<std::mutex> lock(pinned_mu);
      pinned[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return {data, data, &Free, c10::Device(c10::kCPU)};
  }
  static void Free(void* data) {
    {
      std::lock_guard<std::mutex> lock(pinned_mu);
      pinned.erase(reinterpret_cast<uintptr_t>(data));
    }
    std::free(data);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

// ---- device guard ----

struct SimGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  static c10::DeviceIndex Index(c10::Device d) { return d.has_index() ? d.index() : current_device; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const auto previous = getDevice();
    setDevice(d);
    return previous;
  }
  c10::Device getDevice() const override { return DeviceAt(current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(Index(d) >= 0 && Index(d) < kDeviceCount, "simdev: no device ", d);
    current_device = Index(d);
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = Index(d); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, DeviceAt(Index(d)), current_stream[Index(d)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, DeviceAt(Index(d)), 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, DeviceAt(Index(d)), Runtime::Get().NewStream());
  }
  // As CUDA's: a few streams per device, handed out round robin (each stream has a worker thread).
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    static constexpr int kPoolStreams = 4;
    static std::array<std::array<std::atomic<c10::StreamId>, kPoolStreams>, kDeviceCount> pool{};
    static std::atomic<uint32_t> next{0};
    auto& slot = pool[Index(d)][next.fetch_add(1) % kPoolStreams];
    c10::StreamId id = slot.load();
    if (id == 0) {
      c10::StreamId fresh = Runtime::Get().NewStream();
      id = slot.compare_exchange_strong(id, fresh) ? fresh : id;
    }
    return c10::Stream(c10::Stream::UNSAFE, DeviceAt(Index(d)), id);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto previous = getStream(s.device());
    current_stream[s.device_index()] = s.id();
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    RecordOn(static_cast<Event*>(*event)->state, stream);
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;
    auto state = static_cast<Event*>(event)->state;
    uint64_t version;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      version = state->recorded;
    }
    Runtime::Get().Stream(stream.device_index(), stream.id()).Enqueue([state, version] {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->completed >= version; });
    });
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    auto& state = *static_cast<Event*>(event)->state;
    std::lock_guard<std::mutex> lock(state.mu);
    const bool done = state.completed >= state.recorded;
    if (done) state.ThrowIfFaultLocked();
    return done;
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    auto& state = *static_cast<Event*>(event)->state;
    std::unique_lock<std::mutex> lock(state.mu);
    state.cv.wait(lock, [&] { return state.completed >= state.recorded; });
    state.ThrowIfFaultLocked();
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);  // pending stream tasks hold the state, not the Event
  }
  bool queryStream(const c10::Stream& stream) const override {
    return Runtime::Get().Stream(stream.device_index(), stream.id()).Idle();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    Runtime::Get().Stream(stream.device_index(), stream.id()).Synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    Runtime::Get().SynchronizeAll();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

// dtorch's detectors sleep on these instead of polling c10::Events: a slice at a time (timed), or
// until the stream reaches the event (untimed, as CUDA's cudaEventSynchronize).
class SimDeviceEvent final : public dtorch::DeviceEvent {
 public:
  SimDeviceEvent(std::shared_ptr<EventState> state, bool timed)
      : state_(std::move(state)), timed_(timed) {}

  bool Query() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    const bool done = DoneLocked();
    if (done) state_->ThrowIfFaultLocked();
    return done;
  }

  bool Wait(std::chrono::microseconds timeout) override {
    std::unique_lock<std::mutex> lock(state_->mu);
    bool done = true;
    if (timed_) {
      done = state_->cv.wait_for(lock, timeout, [&] { return DoneLocked(); });
    } else {
      state_->cv.wait(lock, [&] { return DoneLocked(); });
    }
    if (done) state_->ThrowIfFaultLocked();
    return done;
  }

  bool Timed() const override { return timed_; }

 private:
  bool DoneLocked() const { return state_->completed >= state_->recorded; }

  const std::shared_ptr<EventState> state_;
  const bool timed_;
};

class SimDeviceEvents final : public dtorch::DeviceEvents {
 public:
  explicit SimDeviceEvents(bool timed) : timed_(timed) {}
  std::unique_ptr<dtorch::DeviceEvent> Record(const c10::Stream& stream) override {
    auto state = std::make_shared<EventState>();
    RecordOn(state, stream);
    return std::make_unique<SimDeviceEvent>(std::move(state), timed_);
  }

 private:
  const bool timed_;
};

// Leaked: registered recorders live for the process.
SimDeviceEvents& timed_events = *new SimDeviceEvents(/*timed=*/true);
SimDeviceEvents& untimed_events = *new SimDeviceEvents(/*timed=*/false);

// Simulated graph capture: the streams marked capturing, which dtorch's capture check refuses.
std::mutex capture_mu;
std::set<std::pair<c10::DeviceIndex, c10::StreamId>> capturing;  // guarded by capture_mu

bool IsCapturing(const c10::Stream& stream) {
  std::lock_guard<std::mutex> lock(capture_mu);
  return capturing.count({stream.device_index(), stream.id()}) > 0;
}

const bool registered_with_dtorch = [] {
  dtorch::RegisterDeviceEvents(kType, &timed_events);
  dtorch::RegisterCaptureCheck(kType, &IsCapturing);
  return true;
}();

// Hooks: tell torch (and dtorch's sync(devices=None)) whether this process has used the device.
// And the pinned host memory of non-blocking copies to the CPU.
struct SimHooks final : at::PrivateUse1HooksInterface {
  bool hasPrimaryContext(c10::DeviceIndex device) const override {
    return Runtime::Get().StreamCount(device) > 0;
  }
  bool isPinnedPtr(const void* data) const override { return IsPinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new SimHooks());
  return true;
}();

// ---- kernels ----

// A CPU tensor over the same memory (built on the worker thread, when the kernel runs).
at::Tensor HostAlias(const at::Tensor& t) {
  if (!t.is_privateuseone()) return t;  // a CPU operand (e.g. a wrapped scalar)
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(),
                       t.options().device(c10::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  const c10::OptionalDeviceGuard guard(device);  // the allocator allocates on the current device
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &allocator, ks, c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  const c10::OptionalDeviceGuard guard(device);
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &allocator, ks,
                                           c10::dtype_or_default(dtype));
}

// Copies are ordered on the current stream. A copy that touches host memory waits for its turn
// (like a blocking cudaMemcpy), so the host side is safe to use or free afterwards; except a
// non-blocking copy into pinned host memory, which stays queued (like cudaMemcpyAsync): its
// destination is valid once the stream has passed it (an event recorded after it, a sync).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  StreamWorker& worker = WorkerFor(dst.is_privateuseone() ? dst : self);
  worker.Enqueue([self, dst] { HostAlias(dst).copy_(HostAlias(self)); });
  const bool async_to_pinned = non_blocking && self.is_privateuseone() && dst.is_cpu() &&
                               IsPinned(dst.storage().data());
  if (!async_to_pinned && (!self.is_privateuseone() || !dst.is_privateuseone())) {
    worker.Synchronize();
    auto fault = worker.Fault();
    TORCH_CHECK(!fault, "simdev: device-side error: ", *fault);
  }
  return dst;
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  WorkerFor(self).Enqueue([self, value] { HostAlias(self).fill_(value); });
  return self;
}

at::Tensor Binary(const at::Tensor& a, const at::Tensor& b,
                  std::function<void(at::Tensor&, const at::Tensor&, const at::Tensor&)> op) {
  const auto dtype = at::result_type(a, b);
  at::Tensor out = at::empty(at::infer_size(a.sizes(), b.sizes()),
                             a.options().dtype(dtype).device(a.device()));
  WorkerFor(a).Enqueue([out, a, b, op] {
    at::Tensor host_out = HostAlias(out);
    op(host_out, HostAlias(a), HostAlias(b));
  });
  return out;
}

at::Tensor add(const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha) {
  return Binary(a, b, [alpha](at::Tensor& o, const at::Tensor& x, const at::Tensor& y) {
    at::add_out(o, x, y, alpha);
  });
}

at::Tensor mul(const at::Tensor& a, const at::Tensor& b) {
  return Binary(a, b, [](at::Tensor& o, const at::Tensor& x, const at::Tensor& y) {
    at::mul_out(o, x, y);
  });
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::cpu::as_strided(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

// ---- simdev:: ops for the tests ----

void sleep_kernel(int64_t ms) {
  CurrentWorker().Enqueue([ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
}

void sleep_us_kernel(int64_t us) {
  CurrentWorker().Enqueue([us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}

// Gates: a kernel that waits until the test opens its gate (deterministic "busy device").
// Leaked, never destroyed: a worker may still wait at a closed gate when the process exits, and
// destroying a condition variable with a waiter blocks (glibc).
std::mutex& gate_mu = *new std::mutex();
std::condition_variable& gate_cv = *new std::condition_variable();
std::set<int64_t>& closed_gates = *new std::set<int64_t>();  // guarded by gate_mu
int64_t next_gate = 0;                                      // guarded by gate_mu

int64_t hold_kernel() {
  int64_t gate;
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    gate = next_gate++;
    closed_gates.insert(gate);
  }
  CurrentWorker().Enqueue([gate] {
    std::unique_lock<std::mutex> lock(gate_mu);
    gate_cv.wait(lock, [gate] { return closed_gates.count(gate) == 0; });
  });
  return gate;
}

void release_gate(int64_t gate) {
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    closed_gates.erase(gate);
  }
  gate_cv.notify_all();
}

// At exit: open every gate and finish all queued work, so that no worker thread releases a tensor
// (which may need Python's GIL) while the interpreter is torn down.
void drain_at_exit() {
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    closed_gates.clear();
  }
  gate_cv.notify_all();
  Runtime::Get().SynchronizeAll();
}

void fail_kernel(const std::string& message) {
  CurrentWorker().Enqueue([message]() { throw std::runtime_error(message); });
}

int64_t new_stream() { return Runtime::Get().NewStream(); }

int64_t set_stream(int64_t id) {
  const int64_t previous = current_stream[current_device];
  current_stream[current_device] = id;
  return previous;
}

int64_t get_stream() { return current_stream[current_device]; }

int64_t set_device(int64_t index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "simdev: no device simdev:", index);
  const int64_t previous = current_device;
  current_device = static_cast<c10::DeviceIndex>(index);
  return previous;
}

int64_t get_device() { return current_device; }

void synchronize() { Runtime::Get().SynchronizeAll(); }

bool is_allocated(int64_t address) {
  std::lock_guard<std::mutex> lock(live_mu);
  return live.count(static_cast<uintptr_t>(address)) > 0;
}

int64_t stream_count() { return static_cast<int64_t>(Runtime::Get().StreamCount()); }

void set_blocking_wait(bool enabled, bool timed) {
  dtorch::RegisterDeviceEvents(kType,
                               enabled ? (timed ? &timed_events : &untimed_events) : nullptr);
}

// Marks the current stream (of the current device) as capturing, or not.
void set_capturing(bool on) {
  std::lock_guard<std::mutex> lock(capture_mu);
  const std::pair<c10::DeviceIndex, c10::StreamId> key{current_device,
                                                       current_stream[current_device]};
  if (on) {
    capturing.insert(key);
  } else {
    capturing.erase(key);
  }
}

// ---- benchmark helpers ----

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::mutex stamp_mu;
std::map<int64_t, int64_t> stamps;  // guarded by stamp_mu: slot -> steady_clock ns (0: not yet)
int64_t next_stamp = 0;             // guarded by stamp_mu

// A kernel that records when it runs; returns its slot.
int64_t stamp_kernel() {
  int64_t slot;
  {
    std::lock_guard<std::mutex> lock(stamp_mu);
    slot = next_stamp++;
    stamps[slot] = 0;
  }
  CurrentWorker().Enqueue([slot] {
    std::lock_guard<std::mutex> lock(stamp_mu);
    stamps[slot] = NowNs();
  });
  return slot;
}

// When the stamp kernel of `slot` ran (steady_clock ns, CLOCK_MONOTONIC: Python's
// time.monotonic_ns), 0 if not yet; forgets the slot once it has run.
int64_t stamp_ns(int64_t slot) {
  std::lock_guard<std::mutex> lock(stamp_mu);
  const auto it = stamps.find(slot);
  TORCH_CHECK(it != stamps.end(), "simdev: no stamp ", slot);
  const int64_t ns = it->second;
  if (ns != 0) stamps.erase(it);
  return ns;
}

// The anchor of the completion benchmark: a kernel on the current stream stamps the time and
// wakes a relay thread (hop 1), which wakes this caller (hop 2); returns the kernel's stamp.
struct Hop {
  std::mutex mu;
  std::condition_variable cv;
  bool set = false;  // guarded by mu
  void Set() {
    {
      std::lock_guard<std::mutex> lock(mu);
      set = true;
    }
    cv.notify_one();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return set; });
  }
};

int64_t two_hop_wait() {
  auto first = std::make_shared<Hop>();
  auto second = std::make_shared<Hop>();
  auto stamp = std::make_shared<std::atomic<int64_t>>(0);
  std::thread relay([first, second] {
    first->Wait();
    second->Set();
  });
  CurrentWorker().Enqueue([first, stamp] {
    stamp->store(NowNs());
    first->Set();
  });
  second->Wait();
  relay.join();
  return stamp->load();
}

}  // namespace
}  // namespace simdev

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &simdev::empty_memory_format);
  m.impl("empty_strided", &simdev::empty_strided);
  m.impl("_copy_from", &simdev::copy_from);
  m.impl("fill_.Scalar", &simdev::fill_scalar);
  m.impl("add.Tensor", &simdev::add);
  m.impl("mul.Tensor", &simdev::mul);
  m.impl("as_strided", &simdev::as_strided);
  m.impl("view", &simdev::view);
}

TORCH_LIBRARY(simdev, m) {
  // A kernel on the current stream that takes `ms` milliseconds.
  m.def("sleep(int ms) -> ()", &simdev::sleep_kernel);
  m.def("sleep_us(int us) -> ()", &simdev::sleep_us_kernel);
  // A kernel on the current stream that waits until release(gate) is called; returns the gate.
  m.def("hold() -> int", &simdev::hold_kernel);
  m.def("release(int gate) -> ()", &simdev::release_gate);
  // Process exit: opens all gates and finishes all queued work (see drain_at_exit).
  m.def("drain_at_exit() -> ()", &simdev::drain_at_exit);
  // A kernel on the current stream that faults; the stream's later events report the fault.
  m.def("fail(str message) -> ()", &simdev::fail_kernel);
  m.def("new_stream() -> int", &simdev::new_stream);
  // Makes stream `id` current (for the current device) on this thread; returns the previous one.
  m.def("set_stream(int id) -> int", &simdev::set_stream);
  // Makes simdev:`index` current on this thread; returns the previous index.
  m.def("set_device(int index) -> int", &simdev::set_device);
  m.def("get_device() -> int", &simdev::get_device);
  m.def("get_stream() -> int", &simdev::get_stream);
  m.def("synchronize() -> ()", &simdev::synchronize);
  // Whether the allocation starting at `address` (a data_ptr()) has not been freed yet.
  m.def("is_allocated(int address) -> bool", &simdev::is_allocated);
  m.def("stream_count() -> int", &simdev::stream_count);
  // Registers (true) or removes (false) the device events dtorch waits on for simdev (without:
  // dtorch polls c10::Events); timed=False makes their waits untimed (as CUDA's).
  m.def("set_blocking_wait(bool enabled, bool timed=True) -> ()", &simdev::set_blocking_wait);
  // Marks the current stream as being captured into a graph (true) or not (false).
  m.def("set_capturing(bool on) -> ()", &simdev::set_capturing);
  // A kernel on the current stream that records when it runs; returns its slot.
  m.def("stamp() -> int", &simdev::stamp_kernel);
  // When the stamp of `slot` ran (steady_clock ns), 0 if not yet.
  m.def("stamp_ns(int slot) -> int", &simdev::stamp_ns);
  // The benchmark's anchor: a two-hop wake chain from the stream; returns the kernel's stamp.
  m.def("two_hop_wait() -> int", &simdev::two_hop_wait);
}
