// What one store operation costs: c10d's TCPStore (torchrun's default) against
// our etcd-backed store, on loopback. Run: build/noloco_benchmarks --benchmark_filter=Store
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"

namespace {

using noloco::EtcdServer;
using noloco::EtcdStore;

const std::chrono::milliseconds kTimeout(10000);

c10::intrusive_ptr<c10d::Store> tcp_store(bool server, int port) {
  c10d::TCPStoreOptions o;
  o.port = uint16_t(port);
  o.isServer = server;
  o.waitWorkers = false;
  o.timeout = kTimeout;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

// One store of each kind for the whole benchmark run.
struct Stores {
  Stores() : etcd_server("127.0.0.1", 0, "bench") {
    tcp = tcp_store(true, 0);
    tcp_port = static_cast<c10d::TCPStore&>(*tcp).getPort();
    etcd = c10::make_intrusive<EtcdStore>(etcd_server.endpoint(), "root", "bench", kTimeout);
  }
  c10::intrusive_ptr<c10d::Store> connect(bool use_etcd) const {
    if (use_etcd) return c10::make_intrusive<EtcdStore>(etcd_server.endpoint(), "root", "bench", kTimeout);
    return tcp_store(false, tcp_port);
  }
  EtcdServer etcd_server;
  c10::intrusive_ptr<c10d::Store> tcp, etcd;
  int tcp_port = 0;
};

Stores& stores() {
  static Stores s;
  return s;
}

c10d::Store& pick(const benchmark::State& state) { return state.range(0) ? *stores().etcd : *stores().tcp; }
void name(benchmark::State& state) { state.SetLabel(state.range(0) ? "etcd" : "TCPStore"); }

void BM_StoreSet(benchmark::State& state) {
  auto& s = pick(state);
  const std::vector<uint8_t> value(64, 'x');
  int64_t i = 0;
  for (auto _ : state) s.set("set/" + std::to_string(i++ % 64), value);
  name(state);
}

void BM_StoreGet(benchmark::State& state) {
  auto& s = pick(state);
  s.set("get/k", std::vector<uint8_t>(64, 'x'));
  for (auto _ : state) benchmark::DoNotOptimize(s.get("get/k"));
  name(state);
}

void BM_StoreAdd(benchmark::State& state) {
  auto& s = pick(state);
  for (auto _ : state) benchmark::DoNotOptimize(s.add("add/k", 1));
  name(state);
}

void BM_StoreCompareSet(benchmark::State& state) {
  auto& s = pick(state);
  std::vector<uint8_t> current(1, '0');
  s.set("cas/k", current);
  for (auto _ : state) {
    std::vector<uint8_t> next(1, uint8_t('0' + (current[0] - '0' + 1) % 10));
    current = s.compareSet("cas/k", current, next);
  }
  name(state);
}

// A waiter blocked on a key, woken by a write on another connection: the
// latency of a meeting (NoLoCo partners, Gloo rendezvous).
void BM_StoreWaitWakeUp(benchmark::State& state) {
  auto& s = pick(state);
  const auto writer = stores().connect(state.range(0) != 0);
  int64_t i = 0;
  for (auto _ : state) {
    const std::string key = "wake/" + std::to_string(state.range(0)) + "/" + std::to_string(i++);
    std::thread t([&] { writer->set(key, std::vector<uint8_t>{1}); });
    s.wait({key});
    t.join();
  }
  name(state);
}

}  // namespace

BENCHMARK(BM_StoreSet)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StoreGet)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StoreAdd)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StoreCompareSet)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StoreWaitWakeUp)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
