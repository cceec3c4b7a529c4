// What forming a 2-member Gloo group costs on the launcher's kind of store
// (etcd), with the check that every pair reaches a member (comm/transport/gloo_group.h: greetings and a
// store round) against Gloo's own formation alone.
// Run: build/noloco_benchmarks --benchmark_filter=Form
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"
#include "comm/transport/gloo_group.h"

namespace {

const std::chrono::milliseconds kTimeout(10000);

void BM_FormGlooGroup(benchmark::State& state) {
  const bool checked = state.range(0) != 0;
  noloco::EtcdServer server("127.0.0.1", 0, "bench");
  c10::intrusive_ptr<c10d::Store> stores[2];
  noloco::WorkerEnv envs[2];
  for (int r = 0; r < 2; ++r) {
    stores[r] = c10::make_intrusive<noloco::EtcdStore>(server.endpoint(), "root", "bench", kTimeout);
    envs[r].rank = r;
    envs[r].world = 2;
    envs[r].token = "bench";
  }
  auto form = [&](int r, const std::string& name) {
    if (checked) return noloco::join_gloo_group(stores[r], envs[r], name, r, 2, "127.0.0.1", kTimeout, nullptr);
    // A device of its own, as join_gloo_group's every try has.
    auto options = c10d::ProcessGroupGloo::Options::create(kTimeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(noloco::run_scope(stores[r], "bench", name), r, 2, options);
  };
  int64_t n = 0;
  for (auto _ : state) {
    const auto name = fmt::format("bench/{}", n++);
    noloco::GlooGroup other;
    std::thread peer([&] { other = form(1, name); });
    auto mine = form(0, name);
    peer.join();
    state.PauseTiming();
    mine.reset();
    other.reset();
    state.ResumeTiming();
  }
}

}  // namespace

BENCHMARK(BM_FormGlooGroup)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(40);
