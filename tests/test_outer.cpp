#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <set>

#include "optim/grouping.h"
#include "optim/outer.h"
#include "optim/slow_weights.h"
#include "train/evaluation.h"
#include "config/train_config.h"
#include "wire/codec.h"

using namespace noloco;

namespace {

// Replica 0 of two; the peer's contribution is given by the test.
class FakeTransport final : public Transport {
 public:
  int rank() const override { return 0; }
  int world() const override { return 2; }
  void all_reduce_mean(torch::Tensor& t) override {
    ++all_reduces;
    sent = t.clone();
    t.add_(next_peer()).div_(2);
  }
  // This replica's bytes, then the peer's (`peer_bytes`).
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) override {
    sent = bytes.clone();
    return {bytes.clone(), peer_bytes};
  }
  std::vector<torch::Tensor> all_to_all(const torch::Tensor&) override { throw std::logic_error("not used"); }
  void broadcast(torch::Tensor&, int) override { throw std::logic_error("not used"); }
  ExchangeResult exchange(const ExchangeRequest& request) override {
    const auto dtype = wire_dtype;  // fp32 and bf16 payloads are the values' own bytes
    sent = request.payload.view(dtype).clone();
    for (const auto& p : request.group) last_group.push_back(p.rank);
    ExchangeResult r;
    r.received[1] = next_peer().to(dtype).contiguous().view(torch::kUInt8);
    if (peer_trailer.defined()) r.received[1] = torch::cat({r.received[1], peer_trailer});
    return r;
  }
  void send_state(const std::string&, int, const MessageHeader&, const torch::Tensor&) override {}
  torch::Tensor receive_state(const std::string&, int, const MessageHeader&, int64_t) override { return {}; }
  std::unique_ptr<Collectives> subgroup(const std::string&, const std::vector<Peer>&) override { return nullptr; }
  // The peer's contribution: the next of `peers` while any are left, else `peer`.
  // Exchanges may run on the overlap thread; the test only sets these up front.
  torch::Tensor next_peer() {
    ++exchanges;
    if (peers.empty()) return peer;
    auto p = peers.front();
    peers.pop_front();
    return p;
  }
  torch::Tensor peer, sent, peer_bytes;
  torch::Tensor peer_trailer;  // bytes after the peer's values (pace=speed: its PaceReport)
  std::deque<torch::Tensor> peers;
  int exchanges = 0, all_reduces = 0;
  c10::ScalarType wire_dtype = torch::kFloat32;
  std::vector<int> last_group;
};

struct ThreeScalars : torch::nn::Module {
  ThreeScalars() { w = register_parameter("w", torch::zeros({3})); }
  torch::Tensor w;
};

// One replica's parameters, fake peer and outer optimizer. `config` must outlive it.
struct Rig {
  explicit Rig(const TrainConfig& config)
      : outer(make_outer_optimizer(config.outer, config.run.seed, {&comm, nullptr}, flat)) {}
  ThreeScalars m;
  FlatParams flat{m};
  FakeTransport comm;
  std::unique_ptr<OuterOptimizer> outer;
};

TrainConfig outer_config(const std::string& method, double alpha, double beta, double gamma) {
  auto c = parse_config("", {"method=" + method, "replicas=2", "outer_interval=4"});
  c.outer.momentum = alpha;
  c.outer.lr = beta;
  c.outer.gamma = gamma;
  c.outer.message = gamma == beta ? NolocoMessage::theta : NolocoMessage::delta_phi;
  return c;
}

void expect_values(const torch::Tensor& t, std::vector<double> expected) {
  ASSERT_EQ(t.numel(), int64_t(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(t[long(i)].item<double>(), expected[i], 1e-6) << i;
}

// The by-hand overlap tests' start: φ = [1, 2, -1], m = 0, nothing in flight,
// θ = [1.5, 1, 0] (Δ0 = [0.5, -1, 1]); the peer sends [0.1, 0.3, -0.2] in the
// first exchange and [0.1, 0.1, 0.1] in the second.
void load_overlap_example(Rig& rig) {
  rig.outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})},
                   {"outer.momentum", torch::zeros({3})},
                   {"outer.start", torch::tensor({1.0f, 2.0f, -1.0f})}});
  rig.comm.peers = {torch::tensor({0.1f, 0.3f, -0.2f}), torch::tensor({0.1f, 0.1f, 0.1f})};
  rig.flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));
}

// Top-1 of three values in fp32, so the numbers of a by-hand test stay exact.
struct TopOneOfThree {
  WireCodec codec{[] {
    CodecSpec spec;
    spec.topk = 0.3;
    return spec;
  }()};
  torch::Tensor code(std::vector<float> x) const {
    auto bytes = torch::empty({int64_t(codec.encoded_bytes(x.size()))}, torch::kUInt8);
    codec.encode(x.data(), x.size(), bytes.data_ptr<uint8_t>(), 0);
    return bytes;
  }
  torch::Tensor values_of(const torch::Tensor& bytes) const {
    auto out = torch::empty({3});
    codec.decode(bytes.data_ptr<uint8_t>(), size_t(bytes.numel()), 3, out.data_ptr<float>());
    return out;
  }
};

