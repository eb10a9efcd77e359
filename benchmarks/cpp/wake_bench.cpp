// Cross-thread wake latency: the core's MemoryPromise/Future vs std::promise/std::future.
// Usage: wake_bench SAMPLES. Prints two lines, "memory_promise" and "std_promise", each followed
// by every sample (us, in the order taken; the caller takes the median, min and max).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>
#include <vector>

#include "core/promise_future.h"

using Clock = std::chrono::steady_clock;

template <typename MakePair>
double OneWake(MakePair make_pair) {
  auto [block, release] = make_pair();
  Clock::time_point t1;
  std::thread consumer([&] {
    block();
    t1 = Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the consumer block
  Clock::time_point t0 = Clock::now();
  release();
  consumer.join();
  return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

void PrintSamples(const char* name, const std::vector<double>& samples) {
  std::printf("%s", name);
  for (double us : samples) std::printf(" %.3f", us);
  std::printf("\n");
}

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::atoi(argv[1]) : 300;
  std::vector<double> ours, anchor;
  for (int i = 0; i < samples; ++i) {  // interleaved
    ours.push_back(OneWake([] {
      auto promise = std::make_shared<dtorch::core::MemoryPromise<int>>();
      std::shared_ptr<dtorch::core::FutureBackend<int>> future = promise->GetFuture();
      return std::make_pair([future] { future->Get(); }, [promise] { promise->SetValue(1); });
    }));
    anchor.push_back(OneWake([] {
      auto promise = std::make_shared<std::promise<int>>();
      auto future = std::make_shared<std::future<int>>(promise->get_future());
      return std::make_pair([future] { future->get(); }, [promise] { promise->set_value(1); });
    }));
  }
  PrintSamples("memory_promise", ours);
  PrintSamples("std_promise", anchor);
  return 0;
}
