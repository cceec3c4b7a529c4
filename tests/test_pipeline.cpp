// Pipeline parallelism: routing permutations, stage slicing, the activation
// transport's checks, and pipelined runs against unpipelined references.
#include <gtest/gtest.h>

#include <future>
#include <optional>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/store/run_keys.h"
#include "comm/transport/peer_link.h"
#include "comm/transport/seal.h"
#include "model/llama.h"
#include "model/hf_directory.h"
#include "model/subspace.h"
#include "optim/flat_params.h"
#include "optim/subspace_constraint.h"
#include "pipeline/routing.h"
#include "pipeline/stage.h"
#include "subspace_measures.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/report.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;
using noloco::testing::small_train_args;
using noloco::testing::frozen_part;
using noloco::testing::outside_span;

TEST(Routing, EveryBoundaryIsABijectionWithAMatchingInverse) {
  int not_identity = 0;
  for (uint64_t seed : {1ull, 1337ull})
    for (int replicas : {1, 2, 3, 4, 7, 16})
      for (int64_t step = 0; step < 20; ++step)
        for (int64_t micro = 0; micro < 3; ++micro)
          for (int boundary = 0; boundary < 3; ++boundary) {
            const auto perm = route_permutation(seed, step, micro, boundary, replicas, true);
            auto sorted = perm;
            std::sort(sorted.begin(), sorted.end());
            std::vector<int> all(static_cast<size_t>(replicas));
            std::iota(all.begin(), all.end(), 0);
            ASSERT_EQ(sorted, all) << "each receiver gets exactly one micro-batch per slot";
            const auto inverse = invert_permutation(perm);
            for (int d = 0; d < replicas; ++d) ASSERT_EQ(inverse[size_t(perm[size_t(d)])], d);
            // A pure function of its arguments: every worker computes the same.
            ASSERT_EQ(route_permutation(seed, step, micro, boundary, replicas, true), perm);
            if (perm != all) ++not_identity;
          }
  EXPECT_GT(not_identity, 1000) << "random routing must actually mix replicas";
}

TEST(Routing, PermutationsDifferAcrossStepsMicroBatchesAndBoundaries) {
  const auto base = route_permutation(7, 3, 0, 0, 8, true);
  EXPECT_NE(route_permutation(7, 4, 0, 0, 8, true), base);
  EXPECT_NE(route_permutation(7, 3, 1, 0, 8, true), base);
  EXPECT_NE(route_permutation(7, 3, 0, 1, 8, true), base);
  EXPECT_NE(route_permutation(8, 3, 0, 0, 8, true), base);
}

TEST(Routing, FixedRoutingIsTheIdentity) {
  for (int64_t step = 0; step < 5; ++step)
    EXPECT_EQ(route_permutation(1, step, 0, 0, 4, false), (std::vector<int>{0, 1, 2, 3}));
}

TEST(Routing, LiveRoutesAreThePermutationsWhileEveryWorkerIsLive) {
  const int replicas = 5, stages = 4;
  const LiveReplicas all(stages, {0, 1, 2, 3, 4});
  for (int64_t micro = 0; micro < 4; ++micro) {
    const auto routes = live_routes(99, 11, micro, replicas, all, true);
    ASSERT_EQ(routes.size(), size_t(replicas));
    for (int start = 0; start < replicas; ++start) {
      EXPECT_EQ(routes[size_t(start)].origin, start);
      int at = start;
      for (int stage = 0; stage < stages; ++stage) {
        if (stage > 0) at = route_permutation(99, 11, micro, stage - 1, replicas, true)[size_t(at)];
        EXPECT_EQ(routes[size_t(start)].replica[size_t(stage)], at);
      }
    }
  }
}

TEST(Routing, LiveRoutesGoAroundLostWorkersAndSpreadTheirShare) {
  // Replica 2 of stage 1 and replica 0 of stage 2 are lost; stage 0 has all four.
  const int replicas = 4;
  const LiveReplicas live{{0, 1, 2, 3}, {0, 1, 3}, {1, 2, 3}};
  std::map<int, int> stand_ins;  // stage-1 replica -> micro-batches it took for position 2
  for (int64_t step = 0; step < 30; ++step)
    for (int64_t micro = 0; micro < 4; ++micro) {
      const auto routes = live_routes(5, step, micro, replicas, live, true);
      ASSERT_EQ(routes.size(), 4u) << "one route per live first-stage replica";
      ASSERT_EQ(live_routes(5, step, micro, replicas, live, true)[1].replica, routes[1].replica) << "pure function";
      std::map<int, int> load;
      for (const auto& r : routes) {
        EXPECT_EQ(r.replica[0], r.origin);
        EXPECT_NE(r.replica[1], 2) << "never routed to a lost worker";
        EXPECT_NE(r.replica[2], 0);
        load[r.replica[1]] += 1;
      }
      int total = 0;
      for (auto [replica, n] : load) total += n;
      EXPECT_EQ(total, 4);
      // The position replica 2 would have served at stage 1:
      const auto perm = route_permutation(5, step, micro, 0, replicas, true);
      const int origin = invert_permutation(perm)[2];
      stand_ins[routes[size_t(origin)].replica[1]] += 1;
    }
  EXPECT_EQ(stand_ins.size(), 3u) << "the lost worker's share spreads over every live worker of its stage";
  for (auto [replica, n] : stand_ins) EXPECT_GT(n, 20) << "replica " << replica;
  // A lost first-stage replica: its data is not trained on, nobody waits for it.
  const auto routes = live_routes(5, 0, 0, replicas, {{0, 1, 3}, {0, 1, 2, 3}}, true);
  ASSERT_EQ(routes.size(), 3u);
  EXPECT_EQ(routes[2].origin, 3);
  EXPECT_THROW(live_routes(5, 0, 0, replicas, {{0, 1}, {}}, true), std::runtime_error);
}

// Issue 29: a worker that joined stage 1 of a 4-replica run as replica 4 is
// routed to (its share of the stage's micro-batches); one that joined stage 0
// brings a fifth data stream, whose route a live worker of stage 1 serves.
TEST(Routing, LiveRoutesReachWorkersThatJoinedTheRun) {
  const int replicas = 4;
  std::map<int, int> stage1_load;
  for (int64_t step = 0; step < 40; ++step)
    for (int64_t micro = 0; micro < 2; ++micro) {
      const auto routes = live_routes(3, step, micro, replicas, {{0, 1, 2, 3}, {0, 1, 2, 3, 4}}, true);
      ASSERT_EQ(routes.size(), 4u) << "one route per first-stage worker: a later-stage joiner brings no data";
      std::set<int> served;
      for (const auto& r : routes) {
        EXPECT_EQ(r.replica[0], r.origin);
        served.insert(r.replica[1]);
        stage1_load[r.replica[1]] += 1;
      }
      EXPECT_EQ(served.size(), 4u) << "four positions of five drawn: no stage-1 worker serves two routes";
    }
  ASSERT_EQ(stage1_load.size(), 5u);
  for (auto [replica, n] : stage1_load) EXPECT_GT(n, 40) << "stage-1 replica " << replica << " of 80 routes";

  const auto grown = live_routes(3, 7, 0, replicas, {{0, 1, 2, 3, 4}, {0, 1, 2, 3}}, true);
  ASSERT_EQ(grown.size(), 5u);
  EXPECT_EQ(grown[4].origin, 4) << "the first-stage joiner's own data";
  for (const auto& r : grown) EXPECT_LT(r.replica[1], 4) << "served by a live stage-1 worker";
  // Evaluation: the last-stage joiner evaluates its own weights, stood in for before it.
  const auto evaluations = evaluation_routes(3, replicas, {{0, 1, 2, 3}, {0, 1, 2, 3, 4}});
  ASSERT_EQ(evaluations.size(), 5u);
  EXPECT_EQ(evaluations[4].replica[1], 4);
  EXPECT_LT(evaluations[4].replica[0], 4);
}