torch::Tensor report_bytes(const PaceReport& r) {
  const auto b = r.to_bytes();
  return torch::tensor(std::vector<int64_t>(b.begin(), b.end())).to(torch::kUInt8);
}

// A partner's report, as bytes: `steps` in its period at `seconds` a step,
// the fastest it heard of replica 0 at 0.1 s.
torch::Tensor partner_report(int64_t steps, double seconds) {
  PaceReport partner;
  partner.steps = steps;
  partner.step_seconds = seconds;
  partner.reference_rank = 0;
  partner.reference_seconds = 0.1;
  return report_bytes(partner);
}

// A replica whose steps take `seconds` trains every slot of a period of `interval`.
void train_period(Pace& pace, int64_t first_step, int64_t interval, double seconds) {
  for (int64_t s = first_step; s < first_step + interval; ++s)
    if (pace.trains_at(s)) pace.step_took(seconds);
}

}  // namespace

TEST(Outer, NoLoCoStepByHandWithDistinctAlphaBetaGamma) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.4);
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::tensor({0.1f, -0.2f, 0.3f})}});
  flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));  // θ after the inner steps: Δ0 = [0.5, -1, 1]
  // Peer: Δ1 = [0.2, 0.6, -0.5], φ1 = [0, 4, 1]; γ ≠ β, so Δ and φ both travel.
  comm.peer = torch::tensor({0.2f, 0.6f, -0.5f, 0.0f, 4.0f, 1.0f});
  EXPECT_FALSE(outer->after_inner_step(2, flat).has_value());  // not yet at H
  auto sync = outer->after_inner_step(3, flat);
  ASSERT_TRUE(sync.has_value());
  expect_values(comm.sent, {0.5, -1.0, 1.0, 1.0, 2.0, -1.0});
  // m = 0.5·[0.1,-0.2,0.3] + 0.7·[0.35,-0.2,0.25] + 0.4·([0.5,3,0] − [1,2,-1]) = [0.095, 0.16, 0.725]
  TensorMap state;
  outer->save(state);
  expect_values(state["outer.momentum"], {0.095, 0.16, 0.725});
  expect_values(state["outer.phi"], {1.095, 2.16, -0.275});
  expect_values(flat.values(), {1.095, 2.16, -0.275});  // θ ← φ
}

// Issue 67 item 5's bound: once a partner's increment has been taken, one up
// to 10 times the largest this replica met over its last outer steps (its own
// and its partners') is averaged in; beyond, the message is refused whole
// (counted as dropped, its sender named) and this replica steps alone. The
// first one met is taken whatever its size: replicas may start apart.
TEST(Outer, NoLoCoRefusesAPartnersIncrementBeyondTenTimesThoseItMet) {
  const auto own_delta = torch::tensor({0.5f, -1.0f, 1.0f});
  for (const double scale : {9.9, 10.5}) {
    SCOPED_TRACE(scale);
    auto c = outer_config("noloco", 0.5, 0.7, 0.4);
    Rig rig(c);
    const auto phi = torch::tensor({1.0f, 2.0f, -1.0f});
    rig.outer->load({{"outer.phi", phi}, {"outer.momentum", torch::zeros({3})}});
    rig.flat.values().copy_(phi + own_delta);
    rig.comm.peers = {torch::cat({own_delta * 50, phi})};  // the first met: taken
    auto first = rig.outer->after_inner_step(3, rig.flat);
    ASSERT_TRUE(first.has_value());
    EXPECT_NEAR(first->largest_increment_ratio, 50, 1e-4);
    EXPECT_EQ(first->arrived, (std::vector<int>{0, 1}));

    TensorMap state;
    rig.outer->save(state);
    const auto phi_now = state.at("outer.phi");
    rig.flat.values().copy_(phi_now + own_delta);
    const double met = 50 * own_delta.norm().item<double>();  // the largest in the window: the partner's
    rig.comm.peer = torch::cat({own_delta * (50 * scale), phi_now});
    auto sync = rig.outer->after_inner_step(7, rig.flat);
    ASSERT_TRUE(sync.has_value());
    EXPECT_NEAR(sync->largest_increment_ratio * met, 50 * scale * own_delta.norm().item<double>(), 1e-3);
    const bool refused = scale > 10;
    EXPECT_EQ(sync->refused, refused ? std::vector<int>{1} : std::vector<int>{});
    EXPECT_EQ(sync->arrived, refused ? std::vector<int>{0} : (std::vector<int>{0, 1}));
    EXPECT_EQ(sync->values_dropped, refused ? sync->values_received : 0);
  }
}

TEST(Outer, NoLoCoWithGammaEqualBetaSendsOnlyTheta) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.7);
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::tensor({0.1f, -0.2f, 0.3f})}});
  flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));
  comm.peer = torch::tensor({0.2f, 4.6f, 0.5f});  // θ1 = φ1 + Δ1
  ASSERT_TRUE(outer->after_inner_step(3, flat).has_value());
  expect_values(comm.sent, {1.5, 1.0, 0.0});  // one model's worth, not two
  // m = 0.5·m0 + 0.7·(mean θ − φ0) = [0.05,-0.1,0.15] + 0.7·[-0.15, 0.8, 1.25]
  expect_values(flat.values(), {1.0 - 0.055, 2.0 + 0.46, -1.0 + 1.025});
}

