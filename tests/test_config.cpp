#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/options.h"
#include "config/run_layout.h"
#include "config/train_config.h"
#include "config/worker_env.h"
#include "optim/inner.h"
#include "util/error_text.h"
#include "util/parse_number.h"
#include "test_util.h"

using namespace noloco;

namespace {

std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides) {
  try {
    parse_config(yaml, overrides);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "invalid config accepted";
  return "";
}

}  // namespace

TEST(Config, YamlThenOverridesInOrder) {
  auto c = parse_config("steps: 300\nlr: 0.002\n", {"steps=400", "out=runs/x"});
  EXPECT_EQ(c.inner.steps, 400);
  EXPECT_DOUBLE_EQ(c.inner.lr, 0.002);
  EXPECT_EQ(c.run.out, "runs/x");
  EXPECT_EQ(c.inner.decay_steps, 400);  // resolved from steps
}

TEST(Config, PresetAppliesBeforeFieldOverridesWhereverWritten) {
  auto c = parse_config("layers: 3\nmodel: 125m\n", {});
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_EQ(c.model.hidden, 768);
}

TEST(Config, MethodDefaultsFromThePaper) {
  auto d = parse_config("", {"method=diloco", "replicas=4"});
  EXPECT_EQ(d.outer.interval, 100);
  EXPECT_DOUBLE_EQ(d.outer.momentum, 0.3);
  auto n = parse_config("", {"method=noloco", "replicas=4"});
  EXPECT_EQ(n.outer.interval, 50);
  EXPECT_DOUBLE_EQ(n.outer.momentum, 0.5);
  EXPECT_DOUBLE_EQ(n.outer.gamma, n.outer.lr);
  EXPECT_EQ(n.outer.message, NolocoMessage::theta);
  EXPECT_EQ(parse_config("", {"method=noloco", "replicas=4", "gamma=0.4"}).outer.message, NolocoMessage::delta_phi);
}

TEST(Config, ResolvedYamlParsesBackToTheSameConfig) {
  auto c = parse_config("", {"model=125m", "method=noloco", "replicas=8", "sample_prompt=ROMEO: x"});
  auto again = parse_config(c.to_yaml(), {});
  EXPECT_EQ(again.to_yaml(), c.to_yaml());
}

// Issue 100 item 10: a 10 MB value was echoed whole in its error line.
TEST(Config, AnErrorQuotingAHugeValueIsCutToOneShortLine) {
  const std::string huge(10 << 20, 'x');
  std::string line;
  try {
    parse_config("", {"steps=" + huge});
    ADD_FAILURE() << "invalid config accepted";
  } catch (const std::invalid_argument& e) {
    line = error_text(e);
  }
  EXPECT_EQ(line.rfind("steps", 0), 0u) << line.substr(0, 200);
  EXPECT_LE(line.size(), kErrorLineLength + 40);
  EXPECT_NE(line.find(" more characters)"), std::string::npos);
}

TEST(Config, UnknownKey) { EXPECT_NE(error_of("", {"learning_rate=1"}).find("unknown config key 'learning_rate'"), std::string::npos); }
TEST(Config, NegativeLearningRate) { EXPECT_NE(error_of("lr: -0.1\n", {}).find("lr must be >= 0"), std::string::npos); }

