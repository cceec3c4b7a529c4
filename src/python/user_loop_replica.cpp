#include "python/user_loop_replica.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "config/worker_env.h"
#include "util/leave_signal.h"
#include "util/log.h"

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
  auto config = parse_config("", keys, "OuterOptimizer");
  if (config.outer.method != Method::noloco && config.outer.method != Method::diloco)
    throw std::invalid_argument(
        fmt::format("method={}: the outer optimizer is noloco or diloco", choice_name(config.outer.method)));
  return config;
}

WorkerEnv launched_env(TrainConfig& config, bool store_at_master) {
  WorkerEnv env;
  if (!worker_env_from_environment(env))
    throw std::invalid_argument(
        "RANK is not set: start the replicas with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and "
        "NOLOCO_RUN_TOKEN for each)");
  if (store_at_master && env.store_url.empty()) env.agent_store = true;
  config.run.replicas = env.world;
  config.validate();
  config.validate_workers();
  return env;
}

// Joins the run as the CLI's launched workers do, after the startup drill.
WorkerConnections joined(const WorkerEnv& env, const TrainConfig& config) {
  init_logging(fmt::format("noloco[replica {}]", env.rank));
  if (env.restart == 0) FailureDrill(config.run.inject_crash, env.rank, 0).at_startup();
  return join_as_worker(env, config.comm, 1, true);
}

}  // namespace

UserLoopReplica::UserLoopReplica(std::vector<std::pair<std::string, torch::Tensor>> params,
                                 const std::vector<std::string>& keys, bool store_at_master)
    : config_(outer_config(keys)),
      env_(launched_env(config_, store_at_master)),
      links_(joined(env_, config_)),
      flat_(std::move(params)),
      outer_(make_outer_optimizer(config_.outer, config_.run.seed, {links_.transport.get(), links_.membership.get()},
                                  flat_)),
      drill_(config_.run.inject_crash, env_.rank, links_.membership->incarnation()) {
  if (links_.membership->incarnation() > 0 || links_.membership->joining())
    throw std::runtime_error(fmt::format(
        "replica {} was restarted or joined a running run: taking a live replica's state is not offered through "
        "the Python module; start the run again",
        env_.rank));
  if (config_.outer.method == Method::noloco) leave_on_sigterm();
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
    s.sync = std::move(sync);
    steps.push_back(std::move(s));
  }
  return steps;
}

std::vector<UserOuterStep> UserLoopReplica::step() {
  if (finished_) throw std::logic_error("step() after the replica finished or left the run");
  links_.membership->progressed();
  std::vector<OuterSync> syncs;
  if (auto sync = outer_->after_inner_step(inner_steps_, flat_)) syncs.push_back(std::move(*sync));
  ++inner_steps_;
  auto steps = reported(std::move(syncs));
  if (leave_requested()) {
    spdlog::info("replica {} leaves the run after step {} (SIGTERM)", env_.rank, inner_steps_);
    for (auto& s : leave()) steps.push_back(std::move(s));
    return steps;
  }
  drill_.before_step(inner_steps_);
  if (drill_.corrupts_before(inner_steps_)) links_.transport->corrupt_next_message();
  return steps;
}

std::vector<UserOuterStep> UserLoopReplica::finish() {
  if (finished_) return {};
  finished_ = true;
  auto steps = reported(outer_->finish(flat_));
  links_.membership->finish();
  outlast_store_users(links_);
  return steps;
}

std::vector<UserOuterStep> UserLoopReplica::leave() {
  if (finished_) return {};
  finished_ = left_ = true;
  auto steps = reported(outer_->finish(flat_));
  links_.membership->leave();
  links_.membership->finish();  // no summary to write first, as the CLI's workers have
  outlast_store_users(links_);
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

CommStats UserLoopReplica::traffic() const { return links_.transport->stats(); }

double UserLoopReplica::bits_per_param_per_inner_step() const {
  const int64_t steps = inner_steps_ - first_step_;
  return steps > 0 ? 8.0 * double(outer_bytes_) / double(flat_.numel()) / double(steps) : 0.0;
}

}  // namespace noloco