TEST(Outer, NoLoCoBf16WireHalvesThePayload) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.7);
  c.outer.wire_dtype = CodecSpec::Type::bf16;
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  comm.wire_dtype = torch::kBFloat16;
  comm.peer = torch::zeros({3});
  outer->after_inner_step(3, flat);
  EXPECT_EQ(comm.sent.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(comm.sent.nbytes(), 3u * 2u);
}

TEST(Outer, DiLoCoStepByHand) {
  auto c = outer_config("diloco", 0.3, 0.7, 0.7);
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::zeros({3})}});
  flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));  // Δ0 = [0.5, -1, 1]
  comm.peer = torch::tensor({0.1f, 0.3f, -0.2f});         // Δ1
  ASSERT_TRUE(outer->after_inner_step(3, flat).has_value());
  expect_values(comm.sent, {0.5, -1.0, 1.0});
  // m = 0.7·mean Δ = 0.7·[0.3, -0.35, 0.4]
  expect_values(flat.values(), {1.21, 1.755, -0.72});
}

// residual=weights (docs/method.md, compression=topk), by hand, DiLoCo's
// all-gather and NoLoCo's pair alike: top-1 of three values in fp32, so the
// numbers stay exact. Each replica's message carries its largest value; the
// mean of the messages, a value the peer did not send counting as this
// replica's own, drives the outer step; what this replica's message left
// out, where no peer's carried it, stays in its weights.
TEST(Outer, TopKMessagesCountAValueThePeerDidNotSendAsTheReplicasOwnByHand) {
  for (const std::string method : {"diloco", "noloco"}) {
    SCOPED_TRACE(method);
    auto c = outer_config(method, method == "diloco" ? 0.3 : 0.5, 0.7, method == "diloco" ? 0.7 : 0.4);
    c.outer.topk = 0.3;  // one value of the three
    c.outer.residual = ResidualHome::weights;
    c.outer.diloco_mean = DilocoMean::all_gather;
    c.outer.phi_every = 0;  // NoLoCo: no φ, so only the Δ mean moves it
    Rig rig(c);
    auto& [m, flat, comm, outer] = rig;
    const TopOneOfThree codec;
    outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::zeros({3})}});
    flat.values().copy_(torch::tensor({1.5f, 1.2f, 0.0f}));  // Δ0 = [0.5, -0.8, 1]
    const auto peer = codec.code({0.1f, 0.3f, -0.2f});       // Δ1: its message carries 0.3
    comm.peer_bytes = peer;                                  // DiLoCo gathers it
    comm.peer = peer;                                        // NoLoCo's partner sends it
    comm.wire_dtype = torch::kUInt8;
    ASSERT_TRUE(outer->after_inner_step(3, flat).has_value());
    expect_values(codec.values_of(comm.sent), {0.0, 0.0, 1.0});
    // Value 0, sent by neither: 0 as sent, 0.5 kept. Value 1, carried by the
    // peer: the mean (-0.8 + 0.3)/2, nothing kept. Value 2, sent by this
    // replica only: the peer's counts as this one's, 1. (As zeros they made
    // [0, 0.15, 0.5], keeping [0.5, -0.8, 0]: each replica's own progress halved.)
    // m = 0.7·[0, -0.25, 1]; φ = [1, 1.825, -0.3]; θ = φ + [0.5, 0, 0].
    expect_values(flat.values(), {1.5, 1.825, -0.3});
    TensorMap state;
    outer->save(state);
    expect_values(state.at("outer.phi"), {1.0, 1.825, -0.3});
    expect_values(state.at("outer.momentum"), {0.0, -0.175, 0.7});
  }
}

TEST(Outer, DdpAveragesTheFlatGradientInOneCollective) {
  struct TwoTensors : torch::nn::Module {
    TwoTensors() {
      w = register_parameter("w", torch::zeros({2}));
      b = register_parameter("b", torch::zeros({1}));
    }
    torch::Tensor w, b;
  } m;
  const auto c = parse_config("", {"method=ddp", "replicas=2"});
  FlatParams flat{m};
  FakeTransport comm;
  const auto outer = make_outer_optimizer(c.outer, c.run.seed, {&comm, nullptr}, flat);
  flat.grads().copy_(torch::tensor({1.0f, 2.0f, 3.0f}));
  comm.peer = torch::tensor({3.0f, 2.0f, 1.0f});
  EXPECT_TRUE(outer->on_gradients(flat));
  EXPECT_EQ(comm.all_reduces, 1) << "both tensors' gradients travel in one collective";
  EXPECT_EQ(comm.sent.numel(), 3);
  // The parameters' own .grad are views of the flat buffer.
  expect_values(m.w.grad(), {2.0, 2.0});
  expect_values(m.b.grad(), {2.0});
}