// Issue 103: lr=0 is a frozen run (a model's round trip checked through
// training), its schedule at 0 throughout.
TEST(Config, AZeroLearningRateFreezesTheRunSchedule) {
  const auto c = parse_config("data: x.txt\n", {"lr=0"});
  EXPECT_EQ(c.inner.lr, 0);
  EXPECT_EQ(c.inner.min_lr, 0);
  for (int64_t step : {int64_t(0), int64_t(1), c.inner.warmup, c.inner.steps / 2, c.inner.steps})
    EXPECT_EQ(learning_rate(c.inner, step), 0) << step;
}
TEST(Config, HeadsMustDivideHidden) { EXPECT_NE(error_of("", {"heads=5"}).find("must divide hidden"), std::string::npos); }
TEST(Config, NotANumber) { EXPECT_NE(error_of("", {"steps=ten"}).find("steps: 'ten' is not an integer"), std::string::npos); }
TEST(Config, TrailingGarbage) { EXPECT_NE(error_of("", {"lr=1e-3x"}).find("not a finite number"), std::string::npos); }
TEST(Config, BadEnum) { EXPECT_NE(error_of("", {"method=gossip"}).find("method must be"), std::string::npos); }
TEST(Config, SpreadIntervalIsAMultipleOfEvalInterval) {
  EXPECT_NE(error_of("", {"eval_interval=100", "spread_interval=250"})
                .find("spread_interval (250) must be a multiple of eval_interval (100)"),
            std::string::npos);
  EXPECT_EQ(parse_config("", {"eval_interval=100", "spread_interval=500"}).eval.spread_interval, 500);
}
TEST(Config, MinLrAboveLr) { EXPECT_NE(error_of("", {"min_lr=0.1"}).find("must not exceed"), std::string::npos); }
TEST(Config, OverrideWithoutEquals) { EXPECT_NE(error_of("", {"steps"}).find("not key=value"), std::string::npos); }
TEST(Config, YamlNotAMapping) { EXPECT_NE(error_of("- a\n- b\n", {}).find("expected a mapping"), std::string::npos); }
TEST(Config, YamlNestedValue) { EXPECT_NE(error_of("lr: [1, 2]\n", {}).find("single value"), std::string::npos); }
TEST(Config, BrokenYaml) { EXPECT_NE(error_of("lr: [1, 2\n", {}).find("not valid YAML"), std::string::npos); }
// Rotated activation codes need a power-of-two block; outer messages alone do not.
TEST(Config, RotatedActivationsNeedAPowerOfTwoBlock) {
  EXPECT_NE(error_of("", {"stages=2", "activation_codec=int4", "quant_block=96"})
                .find("activation_rotation needs quant_block a power of two, got 96"),
            std::string::npos);
  EXPECT_NO_THROW(parse_config("", {"stages=2", "activation_codec=int4", "quant_block=96", "activation_rotation=false"}));
  EXPECT_NO_THROW(parse_config("", {"stages=2", "activation_codec=bf16", "quant_block=96"}));
}