TEST(Routing, EvaluationRoutesFollowEachReplicasOwnPipeline) {
  const LiveReplicas all(3, {0, 1, 2});
  for (const auto& r : evaluation_routes(1, 3, all)) EXPECT_EQ(r.replica, std::vector<int>(3, r.origin));
  const auto routes = evaluation_routes(1, 3, {{0, 2}, {0, 1, 2}, {1, 2}});
  ASSERT_EQ(routes.size(), 2u) << "one per live last-stage replica";
  EXPECT_EQ(routes[0].origin, 1);
  EXPECT_NE(routes[0].replica[0], 1) << "a lost first stage is stood in for";
  EXPECT_EQ((std::vector<int>{routes[0].replica[1], routes[0].replica[2]}), (std::vector<int>{1, 1}));
  EXPECT_EQ(routes[1].replica, (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(evaluation_routes(1, 3, {{0, 2}, {0, 1, 2}, {1, 2}})[0].replica, routes[0].replica) << "stable";
}

TEST(Routing, StageLayerRanges) {
  auto r = stage_layer_ranges(7, 3, "");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].first, 0);
  EXPECT_EQ(r[0].end, 3);
  EXPECT_EQ(r[1].end, 5);
  EXPECT_EQ(r[2].end, 7);
  r = stage_layer_ranges(7, 2, "1,6");
  EXPECT_EQ(r[0].end, 1);
  EXPECT_EQ(r[1].first, 1);
  EXPECT_THROW(stage_layer_ranges(5, 2, "2,2"), std::invalid_argument);
  EXPECT_THROW(stage_layer_ranges(5, 2, "0,5"), std::invalid_argument);
  EXPECT_THROW(stage_layer_ranges(5, 3, "2,3"), std::invalid_argument);
  EXPECT_THROW(stage_layer_ranges(2, 3, ""), std::invalid_argument);
}

TEST(StageModule, StagesComposeToTheWholeModelAndPartitionItsParameters) {
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 50;
  c.hidden = 32;
  c.heads = 2;
  c.layers = 5;
  c.context = 16;
  LlamaForCausalLM whole(c);
  init_weights(whole, 3);
  const auto ranges = stage_layer_ranges(c.layers, 3, "");
  std::vector<StageModule> stages;
  for (size_t s = 0; s < ranges.size(); ++s) stages.emplace_back(whole, ranges[s], s == 0, s + 1 == ranges.size());
  const auto tokens = torch::randint(0, c.vocab_size, {2, 16}, torch::kInt64);
  torch::NoGradGuard no_grad;
  auto x = tokens;
  for (auto& stage : stages) x = stage->forward(x);
  EXPECT_TRUE(torch::equal(x, whole->forward(tokens)));
  std::set<std::string> names;
  size_t count = 0;
  for (auto& stage : stages)
    for (auto& p : stage->named_parameters()) {
      names.insert(p.key());
      ++count;
    }
  std::set<std::string> whole_names;
  for (auto& p : whole->named_parameters()) whole_names.insert(p.key());
  EXPECT_EQ(count, whole_names.size()) << "no parameter in two stages";
  EXPECT_EQ(names, whole_names) << "stage parameters keep the whole model's (Hugging Face) names";
}