TEST(Schedule, FragmentsSpreadOverThePeriodAndTheLastEndsIt) {
  // H = 4, F = 2: fragment 0 after 2, 6, 10 steps, fragment 1 after 4, 8.
  std::vector<std::pair<int, int64_t>> got;
  for (int64_t step = 0; step < 10; ++step)
    if (const auto due = fragment_due(step, 4, 2)) got.push_back(*due);
  const std::vector<std::pair<int, int64_t>> want{{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2}};
  EXPECT_EQ(got, want);
  // F = 1 is the classic schedule: after H, 2H, ...
  for (int64_t step = 0; step < 12; ++step) EXPECT_EQ(fragment_due(step, 4, 1).has_value(), (step + 1) % 4 == 0) << step;
  // H = 4, F = 3: every fragment once per period, at steps ⌊(f+1)·H/F⌋ = 1, 2, 4.
  std::vector<int> order;
  for (int64_t step = 0; step < 8; ++step)
    if (const auto due = fragment_due(step, 4, 3)) order.push_back(due->first);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 0, 1, 2}));
  const auto parts = split_fragments(10, 3);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].numel + parts[1].numel + parts[2].numel, 10);
  EXPECT_EQ(parts[1].offset, parts[0].numel);
  EXPECT_THROW(split_fragments(2, 3), std::invalid_argument);
}

TEST(Outer, DiLoCoFragmentsSyncTheirOwnSliceByHand) {
  auto c = outer_config("diloco", 0.0, 1.0, 1.0);
  c.outer.fragments = 2;  // values [0, 1] after 2 steps of each period, value [2] after 4
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  flat.values().copy_(torch::tensor({1.0f, 2.0f, 3.0f}));  // φ = 0, so Δ = θ
  comm.peers = {torch::tensor({3.0f, 0.0f}), torch::tensor({5.0f})};
  EXPECT_FALSE(outer->after_inner_step(0, flat).has_value());
  auto first = outer->after_inner_step(1, flat);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->fragment, 0);
  expect_values(comm.sent, {1.0, 2.0});
  expect_values(flat.values(), {2.0, 1.0, 3.0});  // β = 1, α = 0: θ ← mean
  flat.values()[2] = 4.0f;
  EXPECT_FALSE(outer->after_inner_step(2, flat).has_value());
  auto second = outer->after_inner_step(3, flat);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->fragment, 1);
  expect_values(comm.sent, {4.0});
  expect_values(flat.values(), {2.0, 1.0, 4.5});
}

TEST(Outer, OverlappedDiLoCoAppliesOnePeriodLateKeepingLocalProgressByHand) {
  auto c = outer_config("diloco", 0.3, 0.7, 0.7);
  c.outer.overlap = true;
  Rig rig(c);
  load_overlap_example(rig);
  auto& [m, flat, comm, outer] = rig;
  // Period 1 ends: its exchange starts, nothing is applied, θ trains on.
  EXPECT_FALSE(outer->after_inner_step(3, flat).has_value());
  expect_values(flat.values(), {1.5, 1.0, 0.0});
  flat.values().copy_(torch::tensor({2.0f, 1.0f, 0.5f}));  // progress in period 2: [0.5, 0, 0.5]
  // Period 2 ends: period 1's mean Δ [0.3, -0.35, 0.4] is applied:
  //   m = 0.7·[0.3, -0.35, 0.4] = [0.21, -0.245, 0.28], φ = [1.21, 1.755, -0.72], θ = φ + progress.
  auto applied = outer->after_inner_step(7, flat);
  ASSERT_TRUE(applied.has_value());
  EXPECT_EQ(applied->outer_step, 0);
  expect_values(flat.values(), {1.71, 1.755, -0.22});
  // finish() applies period 2's exchange, whose Δ is the progress [0.5, 0, 0.5]:
  //   mean Δ = [0.3, 0.05, 0.3], m = 0.3·m + 0.7·mean Δ = [0.273, -0.0385, 0.294], θ = φ = φ + m.
  const auto rest = outer->finish(flat);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].outer_step, 1);
  expect_values(comm.sent, {0.5, 0.0, 0.5});
  expect_values(flat.values(), {1.483, 1.7165, -0.426});
  EXPECT_TRUE(outer->finish(flat).empty());
}

// A checkpoint written before the pending state was typed (float64 flags
// {pending, has φ, outer step}) loads as one written now: the same pending
// result, applied at the next boundary, saved back without flags.
TEST(Outer, APendingResultSavedWithLegacyFlagsLoadsAndSavesTyped) {
  auto c = outer_config("diloco", 0.5, 0.7, 0.7);
  c.outer.overlap = true;
  Rig rig(c);
  rig.outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})},
                   {"outer.momentum", torch::zeros({3})},
                   {"outer.start", torch::tensor({1.0f, 2.0f, -1.0f})},
                   {"outer.pending_delta", torch::tensor({0.2f, 0.0f, -0.2f})},
                   {"outer.pending_phi", torch::zeros({3})},
                   {"outer.pending_flags", torch::tensor({1.0, 0.0, 5.0}, torch::kFloat64)}});
  TensorMap saved;
  rig.outer->save(saved);
  EXPECT_EQ(saved.count("outer.pending_flags"), 0u);
  EXPECT_EQ(saved.count("outer.pending_phi"), 0u);  // the flags said: no φ mean (the zeros are no pull toward 0)
  EXPECT_EQ(saved.at("outer.pending_outer_step").item<int64_t>(), 5);
  expect_values(saved.at("outer.pending_delta"), {0.2, 0.0, -0.2});
  // At the next boundary it is applied: m = 0.7·[0.2, 0, -0.2], φ = [1.14, 2, -1.14].
  rig.flat.values().copy_(torch::tensor({1.0f, 2.0f, -1.0f}));
  rig.comm.peer = torch::zeros({3});
  const auto applied = rig.outer->after_inner_step(3, rig.flat);
  ASSERT_TRUE(applied.has_value());
  EXPECT_EQ(applied->outer_step, 5);
  TensorMap after;
  rig.outer->save(after);
  expect_values(after.at("outer.phi"), {1.14, 2.0, -1.14});
}