TEST(Config, ActivationSubspaceNeedsStagesAndFitsTheWidth) {
  EXPECT_NE(error_of("", {"activation_subspace=16"}).find("activation_subspace needs stages > 1"), std::string::npos);
  EXPECT_NE(error_of("", {"stages=2", "activation_subspace=129"}).find("activation_subspace must be in [0, hidden=128]"),
            std::string::npos);
  EXPECT_EQ(parse_config("", {"stages=2", "activation_subspace=16"}).pipeline.activation_subspace, 16);
  // The frozen part's scale follows the width unless given: min(1, hidden/2048).
  EXPECT_EQ(parse_config("", {"stages=2", "activation_subspace=16"}).pipeline.activation_subspace_token_std, 0.0625);
  EXPECT_EQ(parse_config("", {"stages=2", "activation_subspace=16", "hidden=512"}).pipeline.activation_subspace_token_std,
            0.25);
  EXPECT_EQ(parse_config("", {"stages=2", "activation_subspace=16", "hidden=4096"})
                .pipeline.activation_subspace_token_std,
            1.0);
  EXPECT_FALSE(parse_config("", {"stages=2"}).pipeline.activation_subspace_token_std);
  EXPECT_EQ(
      parse_config("", {"stages=2", "activation_subspace=16", "activation_subspace_token_std=0.3"})
          .pipeline.activation_subspace_token_std,
      0.3);
  EXPECT_NE(error_of("", {"stages=2", "activation_subspace_token_std=0.3"})
                .find("activation_subspace_token_std applies with activation_subspace > 0"),
            std::string::npos);
  EXPECT_NE(error_of("", {"stages=2", "activation_subspace=16", "activation_subspace_token_std=-1"})
                .find("activation_subspace_token_std must be >= 0, got -1"),
            std::string::npos);
  EXPECT_NE(error_of("", {"stages=2", "activation_subspace=16", "activation_subspace_token_std=nan"})
                .find("activation_subspace_token_std: 'nan' is not a finite number"),
            std::string::npos);
  EXPECT_EQ(parse_config("", {"stages=2"}).pipeline.activation_codec, CodecSpec::Type::int8) << "the default";
}
TEST(Config, MoreStagesThanLayers) { EXPECT_NE(error_of("layers: 2\n", {"stages=3"}).find("stages must be in [1, layers=2]"), std::string::npos); }
TEST(Config, StageLayersMustCoverTheModel) { EXPECT_NE(error_of("layers: 4\n", {"stages=2", "stage_layers=1,2"}).find("summing to layers=4"), std::string::npos); }
TEST(Config, RestartsOnlyForNoLoCo) { EXPECT_NE(error_of("", {"method=ddp", "restarts=1"}).find("restarts needs method=noloco"), std::string::npos); }
TEST(Config, PipelinedRestartsNeedRandomRouting) {
  const std::vector<std::string> base{"method=noloco", "restarts=1", "layers=2", "stages=2"};
  EXPECT_NO_THROW(parse_config("", base));
  auto fixed = base;
  fixed.push_back("routing=fixed");
  EXPECT_NE(error_of("", fixed).find("routing=random with pipeline stages"), std::string::npos) << error_of("", fixed);
}
TEST(Config, CrashPlanModes) {
  const auto plan = parse_crash_plan(parse_config("", {"inject_crash=1:5,2:6:checkpoint,3:7:freeze"}).run.inject_crash);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[1].mode, CrashPoint::Mode::kill_in_checkpoint);
  EXPECT_EQ(plan[2].mode, CrashPoint::Mode::freeze);
  EXPECT_NE(error_of("", {"inject_crash=1:2:nap"}).find("inject_crash must be"), std::string::npos);
  EXPECT_NE(error_of("", {"inject_crash=1:2:checkpoint:x"}).find("inject_crash must be"), std::string::npos);
}
TEST(Config, ThetaMessageNeedsGammaEqualToBeta) {
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "gamma=0.4", "noloco_message=theta"}).find("needs gamma = outer_lr"),
            std::string::npos);
  EXPECT_NE(error_of("", {"noloco_message=weights"}).find("noloco_message must be"), std::string::npos);
}
TEST(Config, BadRouting) { EXPECT_NE(error_of("", {"routing=roundrobin"}).find("routing must be random or fixed"), std::string::npos); }
TEST(Config, AnAdvertisedAddressNeedsAPort) {
  EXPECT_NE(error_of("", {"advertise=203.0.113.5"}).find("advertise=203.0.113.5 needs a port"), std::string::npos);
  EXPECT_NE(error_of("", {"advertise=203.0.113.5:0"}).find("advertise '203.0.113.5:0': no such port"), std::string::npos);
  EXPECT_NE(error_of("", {"listen_port=70000"}).find("listen_port must be in 0..65535"), std::string::npos);
  EXPECT_NO_THROW(parse_config("", {"advertise=203.0.113.5", "listen_port=29600"}));
  EXPECT_NO_THROW(parse_config("", {"advertise=203.0.113.5:40000"}));
}
// One reading of HOST:PORT for every address the program takes (issue 102).
TEST(Options, HostAndPortSplitAtTheLastColonAndABadPortIsNamed) {
  const auto both = parse_host_port("relay", "relay.example:3478");
  EXPECT_EQ(both.host, "relay.example");
  EXPECT_EQ(both.port, 3478);
  const auto host = parse_host_port("advertise", "203.0.113.5");
  EXPECT_EQ(host.host, "203.0.113.5");
  EXPECT_FALSE(host.port);
  EXPECT_EQ(parse_host_port("cluster entry", "10.0.0.1:65533", 65533).port, 65533);
  for (const std::string bad : {"h:0", "h:65536", "h:", "h:80x", "h:-1", "h:+80", "h:123456"})
    EXPECT_NE(noloco::testing::error_of([&] { parse_host_port("store", bad); }).find("store '" + bad + "': no such port"),
              std::string::npos)
        << bad;
  EXPECT_NE(noloco::testing::error_of([&] { parse_host_port("cluster entry", "h:65534", 65533); }).find("a port is 1..65533"),
            std::string::npos);
  EXPECT_NE(noloco::testing::error_of([&] { parse_host_port("relay", ":80"); }).find("relay ':80' is not host:port"), std::string::npos);
  EXPECT_NE(noloco::testing::error_of([&] { parse_host_port("relay", ""); }).find("is not host:port"), std::string::npos);
}
TEST(Config, AnUplinkIsARate) {
  EXPECT_NE(error_of("", {"uplink=fast"}).find("uplink: 'fast' is not a rate"), std::string::npos);
  EXPECT_NE(error_of("", {"uplink=20"}).find("uplink: '20' is not a rate"), std::string::npos);
  EXPECT_EQ(parse_config("", {"uplink=20mbit"}).comm.uplink, "20mbit");
  EXPECT_EQ(parse_config("", {"uplink=20mbit"}).run_yaml().find("uplink"), std::string::npos) << "a machine's own key";
}
TEST(Config, UnknownPreset) { EXPECT_NE(error_of("", {"model=7b"}).find("unknown model preset"), std::string::npos); }