namespace {

constexpr std::chrono::milliseconds kLinkTimeout{5000};

// Stage `rank` of a one-replica, two-stage run on this machine, whose store
// the test hosts (as torchrun's agent would: a TCPStore, see hosted_store).
WorkerEnv stage_env(int rank, int port) {
  WorkerEnv env;
  env.rank = rank;
  env.world = 2;
  env.master_port = port;
  env.agent_store = true;
  env.token = "pipeline-test";
  return env;
}

StorePtr hosted_store(int port) {
  c10d::TCPStoreOptions o;
  o.port = uint16_t(port);
  o.isServer = true;
  o.waitWorkers = false;
  o.numWorkers = c10::nullopt;
  o.timeout = kLinkTimeout;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

// One stage worker's door to the other stage: its rosters, its sealed link
// and its activation channel (coding as `codecs` say).
struct StageDoor {
  StageDoor(const StorePtr& store, const WorkerEnv& env, std::chrono::milliseconds timeout,
            const ActivationCodecs& codecs = {}, std::shared_ptr<const ResidualSubspace> subspace = nullptr)
      : rosters(store, env.token, 2, env.world / 2, timeout),
        link("pipeline worker", connect_store(env, timeout), env, {env.rank, 0},
             std::make_shared<LinkEndpoint>(LinkEndpointOptions{}, run_key(env.token, "link"), run_key(env.token, "relay")),
             timeout, rosters),
        channel(rosters, link, 2, codecs, std::move(subspace)) {}
  PipelineRoster rosters;
  PeerLink link;
  ActivationChannel channel;
};

}  // namespace

// Two stage workers in one process (one thread each) over a real store:
// the two stages of one replica.
TEST(ActivationChannel, RejectsAMessageThatTheRoutingDidNotAnnounce) {
  const int port = noloco::testing::free_port();
  const auto host = hosted_store(port);
  std::string error;
  torch::Tensor received;
  auto worker = [&](int rank) {
    const auto env = stage_env(rank, port);
    const auto store = connect_store(env, kLinkTimeout);
    StageDoor door(store, env, kLinkTimeout);
    auto& link = door.channel;
    ASSERT_EQ(link.enter("step/3").stages, (std::vector<std::vector<Peer>>{{{0, 0}}, {{0, 0}}}));
    const auto payload = torch::arange(6, torch::kFloat32);
    if (rank == 0) {
      link.send(1, {MessageKind::activations, 3, 1, 0, /*origin=*/1}, {payload});  // claims another origin
      link.send(1, {MessageKind::activations, 3, 1, 0, /*origin=*/0}, {payload});
    } else {
      std::vector<torch::Tensor> in{torch::zeros({6})};
      try {
        link.recv(0, {MessageKind::activations, 3, 1, 0, 0}, in);
      } catch (const std::exception& e) {
        error = e.what();
      }
      EXPECT_TRUE(link.recv(0, {MessageKind::activations, 3, 1, 0, 0}, in));
      received = in[0];
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  EXPECT_NE(error.find("rejected a pipeline message from worker 0"), std::string::npos) << error;
  EXPECT_NE(error.find("data of replica 1, expected 0 (workers disagree on the routes)"), std::string::npos) << error;
  ASSERT_TRUE(received.defined());
  EXPECT_TRUE(torch::equal(received, torch::arange(6, torch::kFloat32)));
}

// Coded activations (int8 forward, int4 gradients back): values within half
// a quantisation step, the coded bytes counted, evaluations exact, and a
// payload that does not decode (NaN activations give a NaN scale) refused
// and dropped, never applied.
TEST(ActivationChannel, CodedActivationsDecodeWithinAStepAndAMalformedOneIsDropped) {
  const int port = noloco::testing::free_port();
  const auto host = hosted_store(port);
  const ActivationCodecs codecs{{CodecSpec::Type::int8, 0, 64, false}, {CodecSpec::Type::int4, 0, 64, true}};
  const auto values = torch::linspace(-1, 1, 256, torch::kFloat32);
  std::vector<torch::Tensor> got(4);
  PipelineStats stats;
  bool nan_delivered = true;
  auto worker = [&](int rank) {
    const auto env = stage_env(rank, port);
    const auto store = connect_store(env, kLinkTimeout);
    StageDoor door(store, env, kLinkTimeout, codecs);
    auto& channel = door.channel;
    channel.enter("step/1");
    const auto labels = torch::arange(8, torch::kInt64);
    if (rank == 0) {
      channel.send(1, {MessageKind::activations, 1, 0, 0, 0}, {values, labels});
      channel.send(1, {MessageKind::evaluation, 1, 0, 0, 0}, {values, labels});
      channel.send(1, {MessageKind::activations, 1, 1, 0, 0}, {torch::full({256}, NAN), labels});
      std::vector<torch::Tensor> grad{torch::zeros({256})};
      EXPECT_TRUE(channel.recv(1, {MessageKind::gradients, 1, 0, 0, 0}, grad));
      got[3] = grad[0];
      channel.finish_sends();
    } else {
      for (int64_t micro : {0, 1}) {
        std::vector<torch::Tensor> in{torch::zeros({256}), torch::zeros({8}, torch::kInt64)};
        const bool delivered = channel.recv(0, {MessageKind::activations, 1, micro, 0, 0}, in);
        if (micro == 0) {
          EXPECT_TRUE(delivered);
          got[0] = in[0];
          got[1] = in[1];
        } else {
          nan_delivered = delivered;
        }
        if (micro == 0) {
          std::vector<torch::Tensor> eval{torch::zeros({256}), torch::zeros({8}, torch::kInt64)};
          EXPECT_TRUE(channel.recv(0, {MessageKind::evaluation, 1, 0, 0, 0}, eval));
          got[2] = eval[0];
        }
      }
      channel.send(0, {MessageKind::gradients, 1, 0, 0, 0}, {values});
      channel.finish_sends();
      stats = channel.stats();
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  ASSERT_TRUE(got[0].defined() && got[2].defined() && got[3].defined());
  // int8: scale max|x|/127 per 64 values (bf16, rounded up); int4: /7.
  EXPECT_LE((got[0] - values).abs().max().item<float>(), 1.01f / 127 / 2 * 1.01f);
  EXPECT_GT((got[0] - values).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(got[1], torch::arange(8, torch::kInt64)));
  EXPECT_TRUE(torch::equal(got[2], values)) << "evaluations travel exact";
  EXPECT_LE((got[3] - values).abs().max().item<float>(), 1.01f / 7 * 1.01f);  // stochastic: within one step
  EXPECT_FALSE(nan_delivered) << "a malformed payload is never applied";
  EXPECT_EQ(stats.micro_batches_dropped, 1);
  // Received for training: 2 int8 activations (256 + 4 scales of 2 bytes) with their labels.
  EXPECT_EQ(stats.bytes_received, uint64_t(2 * (256 + 4 * 2 + 8 * 8)));
  // Sent: one int4 gradient message (128 + 4 scales of 2 bytes).
  EXPECT_EQ(stats.bytes_sent, uint64_t(128 + 4 * 2));
}

// activation_subspace: a boundary carries K coordinates a token, coded by
// the direction's codec (int8 here: K·tokens bytes plus a bf16 scale per 64
// values); the receiver rebuilds the hidden states from the token ids it
// knows, and gradients as their projection onto the span. Coordinates that
// are not finite are refused and their micro-batch dropped; a receiver that
// expects another K rejects the message by its header.
TEST(ActivationChannel, SubspaceCoordinatesCrossInTheirFormulasSizeAndAMalformedOneIsDropped) {
  const int port = noloco::testing::free_port();
  const auto host = hosted_store(port);
  const int64_t B = 2, T = 8, H = 32, K = 8;
  torch::manual_seed(0);
  const auto embedding = torch::randn({20, H});
  const auto subspace = std::make_shared<const ResidualSubspace>(K, 11, embedding, 1);
  const auto other_k = std::make_shared<const ResidualSubspace>(K / 2, 11, embedding, 1);
  const auto ids = torch::randint(20, {B, T}, torch::kInt64);
  // A hidden state the constrained model can produce: F[ids] + U·z.
  const auto z = torch::randn({B, T, K});
  const auto h = subspace->residual(z, ids);
  const auto g = torch::randn({B, T, H});
  const ActivationCodecs codecs{{CodecSpec::Type::int8, 0, 64, false}, {CodecSpec::Type::fp32, 0, 64, false}};
  torch::Tensor got_h, got_g;
  bool nan_delivered = true;
  std::string other_k_error;
  PipelineStats receiver;
  auto worker = [&](int rank) {
    const auto env = stage_env(rank, port);
    const auto store = connect_store(env, kLinkTimeout);
    StageDoor door(store, env, kLinkTimeout, codecs, subspace);
    auto& channel = door.channel;
    channel.enter("step/1");
    if (rank == 0) {
      channel.send(1, {MessageKind::activations, 1, 0, 0, 0}, {h});
      channel.send(1, {MessageKind::activations, 1, 1, 0, 0}, {torch::full({B, T, H}, NAN)});
      channel.send(1, {MessageKind::activations, 1, 2, 0, 0}, {h});
      std::vector<torch::Tensor> grad{torch::zeros({B, T, H})};
      EXPECT_TRUE(channel.recv(1, {MessageKind::gradients, 1, 0, 0, 0}, grad));
      got_g = grad[0];
      channel.finish_sends();
    } else {
      std::vector<torch::Tensor> in{torch::zeros({B, T, H})};
      EXPECT_TRUE(channel.recv(0, {MessageKind::activations, 1, 0, 0, 0}, in, ids));
      got_h = in[0];
      in = {torch::zeros({B, T, H})};
      nan_delivered = channel.recv(0, {MessageKind::activations, 1, 1, 0, 0}, in, ids);
      ActivationChannel wrong(door.rosters, door.link, 2, codecs, other_k);
      in = {torch::zeros({B, T, H})};
      try {
        wrong.recv(0, {MessageKind::activations, 1, 2, 0, 0}, in, ids);
      } catch (const std::exception& e) {
        other_k_error = e.what();
      }
      channel.send(0, {MessageKind::gradients, 1, 0, 0, 0}, {g});
      channel.finish_sends();
      receiver = channel.stats();
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  ASSERT_TRUE(got_h.defined() && got_g.defined());
  // int8 on z: within half a step of each 64-value block's scale, carried back through orthonormal U.
  const double step = z.abs().max().item<double>() / 127;
  EXPECT_LT((got_h - h).abs().max().item<double>(), step * std::sqrt(double(K)));
  EXPECT_GT((got_h - h).abs().max().item<double>(), 0.0) << "int8 on top of the subspace";
  const auto& u = subspace->basis();
  EXPECT_LT((got_g - g.matmul(u).matmul(u.t())).abs().max().item<double>(), 1e-5) << "fp32 gradients: U·Uᵀg";
  EXPECT_FALSE(nan_delivered) << "a malformed subspace payload is never applied";
  EXPECT_NE(other_k_error.find("rejected a pipeline message from worker 0"), std::string::npos) << other_k_error;
  EXPECT_EQ(receiver.micro_batches_dropped, 1);
  // Received for training: two int8 payloads of B·T·K values (the rejected
  // one is not counted); sent: one fp32 gradient payload.
  const double values = B * T * K;
  EXPECT_EQ(receiver.bytes_received, uint64_t(2 * (values + values / 64 * 2)));
  EXPECT_EQ(receiver.bytes_sent, uint64_t(values * 4));
}

// A dropped micro-batch is announced, not awaited; a neighbour whose pair
// fails (here: its group is torn down) is lost, and the next roster leaves it out.
TEST(ActivationChannel, DroppedNoticesAndALostNeighbour) {
  const int port = noloco::testing::free_port();
  const auto host = hosted_store(port);
  std::promise<void> received_two, done;
  auto second = received_two.get_future();
  auto finished = done.get_future();
  PipelineStats stats;
  std::optional<Roster> next;
  auto worker = [&](int rank) {
    const auto env = stage_env(rank, port);
    const auto store = connect_store(env, kLinkTimeout);
    {
      StageDoor door(store, env, kLinkTimeout);
      auto& link = door.channel;
      link.enter("step/0");
      const auto payload = torch::arange(6, torch::kFloat32);
      std::vector<torch::Tensor> in{torch::zeros({6})};
      if (rank == 0) {
        link.send_dropped(1, {MessageKind::activations, 0, 0, 0, 0});
        link.send(1, {MessageKind::activations, 0, 1, 0, 0}, {payload});
        link.finish_sends();
        second.wait();
      } else {
        EXPECT_FALSE(link.recv(0, {MessageKind::activations, 0, 0, 0, 0}, in)) << "dropped upstream";
        EXPECT_TRUE(link.recv(0, {MessageKind::activations, 0, 1, 0, 0}, in));
        EXPECT_TRUE(torch::equal(in[0], payload));
        received_two.set_value();
        EXPECT_FALSE(link.recv(0, {MessageKind::activations, 0, 2, 0, 0}, in)) << "worker 0 is gone";
        EXPECT_FALSE(link.recv(0, {MessageKind::activations, 0, 3, 0, 0}, in)) << "and stays lost";
        link.send(0, {MessageKind::gradients, 0, 1, 0, 0}, {payload});  // to a lost worker: nothing is sent
        link.finish_sends();
        stats = link.stats();
        next = link.enter("step/1");
      }
    }  // worker 0's link goes here: worker 1's pair with it fails
    if (rank == 0) finished.wait();  // until worker 1 has seen it lost
    else done.set_value();
  };
  std::thread b(worker, 1);
  worker(0);
  b.join();
  EXPECT_EQ(stats.micro_batches_dropped, 3);
  EXPECT_EQ(stats.peers_lost, 1);
  ASSERT_TRUE(next);
  EXPECT_TRUE(next->stages[0].empty()) << "the next step routes around worker 0";
  EXPECT_EQ(next->stages[1], (std::vector<Peer>{{0, 0}}));
}

// The pipeline's liveness authority: a neighbour the launcher declared dead
// (here: written to the store by the test) is given up before the link waits
// for it, not after the link's timeout (30 s here), and the next roster
// leaves it out.
TEST(ActivationChannel, ANeighbourDeclaredDeadIsGivenUpWithoutWaiting) {
  const int port = noloco::testing::free_port();
  const auto host = hosted_store(port);
  constexpr std::chrono::seconds kPatient{30};
  std::promise<void> done;
  auto finished = done.get_future();
  PipelineStats stats;
  std::optional<Roster> next;
  double waited = -1;
  auto worker = [&](int rank) {
    const auto env = stage_env(rank, port);
    const auto store = connect_store(env, kLinkTimeout);
    StageDoor door(store, env, kPatient);
    auto& link = door.channel;
    link.enter("step/0");
    if (rank == 0) {
      finished.wait_for(std::chrono::seconds(60));  // alive, in the group, and silent: it never sends
      return;
    }
    declare_dead(store, env.token, record::replica_group(2, 0), 0);
    std::vector<torch::Tensor> in{torch::zeros({6})};
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(link.recv(0, {MessageKind::activations, 0, 0, 0, 0}, in));
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats = link.stats();
    next = link.enter("step/1");
    done.set_value();
  };
  std::thread a(worker, 0);
  worker(1);
  a.join();
  EXPECT_LT(waited, 10.0) << "the link's timeout is 30 s";
  EXPECT_EQ(stats.peers_lost, 1);
  EXPECT_EQ(stats.micro_batches_dropped, 1);
  ASSERT_TRUE(next);
  EXPECT_TRUE(next->stages[0].empty());
}

namespace {

class Pipeline : public noloco::testing::LaunchedRuns {
 protected:
  Pipeline() { run_timeout_s = 180; }
  // replica -> step -> loss, from the workers that compute the loss.
  static std::map<int, std::map<int64_t, double>> losses(const std::string& run, const std::string& split) {
    std::map<int, std::map<int64_t, double>> out;
    for (auto& r : metrics_records(run, split))
      if (r.contains("loss")) out[r["replica"].get<int>()][r["step"].get<int64_t>()] = r["loss"].get<double>();
    return out;
  }
};

void expect_same_losses(const std::map<int, std::map<int64_t, double>>& a,
                        const std::map<int, std::map<int64_t, double>>& b, size_t steps) {
  ASSERT_EQ(a.size(), b.size());
  for (auto& [replica, by_step] : a) {
    ASSERT_EQ(by_step.size(), steps) << "replica " << replica;
    for (auto& [step, loss] : by_step)
      EXPECT_NEAR(loss, b.at(replica).at(step), 1e-5) << "replica " << replica << " step " << step;
  }
}

}  // namespace

// The acceptance test: fixed routing, P = 2, the same losses as the
// unpipelined run (fp32, within 1e-5). Per-stage clipping differs from
// whole-model clipping by design, so clipping is off in both runs.
TEST_F(Pipeline, FixedRoutingWithTwoStagesMatchesTheUnpipelinedRun) {
  const std::string common = "batch=4 grad_accum=2 steps=12 clip=0 eval_interval=6";
  const auto piped = run("piped", "stages=2 routing=fixed activation_codec=fp32 " + common);
  const auto whole = run("whole", common);
  expect_same_losses(losses(piped, "train"), losses(whole, "train"), 12);
  expect_same_losses(losses(piped, "val"), losses(whole, "val"), 2);
  // Per step: M micro-batches cross the boundary forward (activations fp32;
  // the last stage samples the labels itself) and back (gradients fp32).
  const auto summary = read_json(piped + "/summary.json");
  const double B = 4, T = 32, H = 32, M = 2;
  EXPECT_EQ(summary["activation_bytes_per_step"].get<double>(), M * (B * T * H * 4 + B * T * H * 4));
  EXPECT_EQ(summary["pipeline_idle_seconds_per_stage"].size(), 2u);
  EXPECT_EQ(summary["activation_codec"], "fp32");
  EXPECT_EQ(summary["activation_rotation"], false) << "fp32 is never rotated, whatever the key says";
}

// activation_codec=int8 (and int4 gradients): what crosses the boundary is
// the coded bytes, 1 (int8) or 1/2 (int4) a value plus a bf16 scale per 64
// values; training goes on close to the fp32 run, and the summary says how.
// The same for rotated int3 activations and int2 gradients (3/8 and 2/8).
TEST_F(Pipeline, CodedActivationsCrossTheBoundaryInTheirCodedSize) {
  const std::string common = "batch=4 grad_accum=2 steps=12 clip=0 eval_interval=6 stages=2 routing=fixed";
  const auto coded = run("coded", common + " activation_codec=int8 activation_grad_codec=int4 activation_rotation=false");
  const auto exact = run("exact", common + " activation_codec=fp32");
  const auto summary = read_json(coded + "/summary.json");
  const double B = 4, T = 32, H = 32, M = 2, scales = B * T * H / 64 * 2;
  EXPECT_EQ(summary["activation_bytes_per_step"].get<double>(),
            M * ((B * T * H + scales) + (B * T * H / 2 + scales)));
  EXPECT_EQ(summary["activation_codec"], "int8");
  EXPECT_EQ(summary["activation_grad_codec"], "int4");
  EXPECT_EQ(summary["activation_rotation"], false);
  const auto low = run("low", common + " activation_codec=int3 activation_grad_codec=int2");  // rotated: the default
  const auto low_summary = read_json(low + "/summary.json");
  EXPECT_EQ(low_summary["activation_bytes_per_step"].get<double>(),
            M * ((B * T * H * 3 / 8 + scales) + (B * T * H * 2 / 8 + scales)));
  EXPECT_EQ(low_summary["activation_rotation"], true);
  const auto low_val = losses(low, "val"), exact_val = losses(exact, "val");
  for (const auto& [step, loss] : exact_val.at(0))
    EXPECT_NEAR(low_val.at(0).at(step), loss, 0.05 * loss) << "rotated int3/int2, step " << step;
  // `report` plots the two runs' final losses against their activation bytes, a dot a run.
  const auto md = write_report({coded, exact}, dir / "report", {});
  EXPECT_NE(md.find("(val_loss_vs_activation_bytes.svg)"), std::string::npos) << md;
  const auto plot = read_file(dir / "report/val_loss_vs_activation_bytes.svg");
  EXPECT_NE(plot.find("<circle"), std::string::npos) << plot;
  EXPECT_NE(plot.find("<circle", plot.find("<circle") + 1), std::string::npos) << plot;
  const auto a = losses(coded, "val"), b = losses(exact, "val");
  ASSERT_EQ(a.at(0).size(), 2u);
  for (const auto& [step, loss] : b.at(0)) {
    EXPECT_NE(a.at(0).at(step), loss) << "coded: not the exact run";
    EXPECT_NEAR(a.at(0).at(step), loss, 0.02 * loss) << "step " << step;
  }
}

// Outer methods act per stage across the replicas of that stage; with fixed
// routing that is exactly the unpipelined method.
TEST_F(Pipeline, DdpAndNoLoCoPerStageMatchTheUnpipelinedMethods) {
  const std::string ddp = "method=ddp replicas=2 batch=2 steps=6 clip=0";
  expect_same_losses(losses(run("ddp_piped", ddp + " stages=2 routing=fixed activation_codec=fp32"), "train"),
                     losses(run("ddp_whole", ddp), "train"), 6);

  const std::string noloco = "method=noloco replicas=4 batch=2 steps=6 outer_interval=3 clip=0";
  const auto piped = run("noloco_piped", noloco + " stages=2 routing=fixed activation_codec=fp32");
  const auto whole = run("noloco_whole", noloco);
  for (int d = 0; d < 4; ++d) {
    const auto reference = load_tensors(find_checkpoint(whole + "/checkpoints/r" + std::to_string(d)) + "/model.safetensors");
    size_t compared = 0;
    for (int s = 0; s < 2; ++s) {
      const auto stage_dir = piped + "/checkpoints/r" + std::to_string(d * 2 + s);
      for (auto& [name, t] : load_tensors(find_checkpoint(stage_dir) + "/model.safetensors")) {
        EXPECT_LT((t - reference.at(name)).abs().max().item<double>(), 1e-5) << "replica " << d << " " << name;
        ++compared;
      }
    }
    EXPECT_EQ(compared, reference.size()) << "the stages' checkpoints together hold the whole model";
  }
}

// Random routing: every message is checked against the receiver's own
// routing (sender, step, micro-batch, boundary, data origin), so a run that
// finishes is one where all workers agreed on every permutation. DiLoCo with
// three stages, so that a middle stage both receives and sends.
TEST_F(Pipeline, RandomRoutingTrainsWithAllMethodsAndMixesReplicas) {
  const std::string common = "replicas=2 batch=2 grad_accum=2 steps=6 layers=3 stages=3 eval_interval=3";
  const auto random = run("random", "method=diloco outer_interval=3 " + common);
  const auto fixed = run("fixed", "method=diloco outer_interval=3 routing=fixed " + common);
  const auto a = losses(random, "train"), b = losses(fixed, "train");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  double largest = 0;
  for (int d = 0; d < 2; ++d)
    for (auto& [step, loss] : a.at(d)) largest = std::max(largest, std::abs(loss - b.at(d).at(step)));
  EXPECT_GT(largest, 1e-6) << "random routing sends micro-batches through other replicas' stages";
  const auto summary = read_json(random + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].size(), 6u);
  EXPECT_EQ(summary["pipeline_idle_seconds_per_stage"].size(), 3u);
  EXPECT_EQ(summary["collectives"].get<int64_t>(), 6 * 2) << "one all-reduce per outer step per worker";
}

// Each stage checkpoints its own slice; a resumed pipelined run continues
// bit-identically, and export joins the stages into the whole model.
TEST_F(Pipeline, ResumesBitIdenticallyAndExportsTheWholeModel) {
  const std::string common =
      "method=noloco replicas=2 stages=2 batch=2 grad_accum=2 outer_interval=3 decay_steps=8 checkpoint_interval=4";
  const auto straight = run("straight", common + " steps=8");
  run("split", common + " steps=4");
  const auto split = run("split", common + " steps=8 resume=true");
  for (int worker = 0; worker < 4; ++worker) {
    const auto sub = "/checkpoints/r" + std::to_string(worker);
    const auto a = load_tensors(find_checkpoint(straight + sub) + "/model.safetensors");
    const auto b = load_tensors(find_checkpoint(split + sub) + "/model.safetensors");
    ASSERT_EQ(a.size(), b.size());
    for (auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << "worker " << worker << " " << name;
  }
  // Replica 0's stages (workers 0 and 1) join into its whole model; the
  // mean is of both replicas' whole models.
  auto r = noloco::testing::run_cli("export " + straight + " " + (dir / "hf") + " replica=0", 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = noloco::testing::run_cli("export " + straight + " " + (dir / "hf_mean") + " replica=mean", 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto exported = load_tensors(dir / "hf/model.safetensors");
  const auto mean = load_tensors(dir / "hf_mean/model.safetensors");
  size_t from_stages = 0;
  for (int s = 0; s < 2; ++s) {
    const auto other = load_tensors(find_checkpoint(straight + "/checkpoints/r" + std::to_string(2 + s)) +
                                    "/model.safetensors");
    for (auto& [name, t] : load_tensors(find_checkpoint(straight + "/checkpoints/r" + std::to_string(s)) +
                                        "/model.safetensors")) {
      EXPECT_TRUE(torch::equal(t, exported.at(name))) << name;
      EXPECT_TRUE(torch::allclose(mean.at(name), (t + other.at(name)) / 2, 1e-6, 1e-7)) << name;
      ++from_stages;
    }
  }
  EXPECT_EQ(from_stages, exported.size());
  r = noloco::testing::run_cli("generate " + straight + " tokens=20", 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// activation_subspace=K (issue 51): the boundary carries K fp32 values a
// token each way (exact: ResidualSubspace.ABoundaryOfKCoordinatesGives...),
// the constraint changes training, the embedding's frozen part has the
// configured scale, and the summary reports the bits a hidden-state value; a
// run without stages has nothing to constrain.
TEST_F(Pipeline, SubspaceBoundaryCarriesKValuesAToken) {
  const std::string common = "batch=4 grad_accum=2 steps=12 clip=0 eval_interval=6 stages=2 routing=fixed "
                             "activation_codec=fp32";
  const auto piped = run("sub_piped", "activation_subspace=8 activation_subspace_token_std=0.5 " + common);
  const auto embedding =
      load_tensors(find_checkpoint(piped + "/checkpoints/r0") + "/model.safetensors").at("model.embed_tokens.weight");
  EXPECT_NEAR(frozen_part(embedding, subspace_basis(32, 8, 1337)).std().item<double>(), 0.5, 1e-3);
  const auto plain = run("plain_piped", common);
  const auto plain_train = losses(plain, "train"), piped_train = losses(piped, "train");
  ASSERT_EQ(piped_train.at(0).size(), 12u);
  double apart = 0;
  for (const auto& [step, loss] : plain_train.at(0)) apart = std::max(apart, std::abs(loss - piped_train.at(0).at(step)));
  EXPECT_GT(apart, 1e-3) << "the constraint changes training";
  const auto summary = read_json(piped + "/summary.json");
  const double B = 4, T = 32, K = 8, M = 2, H = 32;
  EXPECT_EQ(summary["activation_bytes_per_step"].get<double>(), M * 2 * (B * T * K * 4));
  EXPECT_EQ(summary["activation_subspace"].get<int64_t>(), 8);
  EXPECT_DOUBLE_EQ(summary["activation_bits_per_value"].get<double>(), 32 * K / H);
  const auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "none") + " activation_subspace=8", 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("activation_subspace needs stages > 1"), std::string::npos) << r.output;
}

// NoLoCo with int8 outer messages (whose decoded means leave the span) and
// int8 activations: after every outer step stage 0's writers are back in
// span(U) (stage 1's, the last stage's, write freely), the embedding's frozen
// part never moves, a resumed run continues bit-identically, and the export
// is an ordinary Llama that a subspace run imports unchanged.
TEST_F(Pipeline, SubspaceRunStaysInTheSpanResumesBitIdenticallyAndExports) {
  const std::string common =
      "method=noloco replicas=2 stages=2 batch=2 grad_accum=2 outer_interval=4 decay_steps=8 checkpoint_interval=4 "
      "activation_subspace=8 activation_codec=int8 wire_dtype=int8";
  const auto straight = run("sub_straight", common + " steps=8");
  run("sub_split", common + " steps=4");
  const auto split = run("sub_split", common + " steps=8 resume=true");
  const auto rescaled = noloco::testing::run_cli(
      small_train_args(dir / "c.txt", dir / "sub_split") + " " + common + " steps=8 resume=true activation_subspace_token_std=0.5", 60);
  EXPECT_NE(rescaled.exit_code, 0);
  EXPECT_NE(rescaled.output.find("has activation_subspace 8 (frozen part's std 0.015625), this config 8 (frozen "
                                 "part's std 0.5)"),
            std::string::npos)
      << rescaled.output;
  const auto u = subspace_basis(32, 8, 1337);
  for (int worker = 0; worker < 4; ++worker) {
    const auto sub = "/checkpoints/r" + std::to_string(worker);
    const auto a = load_tensors(find_checkpoint(straight + sub) + "/model.safetensors");
    const auto b = load_tensors(find_checkpoint(split + sub) + "/model.safetensors");
    ASSERT_EQ(a.size(), b.size());
    for (auto& [name, t] : a) {
      EXPECT_TRUE(torch::equal(t, b.at(name))) << "worker " << worker << " " << name;
      if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) {
        if (worker % 2 == 0)
          EXPECT_LT(outside_span(t, u), 1e-6) << "worker " << worker << " " << name;
        else
          EXPECT_GT(outside_span(t, u), 1e-2) << "worker " << worker << " " << name << " writes freely";
      }
    }
    if (worker % 2 == 0) {  // stage 0 holds the embedding
      const auto at4 = load_tensors(straight + sub + "/step_00000004/model.safetensors").at("model.embed_tokens.weight");
      const auto frozen = frozen_part(a.at("model.embed_tokens.weight"), u);
      EXPECT_LT((frozen - frozen_part(at4, u)).abs().max().item<double>(), 1e-6);
      EXPECT_NEAR(frozen.std().item<double>(), 32.0 / 2048, 1e-5) << "a seeded run's frozen part at the width's scale";
      EXPECT_GT((a.at("model.embed_tokens.weight") - at4).abs().max().item<double>(), 1e-4) << "it trained";
    }
  }
  auto r = noloco::testing::run_cli("export " + straight + " " + (dir / "hf"), 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  LlamaForCausalLM exported(read_hf_config(dir / "hf"));
  load_hf_weights(exported, dir / "hf");
  const auto tokens = torch::randint(exported->config.vocab_size, {2, 16}, torch::kInt64);
  torch::NoGradGuard no_grad;
  const auto logits = exported->forward(tokens);
  FlatParams flat(*exported);
  auto subspace = std::make_shared<const ResidualSubspace>(8, 1337, exported->model->embed_tokens->weight, 1);
  flat.constrain(std::make_shared<const SubspaceConstraint>(subspace, flat));
  EXPECT_LT((exported->forward(tokens) - logits).abs().max().item<double>(), 1e-5)
      << "imported into a subspace run, the exported model is unchanged";
}

// 1F1B against GPipe, three stages with random routing and more micro-batches
// than stages: backward runs in micro-batch order under both, so the runs are
// bit-identical, while stage s holds at most stages - s micro-batches.
TEST_F(Pipeline, OneForwardOneBackwardEqualsGPipeWithBoundedActivations) {
  const std::string common = "method=noloco replicas=2 batch=2 grad_accum=5 steps=4 layers=3 stages=3 outer_interval=2";
  const auto gpipe = run("gpipe", common);
  const auto interleaved = run("1f1b", common + " schedule=1f1b");
  const auto a = losses(gpipe, "train"), b = losses(interleaved, "train");
  ASSERT_EQ(a.size(), 2u);
  for (auto& [replica, by_step] : a) {
    ASSERT_EQ(by_step.size(), 4u);
    for (auto& [step, loss] : by_step) EXPECT_EQ(loss, b.at(replica).at(step)) << "replica " << replica;
  }
  for (int worker = 0; worker < 6; ++worker) {
    const auto sub = "/checkpoints/r" + std::to_string(worker);
    const auto wa = load_tensors(find_checkpoint(gpipe + sub) + "/model.safetensors");
    const auto wb = load_tensors(find_checkpoint(interleaved + sub) + "/model.safetensors");
    for (auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << "worker " << worker << " " << name;
    const int stage = worker % 3;
    const auto held = [&](const std::string& run) {
      const auto summary = read_json(fmt::format("{}/summary_r{}_s{}.json", run, worker / 3, stage));
      return summary["peak_micro_batches_held"].get<int64_t>();
    };
    EXPECT_EQ(held(gpipe), 5) << "worker " << worker;
    EXPECT_EQ(held(interleaved), 3 - stage) << "worker " << worker;
  }
}

// Issue 15: with random routing a stage worker killed mid-run is routed
// around. The run finishes without it (exit 3: done, but not whole) with a
// validation loss close to that of the run without the kill.
TEST_F(Pipeline, RandomRoutingGoesAroundAKilledStageWorker) {
  const std::string common =
      "method=noloco replicas=4 stages=2 batch=2 grad_accum=2 steps=40 outer_interval=5 eval_interval=20";
  const auto intact = run("intact", common);
  auto r = noloco::testing::run_cli(
      small_train_args(dir / "c.txt", dir / "killed") + " " + common + " inject_crash=3:12", run_timeout_s);
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const auto a = read_json(intact + "/summary.json"), b = read_json(dir / "killed/summary.json");
  ASSERT_EQ(b["replicas_failed"].size(), 1u) << b.dump();
  EXPECT_NE(b["replicas_failed"][0]["reason"].get<std::string>().find("worker 3 was killed by signal 9"), std::string::npos)
      << b.dump();
  EXPECT_EQ(b["replicas_finished"].size(), 7u) << b.dump();
  const double reference = a["final_val_loss"].get<double>(), survived = b["final_val_loss"].get<double>();
  EXPECT_NEAR(survived, reference, 0.02 * reference);
  EXPECT_EQ(b["final_val_loss_replicas"].size(), 3u) << "the last stages of replicas 0, 2 and 3";
  const auto trained = losses(dir / "killed", "train");
  for (int d : {0, 2, 3}) EXPECT_EQ(trained.at(d).size(), 40u) << "replica " << d << " lost no step";
  EXPECT_EQ(trained.at(1).size(), 12u);
}

// A hung stage worker (SIGSTOP) is killed by the launcher once its heartbeat
// is silent for heartbeat_timeout, long before peer_timeout; then it is
// routed around like a crashed one.
TEST_F(Pipeline, AHungStageWorkerIsKilledByItsHeartbeatAndRoutedAround) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "hung") +
                                        " method=noloco replicas=4 stages=2 batch=2 grad_accum=2 steps=40 outer_interval=5"
                                        " peer_timeout=600 heartbeat_timeout=4 inject_crash=3:12:freeze",
                                    run_timeout_s);
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const auto summary = read_json(dir / "hung/summary.json");
  ASSERT_EQ(summary["replicas_failed"].size(), 1u) << summary.dump();
  EXPECT_NE(summary["replicas_failed"][0]["reason"].get<std::string>().find("no heartbeat for"), std::string::npos)
      << "killed for its silent heartbeat: " << summary.dump();
  EXPECT_EQ(summary["replicas_finished"].size(), 7u) << summary.dump();
  const auto trained = losses(dir / "hung", "train");
  for (int d : {0, 2, 3}) EXPECT_EQ(trained.at(d).size(), 40u) << "replica " << d;
}

// With restarts=1 the killed worker comes back: it takes its stage's state
// from a live replica of that stage and is routed to again. The run is long
// enough (120 steps) that the restart, a new process that loads LibTorch and
// meets the store again, lands well before the end even on a loaded machine.
// The run keeps its residual stream in a subspace (activation_subspace=8), so
// routing around the lost worker and the newcomer's boundaries use it too:
// the newcomer derives the same basis and frozen embedding from the seed.
TEST_F(Pipeline, AKilledStageWorkerRestartsAndRejoinsItsStage) {
  const std::string run_dir = dir / "rejoin";
  noloco::testing::BackgroundCli launcher(small_train_args(dir / "c.txt", run_dir) +
                                          " method=noloco replicas=4 stages=2 batch=2 grad_accum=2 steps=1000000"
                                          " outer_interval=5 inject_crash=3:12 restarts=1 activation_subspace=8",
                                      240);
  // The events the test is about: worker 3 (replica 1, stage 1) back from a
  // live replica's state, then computing replica 1's losses again.
  std::optional<nlohmann::json> rejoin;
  bool trained_after = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  while (!trained_after && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!std::filesystem::exists(run_dir + "/metrics.jsonl")) continue;
    if (!rejoin) {
      const auto records = metrics_records(run_dir, "rejoin");
      if (!records.empty()) rejoin = records[0];
      continue;
    }
    const auto trained = losses(run_dir, "train");
    trained_after = trained.count(1) && trained.at(1).rbegin()->first > (*rejoin)["step"].get<int64_t>();
  }
  EXPECT_EQ(::system(("pkill -INT -f '[n]oloco train .*out=" + run_dir + " '").c_str()), 0);
  const auto& result = launcher.wait();
  ASSERT_TRUE(rejoin) << result.output;
  EXPECT_EQ((*rejoin)["replica"], 1);
  EXPECT_EQ((*rejoin)["stage"], 1);
  const auto step = (*rejoin)["step"].get<int64_t>();
  EXPECT_GT(step, 12) << "from a live replica, after the crash";
  EXPECT_EQ(step % 5, 0) << "handed over after an outer step";
  EXPECT_NE((*rejoin)["donor"].get<int>(), 1) << "a live replica of stage 1, not itself";
  EXPECT_TRUE(trained_after) << "worker 3 computed replica 1's losses again after rejoining at step " << step;
  EXPECT_NE(result.output.find("restarting worker 3"), std::string::npos) << result.output;
  EXPECT_EQ(result.exit_code, 130) << "ended by the test's Ctrl-C, not before:\n" << result.output;
  EXPECT_NE(::system(("pgrep -f '[n]oloco train .*out=" + run_dir + " ' > /dev/null").c_str()), 0)
      << "a worker outlived the launcher";
}

// Issue 29: a pipelined run gains stage workers. Worker 3 (stage 1 of
// replica 1) dies early; a joiner that names no stage takes the stage with
// the fewest live workers (stage 1), another names stage 0. Each takes a live
// replica of its stage's state, is routed to, pairs with its stage's replicas
// in the outer steps, and finishes; the new stage-1 worker's final loss is
// the first replica's within 2%.
TEST_F(Pipeline, WorkersJoinARunningPipelinedRunAtTheStageWithFewestWorkers) {
  const std::string run_dir = dir / "grow";
  const int steps = 500;
  noloco::testing::BackgroundCli runner(small_train_args(dir / "c.txt", run_dir) +
                                            fmt::format(" method=noloco replicas=2 stages=2 batch=2 grad_accum=2 "
                                                        "steps={} outer_interval=5 threads=1 inject_crash=3:10",
                                                        steps),
                                        300);
  // Well past worker 3's death (the launcher records it within 50 ms), so
  // that the stage that lost it has the fewest live workers.
  bool past_death = false;
  for (int i = 0; i < 1200 && !past_death; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (std::filesystem::exists(run_dir + "/metrics.jsonl"))
      for (auto& t : metrics_records(run_dir, "train")) past_death |= t["step"].get<int64_t>() >= 30;
  }
  ASSERT_TRUE(past_death);
  noloco::testing::BackgroundCli fewest("join " + run_dir + " threads=1", 280),
      named("join " + run_dir + " threads=1 stage=0", 280);
  const auto& a = fewest.wait();
  const auto& b = named.wait();
  const auto& r = runner.wait();
  ASSERT_EQ(r.exit_code, 3) << "finished without worker 3: " << r.output;
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(a.output.find("as worker 5: stage 1 of replica 2"), std::string::npos) << a.output;
  EXPECT_NE(b.output.find("as worker 4: stage 0 of replica 2"), std::string::npos) << b.output;

  const auto summary = read_json(run_dir + "/summary.json");
  const auto finished = summary["replicas_finished"].get<std::vector<int>>();
  EXPECT_EQ(std::set<int>(finished.begin(), finished.end()), (std::set<int>{0, 1, 2, 4, 5})) << summary.dump();
  ASSERT_EQ(summary["joined"].size(), 2u) << summary.dump();
  std::map<int, int64_t> joined_at;  // worker -> step
  for (const auto& j : summary["joined"]) {
    joined_at[j["replica"].get<int>()] = j["step"].get<int64_t>();
    EXPECT_EQ(j["step"].get<int64_t>() % 5, 0) << "handed over after an outer step: " << j.dump();
    EXPECT_LT(j["step"].get<int64_t>(), steps) << j.dump();
    EXPECT_NE(j["donor"].get<int>(), 2) << "a live replica of its stage, not itself: " << j.dump();
  }
  ASSERT_EQ(joined_at.size(), 2u);
  ASSERT_TRUE(joined_at.count(4) && joined_at.count(5)) << summary.dump();

  // Routed to: the new stage-1 worker computed replica 2's losses after its
  // hand-over, and the stage-0 one sent activations of its own data.
  const auto trained = losses(run_dir, "train");
  ASSERT_TRUE(trained.count(2));
  EXPECT_GT(trained.at(2).begin()->first, joined_at[5]);
  EXPECT_EQ(trained.at(2).rbegin()->first, steps);
  EXPECT_GT(double(trained.at(2).size()), 0.95 * double(steps - joined_at[5])) << "routed to at (nearly) every step";
  EXPECT_GT(read_json(run_dir + "/summary_r2_s0.json")["activation_bytes_sent"].get<double>(), 0);
  // In the groupings: replica 0 of each stage averaged with the joiner of its stage.
  std::set<int> stages_paired;
  for (auto& o : metrics_records(run_dir, "outer"))
    if (o["replica"].get<int>() == 0)
      for (int member : o["group"].get<std::vector<int>>())
        if (member == 2) stages_paired.insert(o["stage"].get<int>());
  EXPECT_EQ(stages_paired, (std::set<int>{0, 1}));
  const double first = read_json(run_dir + "/summary_r0_s1.json")["final_val_loss"].get<double>(),
               joiner = read_json(run_dir + "/summary_r2_s1.json")["final_val_loss"].get<double>();
  EXPECT_NEAR(joiner, first, 0.02 * first);
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;

  // A fixed-routing pipeline has no routes for a newcomer: refused with one line, before the store is asked.
  auto yaml = noloco::testing::read_text(run_dir + "/config.yaml");
  const auto at = yaml.find("routing: random");
  ASSERT_NE(at, std::string::npos) << yaml;
  yaml.replace(at, std::string("routing: random").size(), "routing: fixed");
  noloco::testing::write_text(run_dir + "/config.yaml", yaml);
  const auto refused = noloco::testing::run_cli("join " + run_dir + " store=http://127.0.0.1:9", 60);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("routing=fixed; only a noloco run (pipelined: with routing=random) takes joiners"),
            std::string::npos)
      << refused.output;
}

// Issue 29: a stage worker told to leave (SIGTERM) saves its state, leaves
// its stage, and serves the steps whose rosters were frozen before it left,
// so that no neighbour loses a micro-batch or waits for it; its stage's other
// worker takes its share from then on, and the run ends exit 0.
TEST_F(Pipeline, AStageWorkerLeavesOnSigtermAndNoMicroBatchIsLost) {
  const std::string run_dir = dir / "leave";
  const int steps = 300;
  noloco::testing::BackgroundCli runner(
      small_train_args(dir / "c.txt", run_dir) +
          fmt::format(" method=noloco replicas=2 stages=2 batch=2 grad_accum=2 steps={} outer_interval=5 "
                      "heartbeat_timeout=60 threads=1",
                      steps),
      240);
  ASSERT_TRUE(noloco::testing::wait_for_record(run_dir, "outer", 120));
  const pid_t leaver = noloco::testing::worker_of(run_dir, 3);
  ASSERT_GT(leaver, 0);
  ASSERT_EQ(::kill(leaver, SIGTERM), 0);
  const auto& r = runner.wait();
  ASSERT_EQ(r.exit_code, 0) << "shrunk on purpose, not degraded: " << r.output;
  EXPECT_EQ(r.output.find("lost pipeline worker"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2})) << summary.dump();
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  ASSERT_EQ(summary["replicas_left"].size(), 1u) << summary.dump();
  EXPECT_EQ(summary["replicas_left"][0]["worker"].get<int>(), 3);
  const auto left = read_json(run_dir + "/summary_r1_s1.json")["left_at_step"].get<int64_t>();
  EXPECT_LT(left, steps) << "it left before the end";
  for (int worker : {0, 1, 2}) {
    const auto w = read_json(fmt::format("{}/summary_r{}_s{}.json", run_dir, worker / 2, worker % 2));
    EXPECT_EQ(w["micro_batches_dropped"].get<int64_t>(), 0) << "worker " << worker;
    EXPECT_EQ(w["pipeline_peers_lost"].get<int64_t>(), 0) << "worker " << worker;
  }
  // Its last state is the checkpoint of the step it left at, and loads.
  const auto last = find_checkpoint(run_dir + "/checkpoints/r3");
  EXPECT_NE(last.find(fmt::format("step_{:08d}", left)), std::string::npos) << last;
  EXPECT_FALSE(load_tensors(last + "/model.safetensors").empty());
  // Replica 1's data still trains (its stage 0 lives on), through worker 1 alone after the leave.
  const auto trained = losses(run_dir, "train");
  EXPECT_EQ(trained.at(0).size(), size_t(steps));
  EXPECT_LE(trained.at(1).rbegin()->first, left + 2) << "the leaver computed no loss after its last listed step";
}

// Fixed routing has nowhere else to send a lost worker's micro-batches, and
// no routing goes around a stage that lost every worker.
TEST_F(Pipeline, FixedRoutingOrAWholeLostStageStopsWithAClearError) {
  const std::string common = "method=noloco replicas=2 stages=2 batch=2 steps=30 outer_interval=5";
  auto r = noloco::testing::run_cli(
      small_train_args(dir / "c.txt", dir / "fixed") + " " + common + " routing=fixed inject_crash=3:5", 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("worker 3 was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("with routing=fixed a pipeline has nowhere else to send"), std::string::npos) << r.output;
  r = noloco::testing::run_cli(
      small_train_args(dir / "c.txt", dir / "stage") + " " + common + " inject_crash=1:5,3:8", 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("pipeline stage 1 has no live worker left"), std::string::npos) << r.output;
}