TEST(Outer, EagerOverlapStepsWithTheOwnDeltaAndTheLateMeanReplacesItByHand) {
  auto c = outer_config("diloco", 0.3, 0.7, 0.7);
  c.outer.overlap = true;
  c.outer.eager = true;
  Rig rig(c);
  load_overlap_example(rig);
  auto& [m, flat, comm, outer] = rig;
  // Period 1 ends: its exchange starts with Δ0, and θ takes the replica's own
  // outer step at once: φ + 0.3·0 + 0.7·Δ0.
  EXPECT_FALSE(outer->after_inner_step(3, flat).has_value());
  expect_values(flat.values(), {1.35, 1.3, -0.3});
  flat.values().add_(torch::tensor({0.5f, 0.0f, 0.5f}));  // progress in period 2
  // Period 2 ends: the mean Δ [0.3, -0.35, 0.4] gives m = [0.21, -0.245, 0.28],
  // φ = [1.21, 1.755, -0.72], θ = φ + progress = [1.71, 1.755, -0.22] (as without
  // eager), whose Δ [0.5, 0, 0.5] is sent; then the eager step
  // θ = φ + 0.3·m + 0.7·Δ = [1.623, 1.6815, -0.286].
  auto applied = outer->after_inner_step(7, flat);
  ASSERT_TRUE(applied.has_value());
  EXPECT_EQ(applied->outer_step, 0);
  expect_values(flat.values(), {1.623, 1.6815, -0.286});
  // finish(): mean Δ [0.3, 0.05, 0.3], m = [0.273, -0.0385, 0.294]; no progress
  // since the eager step, so θ = φ, the same end as without eager.
  ASSERT_EQ(outer->finish(flat).size(), 1u);
  expect_values(comm.sent, {0.5, 0.0, 0.5});  // period 2's Δ, measured from φ, not from the eager step
  expect_values(flat.values(), {1.483, 1.7165, -0.426});
}

TEST(Outer, OverlappedNoLoCoStateWithAnExchangeInFlightResumesBitIdentically) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.4);
  c.outer.overlap = true;
  c.outer.fragments = 2;
  const auto peer_small = [](float x) { return torch::tensor({x, 1.0f, 0.5f, -0.5f}); };
  Rig a(c);
  a.flat.values().copy_(torch::tensor({0.3f, -0.2f, 0.1f}));
  // Fragment 0 holds 2 values, fragment 1 one: NoLoCo sends Δ then φ of the fragment.
  a.comm.peers = {torch::tensor({0.1f, 0.2f, 0.0f, 0.1f}), torch::tensor({0.3f, 0.2f})};
  a.outer->after_inner_step(1, a.flat);  // fragment 0 in flight
  a.outer->after_inner_step(3, a.flat);  // fragment 1 in flight
  TensorMap saved;
  a.outer->save(saved);  // waits for both, keeps their results
  EXPECT_EQ(a.comm.exchanges, 2);
  Rig b(c);
  b.outer->load(saved);
  b.flat.values().copy_(a.flat.values());
  for (auto* rig : {&a, &b}) {
    rig->comm.peers = {peer_small(0.05f), torch::tensor({-0.1f, 0.7f})};
    rig->flat.values().add_(torch::tensor({0.01f, 0.02f, -0.03f}));
    rig->outer->after_inner_step(5, rig->flat);
    rig->outer->after_inner_step(7, rig->flat);
    rig->outer->finish(rig->flat);
  }
  EXPECT_EQ(b.comm.exchanges, 2) << "the resumed replica re-ran no exchange";
  EXPECT_TRUE(torch::equal(a.flat.values(), b.flat.values()));
  TensorMap sa, sb;
  a.outer->save(sa);
  b.outer->save(sb);
  for (const auto& [key, value] : sa) EXPECT_TRUE(torch::equal(value, sb.at(key))) << key;
}