TEST(Options, ParsesTypedValuesAndNamesBadKeys) {
  int64_t steps = 1;
  double rate = 0;
  bool flag = false;
  std::string name;
  Options o("test");
  o.add("steps", steps, "").add("rate", rate, "").add("flag", flag, "").add("name", name, "");
  const auto rest = o.parse_known({"steps=12", "other=1", "rate=2.5", "flag=on", "name=a=b", "positional"});
  EXPECT_EQ(steps, 12);
  EXPECT_DOUBLE_EQ(rate, 2.5);
  EXPECT_TRUE(flag);
  EXPECT_EQ(name, "a=b");  // everything after the first '='
  EXPECT_EQ(rest, (std::vector<std::string>{"other=1", "positional"}));
  EXPECT_EQ(o.get("steps"), "12");
  auto error = [&](const std::vector<std::string>& args) {
    try {
      o.parse(args);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error({"stepz=1"}).find("unknown test key 'stepz'"), std::string::npos);
  EXPECT_NE(error({"steps=1.5"}).find("steps: '1.5' is not an integer"), std::string::npos);
  EXPECT_NE(error({"flag=maybe"}).find("not a boolean"), std::string::npos);
  EXPECT_NE(error({"steps"}).find("is not key=value"), std::string::npos);
}

TEST(Config, DuplicateKeysAreRefused) {
  EXPECT_NE(error_of("lr: 0.1\nsteps: 3\nlr: 0.2\n", {}).find("key 'lr' appears twice"), std::string::npos);
}

TEST(Config, ShapeChecksOnceTheWorkerCountIsKnown) {
  auto c = parse_config("", {"method=noloco", "replicas=2", "group_size=3"});
  EXPECT_THROW(c.validate_workers(), std::invalid_argument);
  c = parse_config("", {"method=noloco", "replicas=2", "inject_crash=5:3"});
  try {
    c.validate_workers();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no worker 5"), std::string::npos);
  }
  const auto plan = parse_crash_plan("3:startup,1:startup:freeze");
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].mode, CrashPoint::Mode::startup);
  EXPECT_EQ(plan[1].mode, CrashPoint::Mode::freeze_at_startup);
  EXPECT_THROW(parse_crash_plan("1:startup:checkpoint"), std::invalid_argument);
}

TEST(Config, FragmentsAndOverlapOnlyWhereTheyMeanSomething) {
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "outer_interval=4", "fragments=5"})
                .find("fragments (5) must not exceed outer_interval (4)"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=ddp", "replicas=2", "overlap=true"}).find("apply to diloco and noloco"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "fragments=0"}).find("fragments must be >= 1"),
            std::string::npos);
  const auto c = parse_config("", {"method=noloco", "replicas=2", "fragments=4", "overlap=true"});
  EXPECT_EQ(c.outer.fragments, 4);  // within the default H = 50
  EXPECT_TRUE(c.outer.overlap);
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "eager=true"}).find("eager needs overlap=true"),
            std::string::npos);
  EXPECT_TRUE(parse_config("", {"method=diloco", "replicas=2", "overlap=true", "eager=true"}).outer.eager);
  EXPECT_NO_THROW(parse_config("", {"method=none", "replicas=4"})) << "independent replicas: the utilisation baseline";
}

