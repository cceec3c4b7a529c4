// What a pair of workers pays on loopback to get a way to each other and to
// trade a message each way at once: opening a link (comm/link/: our
// handshake, its addresses read from an etcd store) against forming a
// checked 2-member Gloo group (comm/transport/gloo_group.h), and trading over
// a held link (sealed frames) against Gloo's send and receive on a formed
// group with the payload sealed as collectives seal it (comm/transport/seal.h).
// Run: build/noloco_benchmarks --benchmark_filter='Link|Gloo'
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "comm/link/link_book.h"
#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"
#include "comm/store/run_keys.h"
#include "comm/transport/gloo_group.h"
#include "comm/transport/link_messages.h"
#include "comm/transport/seal.h"

namespace {

using namespace noloco;

const std::chrono::milliseconds kTimeout(10000);
const std::string kToken = "bench";

struct Pair {
  EtcdServer server{"127.0.0.1", 0, "bench"};
  std::shared_ptr<LinkEndpoint> endpoints[2];
  std::unique_ptr<LinkBook> books[2];
  Pair() {
    for (int r = 0; r < 2; ++r) {
      endpoints[r] = std::make_shared<LinkEndpoint>(LinkEndpointOptions{}, run_key(kToken, "link"),
                                                    run_key(kToken, "relay"));
      books[r] = std::make_unique<LinkBook>(
          c10::make_intrusive<EtcdStore>(server.endpoint(), "root", "bench", kTimeout), kToken,
          LinkEnd{"bench", r, 0}, endpoints[r]);
    }
  }
  // Both ends open a new link at once.
  LinkPtr open(const std::string& attempt, LinkPtr* other) {
    std::string problem[2];
    std::thread peer([&] {
      *other = books[1]->link_to({"bench", 0, 0}, 0, attempt, Clock::now() + kTimeout, nullptr, &problem[1]);
    });
    auto mine = books[0]->link_to({"bench", 1, 0}, 0, attempt, Clock::now() + kTimeout, nullptr, &problem[0]);
    peer.join();
    if (!mine || !*other) throw std::runtime_error("no link: " + problem[0] + problem[1]);
    return mine;
  }
};

void BM_OpenLink(benchmark::State& state) {
  Pair pair;
  int64_t n = 0;
  for (auto _ : state) {
    LinkPtr other;
    auto mine = pair.open(fmt::format("{}", n++), &other);
    benchmark::DoNotOptimize(mine.get());
  }
}

void BM_FormCheckedGlooGroup(benchmark::State& state) {
  EtcdServer server("127.0.0.1", 0, "bench");
  c10::intrusive_ptr<c10d::Store> stores[2];
  WorkerEnv envs[2];
  for (int r = 0; r < 2; ++r) {
    stores[r] = c10::make_intrusive<EtcdStore>(server.endpoint(), "root", "bench", kTimeout);
    envs[r].rank = r;
    envs[r].world = 2;
    envs[r].token = kToken;
  }
  int64_t n = 0;
  for (auto _ : state) {
    const auto name = fmt::format("bench/{}", n++);
    GlooGroup other;
    std::thread peer([&] { other = join_gloo_group(stores[1], envs[1], name, 1, 2, "127.0.0.1", kTimeout, nullptr); });
    auto mine = join_gloo_group(stores[0], envs[0], name, 0, 2, "127.0.0.1", kTimeout, nullptr);
    peer.join();
    state.PauseTiming();
    mine.reset();
    other.reset();
    state.ResumeTiming();
  }
}

// One message each way at once over a held link: a header, then the payload.
void BM_TradeOverLink(benchmark::State& state) {
  const size_t bytes = size_t(state.range(0));
  Pair pair;
  LinkPtr other;
  auto mine = pair.open("trade", &other);
  std::vector<uint8_t> out[2] = {std::vector<uint8_t>(bytes, 1), std::vector<uint8_t>(bytes, 2)};
  std::vector<uint8_t> in[2] = {std::vector<uint8_t>(bytes), std::vector<uint8_t>(bytes)};
  Link* links[2] = {mine.get(), other.get()};
  MessageHeader header;
  header.kind = int64_t(MessageKind::exchange);
  header.bytes = int64_t(bytes);
  for (auto _ : state) {
    std::vector<LinkTrade> trades(2);
    for (int r = 0; r < 2; ++r) {
      auto& t = trades[size_t(r)];
      t.link = links[r];
      t.header = t.expected = header;
      t.payload = {{out[r].data(), bytes}};
      t.place = [&, r](const MessageHeader&) { return std::vector<Link::Slot>{{in[r].data(), bytes}}; };
    }
    trade_messages(trades, Clock::now() + kTimeout);
    if (trades[0].incoming.delivery != Delivery::received || trades[1].incoming.delivery != Delivery::received)
      state.SkipWithError("a message did not come");
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes) * 2);
}

// The same over Gloo: each member seals its payload, posts its receive, sends, waits, opens.
void BM_TradeOverGloo(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  EtcdServer server("127.0.0.1", 0, "bench");
  const Seal seal(kToken);
  GlooGroup groups[2];
  {
    WorkerEnv envs[2];
    for (int r = 0; r < 2; ++r) envs[r].rank = r, envs[r].world = 2, envs[r].token = kToken;
    std::thread peer([&] {
      groups[1] = join_gloo_group(c10::make_intrusive<EtcdStore>(server.endpoint(), "root", "bench", kTimeout), envs[1],
                                  "trade", 1, 2, "127.0.0.1", kTimeout, nullptr);
    });
    groups[0] = join_gloo_group(c10::make_intrusive<EtcdStore>(server.endpoint(), "root", "bench", kTimeout), envs[0],
                                "trade", 0, 2, "127.0.0.1", kTimeout, nullptr);
    peer.join();
  }
  torch::Tensor plain[2] = {torch::full({bytes}, 1, torch::kUInt8), torch::full({bytes}, 2, torch::kUInt8)};
  const auto context = seal_context({1, 2, 3});
  int tag = 0;
  for (auto _ : state) {
    auto member = [&](int r) {
      auto sealed = torch::empty({bytes + int64_t(Seal::kOverhead)}, torch::kUInt8);
      seal.seal(plain[r].data_ptr<uint8_t>(), size_t(bytes), context, sealed.data_ptr<uint8_t>());
      std::vector<torch::Tensor> incoming{torch::empty_like(sealed)}, outgoing{sealed};
      auto receive = groups[r]->recv(incoming, 1 - r, tag);
      auto send = groups[r]->send(outgoing, 1 - r, tag);
      receive->wait(kTimeout);
      send->wait(kTimeout);
      auto opened = torch::empty({bytes}, torch::kUInt8);
      if (!seal.open(incoming[0].data_ptr<uint8_t>(), size_t(bytes), context, opened.data_ptr<uint8_t>()))
        throw std::runtime_error("did not open");
    };
    std::thread peer(member, 1);
    member(0);
    peer.join();
    ++tag;
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes * 2);
}

}  // namespace

// Wall time: the work runs on threads besides the benchmark's own.
BENCHMARK(BM_OpenLink)->Unit(benchmark::kMillisecond)->Iterations(40)->UseRealTime();
BENCHMARK(BM_FormCheckedGlooGroup)->Unit(benchmark::kMillisecond)->Iterations(40)->UseRealTime();
BENCHMARK(BM_TradeOverLink)->Arg(1 << 20)->Arg(16 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TradeOverGloo)->Arg(1 << 20)->Arg(16 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();