TEST(Grouping, PartitionIdenticalEverywhereAndChangingEachStep) {
  std::vector<int> members(8);
  for (int i = 0; i < 8; ++i) members[size_t(i)] = i;
  std::set<std::vector<std::vector<int>>> distinct;
  for (int64_t step = 0; step < 20; ++step) {
    const auto groups = noloco_groups(99, step, members, 2);
    EXPECT_EQ(groups, noloco_groups(99, step, members, 2));  // a pure function of (seed, step)
    std::multiset<int> seen;
    for (auto& g : groups) {
      EXPECT_EQ(g.size(), 2u);
      seen.insert(g.begin(), g.end());
    }
    EXPECT_EQ(seen, std::multiset<int>(members.begin(), members.end()));
    distinct.insert(groups);
  }
  EXPECT_GT(distinct.size(), 15u);
  // An odd member count: the lone leftover joins a group instead of idling.
  const auto odd = noloco_groups(1, 0, {0, 1, 2, 3, 4}, 2);
  size_t total = 0;
  for (auto& g : odd) {
    EXPECT_GE(g.size(), 2u);
    total += g.size();
  }
  EXPECT_EQ(total, 5u);
}

// The evaluations' sample (eval.spread_replicas): every member computes the
// same one from the agreed snapshot, with the first live replica in it.
TEST(SpreadSample, AllMembersUpToKElseTheFirstAndADrawTheSameEverywhere) {
  std::vector<Peer> members;
  for (int r = 0; r < 64; ++r) members.push_back({r + 1, r % 3});  // rank 0 dead: the first live one is 1
  const std::vector<Peer> few(members.begin(), members.begin() + 8);
  EXPECT_EQ(spread_sample(7, 100, few, 8), few);
  EXPECT_EQ(spread_sample(7, 100, members, 0), members);
  std::set<int> drawn;
  std::set<std::vector<int>> distinct;
  for (int64_t step = 50; step <= 5000; step += 50) {
    const auto sample = spread_sample(7, step, members, 8);
    EXPECT_EQ(sample, spread_sample(7, step, members, 8));  // a pure function of (seed, step, members)
    ASSERT_EQ(sample.size(), 8u);
    EXPECT_EQ(sample.front(), members.front());
    std::vector<int> ranks;
    for (const auto& p : sample) {
      EXPECT_NE(std::find(members.begin(), members.end(), p), members.end()) << p.rank << " is no member";
      ranks.push_back(p.rank);
    }
    EXPECT_TRUE(std::is_sorted(ranks.begin(), ranks.end()));
    EXPECT_EQ(std::set<int>(ranks.begin(), ranks.end()).size(), 8u) << "a member drawn twice";
    drawn.insert(ranks.begin(), ranks.end());
    distinct.insert(ranks);
  }
  EXPECT_EQ(drawn.size(), 64u) << "100 draws of 7 of 63 leave a member out";
  EXPECT_EQ(distinct.size(), 100u);
  EXPECT_NE(spread_sample(7, 100, members, 8), spread_sample(8, 100, members, 8));  // another seed, another draw
}