TEST(Config, CompressionPresetSetsTheCodecKeysAndKeysGivenWithItOverrideIt) {
  const auto d = parse_config("fragments: 4\n", {"compression=sparse", "method=diloco"});
  EXPECT_EQ(d.outer.wire_dtype, CodecSpec::Type::int2);
  EXPECT_EQ(d.outer.diloco_mean, DilocoMean::reduce_scatter);
  EXPECT_EQ(d.outer.topk, 0.0);
  EXPECT_EQ(d.outer.interval, 80);
  EXPECT_EQ(d.outer.fragments, 4) << "the key given with the preset wins, wherever written";
  const auto n = parse_config("", {"method=noloco", "compression=sparse"});
  EXPECT_EQ(n.outer.wire_dtype, CodecSpec::Type::int2);
  EXPECT_EQ(n.outer.message, NolocoMessage::delta_phi);
  EXPECT_EQ(n.outer.phi_coding, PhiCoding::coset);
  EXPECT_EQ(n.outer.phi_every, 2);
  EXPECT_EQ(n.outer.interval / n.outer.fragments, 10) << "an outer step every 10 steps";
  // compression=topk (issue 47): SparseLoCo's message.
  const auto td = parse_config("outer_interval: 30\n", {"compression=topk", "method=diloco"});
  EXPECT_EQ(td.outer.wire_dtype, CodecSpec::Type::bins2);
  EXPECT_EQ(td.outer.topk, 64.0 / 4096);
  EXPECT_EQ(td.outer.diloco_mean, DilocoMean::all_gather);
  EXPECT_EQ(td.outer.residual, ResidualHome::weights);
  EXPECT_TRUE(td.outer.error_feedback);
  EXPECT_EQ(td.outer.interval, 30) << "the key given with the preset wins, wherever written";
  EXPECT_EQ(parse_config("", {"compression=topk", "method=diloco"}).outer.interval, 100);
  const auto tn = parse_config("", {"method=noloco", "compression=topk"});
  EXPECT_EQ(tn.outer.wire_dtype, CodecSpec::Type::bins2);
  EXPECT_EQ(tn.outer.topk, 64.0 / 4096);
  EXPECT_EQ(tn.outer.message, NolocoMessage::delta_phi);
  EXPECT_EQ(tn.outer.residual, ResidualHome::weights);
  EXPECT_EQ(tn.outer.phi_every, 0) << "no slow weights travel";
  EXPECT_EQ(tn.outer.interval, 50);
  EXPECT_EQ(tn.outer.fragments, 1);
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "phi_every=-1"}).find("phi_every must be >= 0"),
            std::string::npos);
  const auto none = parse_config("", {"method=diloco", "compression=none"});
  EXPECT_EQ(none.outer.wire_dtype, CodecSpec::Type::fp32);
  EXPECT_EQ(none.outer.topk, 0.0);
  EXPECT_EQ(none.outer.diloco_mean, DilocoMean::reduce_scatter) << "today's compressed DiLoCo";
  EXPECT_NE(error_of("", {"compression=sparse"}).find("compression=sparse applies to diloco and noloco"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=diloco", "wire_dtype=int4", "residual=weights"}).find("residual=weights needs"),
            std::string::npos)
      << "reduce_scatter has no leftover of its own to keep";
  EXPECT_NE(error_of("", {"method=diloco", "error_feedback_decay=0"}).find("error_feedback_decay must be in (0, 1]"),
            std::string::npos);
}

