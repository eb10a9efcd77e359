// Cross-thread wake latency: the core's MemoryPromise/Future vs std::promise/std::future.
// Usage: wake_bench SAMPLES. Prints "memory_promise <median us>" and "std_promise <median us>".
#include <algorithm>
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

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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
  std::printf("memory_promise %.3f\nstd_promise %.3f\n", Median(ours), Median(anchor));
  return 0;
}
