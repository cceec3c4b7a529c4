#include "python/user_loop_replica.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "comm/launch/launcher.h"
#include "comm/store/store.h"
#include "config/worker_env.h"
#include "optim/pace.h"
#include "train/run_summary.h"
#include "train/worker_entry.h"
#include "util/crc32c.h"
#include "util/log.h"
#include "util/run_files.h"

namespace noloco {

namespace {

TrainConfig outer_config(const std::vector<std::string>& keys) {
  const auto allowed = outer_method_keys();
  for (const auto& k : keys) {
    const auto name = k.substr(0, k.find('='));
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
      throw std::invalid_argument(fmt::format(
          "{} is not a key of the outer optimizer (the model, data and inner optimizer are your loop's); it takes: {}",
          name, fmt::join(allowed, ", ")));
  }
  // Before parse_config, whose refusal of an unknown method lists none and ddp, which a user loop can't run.
  for (const auto& k : keys)
    if (k.rfind("method=", 0) == 0 && k != "method=noloco" && k != "method=diloco")
      throw std::invalid_argument(fmt::format("{}: the outer optimizer is noloco or diloco", k));
  auto config = parse_config("", keys, "OuterOptimizer");
  if (config.outer.method != Method::noloco && config.outer.method != Method::diloco)
    throw std::invalid_argument(
        fmt::format("method={}: the outer optimizer is noloco or diloco", choice_name(config.outer.method)));
  return config;
}

// A replica whose state nobody hands on: a joiner's optimizer starts afresh.
class NoInnerState final : public InnerState {
 public:
  void save(TensorMap&) const override {}
  void load(const TensorMap&, int64_t) override {}
  int64_t steps_taken() const override { return 0; }
};

// A joiner's place: claimed from the run's store, numbered on from the
// replicas the run started with.
WorkerEnv joiner_env(const UserLoopStart& start, const TrainConfig& config) {
  if (!takes_joiners(config.outer.method, Routing::fixed, 1))
    throw std::invalid_argument(fmt::format("join: a {} run takes no joiners (its groups are fixed); only a noloco run does",
                                            choice_name(config.outer.method)));
  WorkerEnv env;
  if (start.join_dir.empty()) {
    if (!joiner_env_from_environment(env))
      throw std::invalid_argument(
          "join: NOLOCO_STORE is not set: name the run's store (tcp://host:port for torchrun's, the URL `noloco "
          "launch` gives), with WORLD_SIZE and NOLOCO_RUN_TOKEN; or give join=DIR (noloco launch --join-dir DIR)");
  } else {
    const auto invitation = read_join_invitation(start.join_dir, "join");
    env.store_url = invitation.store;
    env.world = invitation.workers;
    env.token = run_token_of(run_files::in(start.join_dir, run_files::kRunToken), "join");
    env.agent_store = true;
  }
  pin_hosted_store_key(env);
  int64_t stage = 0;
  env.rank = claim_joiner_member(env, config, env.world, 1, stage);
  return env;
}

WorkerEnv launched_env(TrainConfig& config, const UserLoopStart& start) {
  WorkerEnv env;
  if (start.join) {
    env = joiner_env(start, config);
  } else if (!worker_env_from_environment(env)) {
    throw std::invalid_argument(
        "RANK is not set: start the replicas with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and "
        "NOLOCO_RUN_TOKEN for each), or join a running run with join=True");
  }
  if (start.store_at_master && env.store_url.empty()) env.agent_store = true;
  config.run.replicas = env.world;
  config.validate();
  config.validate_workers();
  return env;
}

// What every replica's module must share for their messages to line up: the
// parameters' names, shapes and types, as a count and a checksum a refusal can name.
std::string user_model_line(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  std::string layout;
  int64_t numel = 0;
  for (const auto& [name, t] : params) {
    layout += fmt::format("{}:{}:{};", name, fmt::join(t.sizes(), "x"), std::string(c10::toString(t.scalar_type())));
    numel += t.numel();
  }
  return fmt::format("{} parameters in {} tensors (layout {:08x})", numel, params.size(), crc32c(layout));
}

}  // namespace

UserLoopReplica::UserLoopReplica(std::vector<std::pair<std::string, torch::Tensor>> params,
                                 const std::vector<std::string>& keys, const UserLoopStart& start,
                                 std::unique_ptr<InnerState> inner)
    : config_(outer_config(keys)),
      worker_(start_worker(config_, {launched_env(config_, start), start.join, "replica", user_model_line(params)})),
      flat_(std::move(params)),
      inner_(inner ? std::move(inner) : std::make_unique<NoInnerState>()),
      outer_(make_outer_optimizer(config_.outer, config_.run.seed,
                                  {worker_.transport(), worker_.membership()}, flat_)),
      drill_(config_.run.inject_crash, worker_.rank(), worker_.membership()->incarnation()),
      // The user's loop owns its end: a silent store leaves it training alone.
      life_(config_, worker_, flat_, *outer_, {flat_, *inner_, *outer_}, drill_, std::nullopt) {
  if ((rejoined_ = life_.start())) {
    first_step_ = inner_steps_ = rejoined_->step;
    spdlog::info("replica {} took replica {}'s state at step {} in {:.1f}s", worker_.rank(), rejoined_->donor,
                 rejoined_->step, rejoined_->seconds);
    publish(rejoined_->joined ? "join" : "rejoin", {{"donor", rejoined_->donor}});
  }
  if (worker_.status()) worker_.status()->set_state(record::WorkerState::training);
}

void UserLoopReplica::publish(const char* split, nlohmann::json fields) const {
  if (!worker_.status()) return;
  fields.update({{"split", split}, {"step", inner_steps_}});
  WorkerTraffic counted;
  counted.replica = worker_.rank();
  counted.comm = traffic();
  counted.add_to(fields);
  worker_.status()->record(fields);
}

void UserLoopReplica::end_status(record::WorkerState state) const {
  if (!worker_.status()) return;
  worker_.status()->set_state(state);
  worker_.status()->flush();  // before the membership ends: the store may go then
}

void UserLoopReplica::report(double loss, double val_loss) {
  if (!std::isnan(loss)) publish("train", {{"loss", loss}});
  if (!std::isnan(val_loss)) publish("val", {{"loss", val_loss}});
}

UserLoopReplica::~UserLoopReplica() {
  try {
    finish();
  } catch (const std::exception&) {
    // Destroyed while failing: the partners give this replica up by its silence.
  }
}

std::vector<UserOuterStep> UserLoopReplica::reported(std::vector<OuterSync> syncs) {
  std::vector<UserOuterStep> steps;
  for (auto& sync : syncs) {
    UserOuterStep s;
    for (int member : sync.group)
      if (std::find(sync.arrived.begin(), sync.arrived.end(), member) == sync.arrived.end()) s.lost.push_back(member);
    ++outer_steps_;
    outer_bytes_ += sync.bytes;
    publish("outer", {{"outer_step", sync.outer_step}, {"group", sync.group}});
    s.sync = std::move(sync);
    steps.push_back(std::move(s));
  }
  return steps;
}

bool UserLoopReplica::trains_now() {
  if (!outer_->pace()) return true;
  if (asked_for_ == inner_steps_) return trains_;
  trains_ = outer_->trains_at(inner_steps_);
  asked_for_ = inner_steps_;
  asked_at_ = std::chrono::steady_clock::now();
  return trains_;
}

std::vector<UserOuterStep> UserLoopReplica::step() {
  if (finished_) throw std::logic_error("step() after the replica finished or left the run");
  if (Pace* const pace = outer_->pace()) {
    if (asked_for_ != inner_steps_)
      throw std::logic_error("pace=speed: ask trains_now() before each step() (whether this replica trains the slot)");
    if (trains_)
      pace->step_took(std::chrono::duration<double>(std::chrono::steady_clock::now() - asked_at_).count());
  }
  auto after = life_.after_inner_step(++inner_steps_, /*last=*/false);
  auto steps = reported(std::move(after.syncs));
  if (!steps.empty()) steps.back().handed_over_to = after.handovers.served;
  if (after.renewed) {
    spdlog::info("replica {} took replica {}'s state at step {} in {:.1f}s after a partner refused it as diverged",
                 worker_.rank(), after.renewed->donor, after.renewed->step, after.renewed->seconds);
    inner_steps_ = after.renewed->step;
  }
  if (after.next == LifeAction::leave) {
    spdlog::info("replica {} leaves the run after step {} (SIGTERM)", worker_.rank(), inner_steps_);
    for (auto& s : leave()) steps.push_back(std::move(s));
    return steps;
  }
  life_.before_step(inner_steps_);
  return steps;
}

std::vector<UserOuterStep> UserLoopReplica::finish() {
  if (finished_) return {};
  finished_ = true;
  auto steps = reported(outer_->finish(flat_));
  end_status(record::WorkerState::finished);
  life_.end_membership("");  // a Python replica writes no summary
  finish_worker(worker_);
  return steps;
}

std::vector<UserOuterStep> UserLoopReplica::leave() {
  if (finished_) return {};
  finished_ = left_ = true;
  auto steps = reported(life_.leave());
  end_status(record::WorkerState::left);
  life_.end_membership("");  // no summary to write first, as the CLI's workers have
  finish_worker(worker_);
  return steps;
}

TensorMap UserLoopReplica::state() const {
  TensorMap state;
  outer_->save(state);
  state["inner_steps"] = torch::tensor(inner_steps_, torch::kInt64);
  return state;
}

void UserLoopReplica::load_state(const TensorMap& state) {
  const auto steps = state.find("inner_steps");
  if (steps == state.end() || steps->second.numel() != 1)
    throw std::invalid_argument("load_state_dict: the state holds no inner_steps (not an OuterOptimizer's state_dict)");
  outer_->load(state);
  first_step_ = inner_steps_ = steps->second.item<int64_t>();
}

CommStats UserLoopReplica::traffic() const { return worker_.transport()->stats(); }

double UserLoopReplica::bits_per_param_per_inner_step() const {
  const int64_t steps = inner_steps_ - first_step_;
  return steps > 0 ? 8.0 * double(outer_bytes_) / double(flat_.numel()) / double(steps) : 0.0;
}

}  // namespace noloco