// message_rank (issue 47): Δ's matrices as factors.
TEST(Config, LowRankMessagesNeedTheirOwnDeltaWhole) {
  const auto d = parse_config("", {"method=diloco", "wire_dtype=int8", "message_rank=2", "residual=weights"});
  EXPECT_EQ(d.outer.message_rank, 2);
  EXPECT_EQ(d.outer.diloco_mean, DilocoMean::all_gather) << "resolved from auto: a shard has no factors";
  EXPECT_EQ(parse_config("", {"method=diloco", "wire_dtype=int8"}).outer.diloco_mean, DilocoMean::reduce_scatter);
  EXPECT_EQ(parse_config("", {"method=noloco", "message_rank=2"}).outer.message, NolocoMessage::delta_phi)
      << "fp32 factors are still not theta";
  EXPECT_NE(error_of("", {"method=noloco", "message_rank=-1"}).find("message_rank must be >= 0"), std::string::npos);
  EXPECT_NE(error_of("", {"method=noloco", "message_rank=2", "topk=0.1"}).find("set one of them to 0"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=ddp", "message_rank=2"}).find("ddp all-reduces fp32 gradients"), std::string::npos);
  EXPECT_NE(error_of("", {"method=noloco", "message_rank=2", "noloco_message=theta"})
                .find("message_rank needs noloco_message=delta_phi"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=diloco", "message_rank=2", "diloco_mean=reduce_scatter"})
                .find("message_rank needs diloco_mean=all_gather"),
            std::string::npos);
}

// device=cuda is the GPU of the worker's local rank; cpu and cuda:N stay as written.
TEST(WorkerDevice, CudaIsTheLocalRanksOwnGpu) {
  EXPECT_EQ(worker_device("cuda", 0, 8), "cuda:0");
  EXPECT_EQ(worker_device("cuda", 7, 8), "cuda:7");
  EXPECT_EQ(worker_device("cuda:0", 5, 1), "cuda:0");
  EXPECT_EQ(worker_device("cpu", 3, 0), "cpu");
}

TEST(WorkerDevice, MoreLocalRanksThanGpusIsRefusedInOneLine) {
  try {
    worker_device("cuda", 2, 2);
    ADD_FAILURE() << "a third local rank on two GPUs was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("local rank 2 has none (2 CUDA devices here)"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos);
  }
  EXPECT_THROW(worker_device("cuda", 0, 0), std::invalid_argument);
}

// The environment a test sets, restored after it.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, std::string>> vars) {
    for (auto& [name, value] : vars) {
      const char* was = std::getenv(name.c_str());
      saved_.emplace_back(name, was ? std::optional<std::string>(was) : std::nullopt);
      if (value.empty())
        ::unsetenv(name.c_str());
      else
        ::setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (auto& [name, was] : saved_)
      if (was)
        ::setenv(name.c_str(), was->c_str(), 1);
      else
        ::unsetenv(name.c_str());
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// NOLOCO_STORE=tcp://host:port names a c10d TCPStore (torchrun's agent's):
// the worker then connects to it as to its agent's store.
TEST(WorkerEnv, TcpStoreIsAnAgentStoreAtThatAddress) {
  const ScopedEnv env({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"NOLOCO_RUN_TOKEN", "t"},
                       {"NOLOCO_STORE", "tcp://10.0.0.7:29511"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
  WorkerEnv w;
  ASSERT_TRUE(worker_env_from_environment(w));
  EXPECT_TRUE(w.agent_store);
  EXPECT_TRUE(w.store_url.empty());
  EXPECT_EQ(w.master_addr, "10.0.0.7");
  EXPECT_EQ(w.master_port, 29511);
}

// A joiner: no RANK (the store gives its id), WORLD_SIZE the run's replicas
// at start, the store named; each missing or malformed piece is one line.
TEST(WorkerEnv, JoinerNeedsTheStoreTheWorldAndNoRank) {
  {
    const ScopedEnv env({{"RANK", ""}, {"NOLOCO_STORE", ""}});
    WorkerEnv w;
    EXPECT_FALSE(joiner_env_from_environment(w));
  }
  {
    const ScopedEnv env({{"RANK", ""}, {"WORLD_SIZE", "3"}, {"NOLOCO_RUN_TOKEN", "t"},
                         {"NOLOCO_STORE", "unix:///tmp/x.sock"}});
    WorkerEnv w;
    ASSERT_TRUE(joiner_env_from_environment(w));
    EXPECT_EQ(w.world, 3);
    EXPECT_EQ(w.store_url, "unix:///tmp/x.sock");
    EXPECT_TRUE(w.agent_store) << "a joiner never hosts the run's store";
  }
  const std::vector<std::pair<std::vector<std::pair<std::string, std::string>>, std::string>> refused = {
      {{{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"NOLOCO_RUN_TOKEN", "t"}, {"NOLOCO_STORE", "tcp://h:1"}}, "RANK is set"},
      {{{"RANK", ""}, {"WORLD_SIZE", ""}, {"NOLOCO_RUN_TOKEN", "t"}, {"NOLOCO_STORE", "tcp://h:1"}},
       "WORLD_SIZE is not set"},
      {{{"RANK", ""}, {"WORLD_SIZE", "3"}, {"NOLOCO_RUN_TOKEN", ""}, {"NOLOCO_STORE", "tcp://h:1"}},
       "NOLOCO_RUN_TOKEN is not set"},
      {{{"RANK", ""}, {"WORLD_SIZE", "3"}, {"NOLOCO_RUN_TOKEN", "t"}, {"NOLOCO_STORE", "tcp://h:99999"}},
       "no such port"},
      {{{"RANK", ""}, {"WORLD_SIZE", "3"}, {"NOLOCO_RUN_TOKEN", "t"}, {"NOLOCO_STORE", "ftp://h:1"}},
       "is not an etcd endpoint"},
  };
  for (const auto& [vars, expected] : refused) {
    const ScopedEnv env(vars);
    WorkerEnv w;
    try {
      joiner_env_from_environment(w);
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

// Issue 82: one layout of ranks. Every rank decodes to a place that encodes
// back to it, ranks go replica by replica, a replica's speaker is its first
// worker at each stage, and units number one copy of one stage.
TEST(RunLayout, EveryRankIsOnePlaceAndBack) {
  for (const auto& [stages, replica_workers] : {std::pair{1, 1}, std::pair{3, 1}, std::pair{1, 4}}) {
    const RunLayout layout(stages, replica_workers, 5);
    EXPECT_EQ(layout.world(), 5 * stages * replica_workers);
    std::vector<int> units;
    for (int rank = 0; rank < layout.world() + 2 * layout.workers_per_replica(); ++rank) {  // joiners beyond the world
      const auto p = layout.place(rank);
      EXPECT_EQ(layout.rank(p), rank);
      EXPECT_EQ(p.replica, rank / (stages * replica_workers));
      EXPECT_LT(p.stage, stages);
      EXPECT_LT(p.replica_worker, replica_workers);
      EXPECT_EQ(layout.speaker_of(rank), layout.rank({p.replica, 0, p.stage}));
      const int unit = layout.unit_of(rank);
      EXPECT_EQ(unit, p.replica * stages + p.stage);
      const auto together = layout.ranks_of_unit(unit);
      EXPECT_EQ(int(together.size()), replica_workers);
      EXPECT_NE(std::find(together.begin(), together.end(), rank), together.end());
      if (stages == 1) EXPECT_EQ(layout.data_stream_of(rank), rank) << "a whole model's worker reads its rank's rows";
    }
  }
  // A pipeline's worker of (replica 2, stage 1) of 3 stages; a replica of 4 workers' second.
  EXPECT_EQ(RunLayout(3, 1).rank({2, 0, 1}), 7);
  EXPECT_EQ(RunLayout(1, 4).rank({2, 1, 0}), 9);
}

TEST(RunLayout, StagesWithSeveralWorkersAReplicaAreRefusedInOnePlace) {
  try {
    RunLayout(2, 2);
    FAIL() << "stages=2 with replica_workers=2 was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("replica_workers > 1 with pipeline stages is not implemented"),
              std::string::npos);
  }
  EXPECT_THROW(RunLayout(0, 1), std::invalid_argument);
}

TEST(Config, SlowdownIsOneFactorOrOneAReplica) {
  EXPECT_EQ(slowdown_of("", 3), 1.0);
  EXPECT_EQ(slowdown_of("3", 5), 3.0);
  EXPECT_EQ(slowdown_of("6:3,7:2.5", 7), 2.5);
  EXPECT_EQ(slowdown_of("6:3,7:2.5", 6), 3.0);
  EXPECT_EQ(slowdown_of("6:3,7:2.5", 1), 1.0);
  EXPECT_NE(error_of("", {"slowdown=0.5"}).find("slowdown factors must be in [1, 1000], got 0.5"), std::string::npos);
  EXPECT_NE(error_of("", {"slowdown=6:3,7"}).find("slowdown: '7' is not REPLICA:FACTOR"), std::string::npos);
  EXPECT_NE(error_of("", {"slowdown=x:3"}).find("slowdown: 'x' is not an integer"), std::string::npos);
  EXPECT_NE(error_of("", {"slowdown=-1:3"}).find("replica -1 is negative"), std::string::npos);
  // A machine's own key, like threads: a joiner need not match the run's.
  const auto& own = machine_keys();
  EXPECT_NE(std::find(own.begin(), own.end(), "slowdown"), own.end());
}

TEST(Config, PaceBySpeedIsForDiLoCoAndNoLoCoWithoutPipelineStages) {
  EXPECT_NE(error_of("", {"method=ddp", "pace=speed"}).find("pace=speed applies to diloco and noloco"),
            std::string::npos);
  EXPECT_NE(error_of("", {"method=noloco", "replicas=2", "stages=2", "pace=speed"}).find("pace=speed needs stages=1"),
            std::string::npos);
  EXPECT_EQ(parse_config("", {"method=noloco", "replicas=2", "pace=speed"}).outer.pace, PaceMode::speed);
  EXPECT_EQ(parse_config("", {"method=diloco", "replicas=2", "replica_workers=2", "pace=speed"}).outer.pace,
            PaceMode::speed);
}