// The separation a coset-coded φ grid widens by: how many draws back two
// replicas last shared a group (most recent draw first).
TEST(Grouping, DrawsSinceGroupedCountsBackToTheLastDrawThatPairedThem) {
  const std::vector<int> members{0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int64_t> draws{12, 7, 2};
  std::vector<int> partner;  // replica 0's partner in each draw
  for (const int64_t d : draws)
    for (const auto& g : noloco_groups(5, d, members, 2))
      if (g[0] == 0) partner.push_back(g[1]);
  ASSERT_EQ(partner.size(), draws.size());
  EXPECT_EQ(draws_since_grouped(5, draws, members, 2, 0, partner[0]), 0);
  EXPECT_EQ(draws_since_grouped(5, draws, members, 2, partner[0], 0), 0);  // the same seen from either side
  int never_met = 0;
  for (int b = 1; b < 8; ++b) {
    const auto first = std::find(partner.begin(), partner.end(), b);
    const int64_t expected = first == partner.end() ? int64_t(draws.size()) : int64_t(first - partner.begin());
    EXPECT_EQ(draws_since_grouped(5, draws, members, 2, 0, b), expected) << "replica " << b;
    never_met += first == partner.end();
  }
  EXPECT_GE(never_met, 4);  // 3 draws meet at most 3 of the 7
  EXPECT_EQ(draws_since_grouped(5, {}, members, 2, 0, partner[0]), 0);  // no history: no separation known
}

// pace=speed: a replica three times slower than the fastest it heard of
// trains a third of the next period's slots, spread evenly; the fastest's
// report travels on through its partners, and ages out when not heard again.
TEST(Pace, AReplicaThreeTimesSlowerTrainsAThirdOfThePeriodSpreadEvenly) {
  Pace slow(12, /*rank=*/1);
  train_period(slow, 0, 12, 0.3);
  EXPECT_EQ(slow.report(0).steps, 12);  // nothing heard yet: every slot
  PaceReport fast;
  fast.steps = 12;
  fast.step_seconds = 0.1;
  fast.reference_rank = 0;
  fast.reference_seconds = 0.1;
  slow.hear(0, fast, 0);
  EXPECT_DOUBLE_EQ(slow.reference_seconds(), 0.1);
  std::vector<int64_t> trained;
  for (int64_t s = 12; s < 24; ++s)
    if (slow.trains_at(s)) trained.push_back(s % 12);
  EXPECT_EQ(trained, (std::vector<int64_t>{2, 5, 8, 11}));
  EXPECT_EQ(slow.period_steps(), 4);
  EXPECT_EQ(slow.report(1).steps, 4);
  // It passes the fastest on to replica 2, which never met replica 0.
  const auto said = slow.report(1);
  EXPECT_EQ(said.reference_rank, 0);
  EXPECT_DOUBLE_EQ(said.reference_seconds, 0.1);
  Pace other(12, 2);
  train_period(other, 0, 12, 0.2);
  other.hear(1, said, 1);
  EXPECT_DOUBLE_EQ(other.reference_seconds(), 0.1);
  // Not heard of again for more than the horizon: replica 1's own pace is the reference.
  PaceReport quiet = fast;
  quiet.step_seconds = 0.3;
  quiet.reference_rank = 3;
  quiet.reference_seconds = 0.3;
  quiet.reference_heard_at = 1 + Pace::kReferenceHorizon + 1;
  slow.hear(3, quiet, 1 + Pace::kReferenceHorizon + 1);
  EXPECT_DOUBLE_EQ(slow.reference_seconds(), 0.3);
}

// Issue 105: left behind (partner_wait) at least 0.25 s late with steps of
// 0.1 s, a replica skips ceil(0.25 / 0.1) = 3 slots, then trains its share
// again; however late, it skips less than a period.
TEST(Pace, LeftBehindItSkipsTheSlotsOfItsLatenessToMeetInStepAgain) {
  Pace pace(10, /*rank=*/0);
  train_period(pace, 0, 10, 0.1);  // the fastest it knows: itself, every slot
  pace.fell_behind(0.25);
  std::vector<int64_t> trained;
  for (int64_t s = 10; s < 20; ++s)
    if (pace.trains_at(s)) trained.push_back(s % 10);
  EXPECT_EQ(trained, (std::vector<int64_t>{3, 4, 5, 6, 7, 8, 9}));
  pace.fell_behind(100);
  trained.clear();
  for (int64_t s = 20; s < 30; ++s)
    if (pace.trains_at(s)) trained.push_back(s % 10);
  EXPECT_EQ(trained, (std::vector<int64_t>{9}));
  EXPECT_EQ(pace.report(2).steps, 1);
}

// A resume replays the slots its run recorded after the checkpoint, whatever
// its step times say now, then measures again; a left-behind replica's
// catch-up survives the checkpoint.
TEST(Pace, AResumeReplaysTheRecordedSlotsThenMeasuresAgain) {
  Pace pace(10, /*rank=*/0);
  train_period(pace, 0, 10, 0.1);
  pace.replay(10, {false, true, true, false});
  std::vector<int64_t> trained;
  for (int64_t s = 10; s < 20; ++s)
    if (pace.trains_at(s)) trained.push_back(s % 10);
  EXPECT_EQ(trained, (std::vector<int64_t>{1, 2, 4, 5, 6, 7, 8, 9})) << "as recorded, then every slot (the fastest)";
  EXPECT_EQ(pace.report(1).steps, 8);

  pace.fell_behind(0.25);  // three slots to skip
  TensorMap state;
  pace.save(state);
  Pace resumed(10, 0);
  resumed.load(state);
  trained.clear();
  for (int64_t s = 20; s < 30; ++s)
    if (resumed.trains_at(s)) trained.push_back(s % 10);
  EXPECT_EQ(trained, (std::vector<int64_t>{3, 4, 5, 6, 7, 8, 9}));
}

TEST(Pace, ReportsTravelAsFortyBytesAndAStrangersAreRefused) {
  PaceReport r;
  r.steps = 17;
  r.step_seconds = 0.25;
  r.reference_rank = 5;
  r.reference_seconds = 0.125;
  r.reference_heard_at = 42;
  const auto b = r.to_bytes();
  ASSERT_EQ(int64_t(b.size()), PaceReport::kBytes);
  const auto back = PaceReport::from_bytes(b.data(), int64_t(b.size()));
  EXPECT_EQ(back.steps, 17);
  EXPECT_EQ(back.step_seconds, 0.25);
  EXPECT_EQ(back.reference_rank, 5);
  EXPECT_EQ(back.reference_seconds, 0.125);
  EXPECT_EQ(back.reference_heard_at, 42);
  EXPECT_THROW(PaceReport::from_bytes(b.data(), 39), std::runtime_error);
  auto bad = r;
  bad.steps = 0;
  const auto z = bad.to_bytes();
  EXPECT_THROW(PaceReport::from_bytes(z.data(), int64_t(z.size())), std::runtime_error);
  bad = r;
  bad.step_seconds = std::nan("");
  const auto n = bad.to_bytes();
  EXPECT_THROW(PaceReport::from_bytes(n.data(), int64_t(n.size())), std::runtime_error);
}

// A resume in the middle of a period trains in the same slots as the run that went on.
TEST(Pace, SavedAndLoadedMidPeriodItTrainsInTheSameSlots) {
  Pace a(10, 1);
  train_period(a, 0, 10, 0.2);
  PaceReport fast;
  fast.steps = 10;
  fast.step_seconds = 0.1;
  a.hear(0, fast, 0);
  for (int64_t s = 10; s < 14; ++s)
    if (a.trains_at(s)) a.step_took(0.2);
  TensorMap state;
  a.save(state);
  Pace b(10, 1);
  b.load(state);
  for (int64_t s = 14; s < 30; ++s) {
    const bool ta = a.trains_at(s), tb = b.trains_at(s);
    EXPECT_EQ(ta, tb) << s;
    if (ta) a.step_took(0.2);
    if (tb) b.step_took(0.2);
  }
  EXPECT_EQ(a.trained_steps(), b.trained_steps());
  EXPECT_EQ(a.period_steps(), 5);
}

// pace=speed, by hand: NoLoCo's pair mean of increments weighs each by the
// steps behind it (this replica 4 of 4, the partner 1); φ's pull stays the
// plain mean. Its message ends in its own PaceReport.
TEST(Outer, PacedNoLoCoWeighsEachIncrementByItsStepsByHand) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.4);
  c.outer.pace = PaceMode::speed;
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  ASSERT_NE(outer->pace(), nullptr);
  outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::tensor({0.1f, -0.2f, 0.3f})}});
  train_period(*outer->pace(), 0, 4, 0.1);
  flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));  // Δ0 = [0.5, -1, 1]
  comm.peer = torch::tensor({0.2f, 0.6f, -0.5f, 0.0f, 4.0f, 1.0f});  // Δ1, φ1
  comm.peer_trailer = partner_report(1, 0.4);
  const auto sync = outer->after_inner_step(3, flat);
  ASSERT_TRUE(sync.has_value());
  EXPECT_EQ(sync->arrived, (std::vector<int>{0, 1}));
  ASSERT_EQ(comm.sent.numel(), 6 + PaceReport::kBytes / 4);
  const auto own = PaceReport::from_bytes(comm.sent.view(torch::kUInt8).data_ptr<uint8_t>() + 24, PaceReport::kBytes);
  EXPECT_EQ(own.steps, 4);
  // mean_w Δ = (4·Δ0 + 1·Δ1)/5 = [0.44, -0.68, 0.7]
  // m = 0.5·[0.1,-0.2,0.3] + 0.7·[0.44,-0.68,0.7] + 0.4·([0.5,3,0] − [1,2,-1]) = [0.158, -0.176, 1.04]
  expect_values(flat.values(), {1.158, 1.824, 0.04});
  // What the partner said is heard: it is four times slower than this replica.
  EXPECT_DOUBLE_EQ(outer->pace()->reference_seconds(), 0.1);
}

TEST(Outer, PacedNoLoCoStepsAloneOnAPartnersMessageTooShortForItsPace) {
  auto c = outer_config("noloco", 0.5, 0.7, 0.4);
  c.outer.pace = PaceMode::speed;
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  train_period(*outer->pace(), 0, 4, 0.1);
  comm.peer = torch::tensor({0.2f});  // 4 bytes, no report
  const auto sync = outer->after_inner_step(3, flat);
  ASSERT_TRUE(sync.has_value());
  EXPECT_EQ(sync->arrived, (std::vector<int>{0}));
}

// pace=speed, by hand: DiLoCo's replicas gather their PaceReports first; each
// scales its Δ by N·w/Σw (this one, 4 steps: 2·4/6; the partner, 2 steps:
// 2·2/6), so the plain mean is the steps-weighted one.
TEST(Outer, PacedDiLoCoScalesItsDeltaSoTheMeanIsWeighedByStepsByHand) {
  auto c = outer_config("diloco", 0.3, 0.7, 0.7);
  c.outer.pace = PaceMode::speed;
  Rig rig(c);
  auto& [m, flat, comm, outer] = rig;
  outer->load({{"outer.phi", torch::tensor({1.0f, 2.0f, -1.0f})}, {"outer.momentum", torch::zeros({3})}});
  train_period(*outer->pace(), 0, 4, 0.1);
  comm.peer_bytes = partner_report(2, 0.2);
  flat.values().copy_(torch::tensor({1.5f, 1.0f, 0.0f}));          // Δ0 = [0.5, -1, 1]
  comm.peer = torch::tensor({0.1f, 0.3f, -0.2f}) * (2.0f / 3.0f);  // Δ1 as the partner sends it
  const auto sync = outer->after_inner_step(3, flat);
  ASSERT_TRUE(sync.has_value());
  ASSERT_EQ(sync->partners_pace.count(1), 1u);
  EXPECT_EQ(sync->partners_pace.at(1).steps, 2);
  expect_values(comm.sent, {0.5 * 4 / 3, -1.0 * 4 / 3, 1.0 * 4 / 3});
  // mean Δ = (4·Δ0 + 2·Δ1)/6 = [0.366667, -0.566667, 0.6]; m = 0.7·mean Δ
  expect_values(flat.values(), {1.0 + 0.7 * 2.2 / 6, 2.0 - 0.7 * 3.4 / 6, -1.0 + 0.7 * 3.6 / 6});
}

TEST(Pace, ItsStateIsNamedSoAHandOverCanLeaveItOut) {
  Pace p(10, 0);
  train_period(p, 0, 10, 0.1);
  TensorMap state;
  p.save(state);
  ASSERT_FALSE(state.empty());
  for (const auto& [name, t] : state) EXPECT_TRUE(is_pace_state(name)) << name;
  EXPECT_FALSE(is_pace_state("outer.phi"));
}
