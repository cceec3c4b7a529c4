#include "train/run_end.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/membership/membership.h"
#include "config/run_layout.h"
#include "config/train_config.h"
#include "config/worker_env.h"
#include "pipeline/activation_channel.h"
#include "train/worker_life.h"
#include "util/files.h"
#include "util/leave_signal.h"
#include "util/log.h"
#include "util/run_files.h"

namespace noloco {

RunSummary summarize_run(const TrainConfig& cfg, const std::vector<WorkerExit>& members, double seconds) {
  const int64_t stages = cfg.pipeline.stages;
  auto summary = summarize_run(cfg.run.out, cfg.outer.method, cfg.run.replicas, stages, choice_name(cfg.pipeline.routing),
                               cfg.inner.grad_accum, members, seconds, cfg.run.replica_workers);
  summary.activation_codec = choice_name(cfg.pipeline.activation_codec);
  summary.activation_grad_codec = choice_name(cfg.pipeline.activation_grad_codec);
  const auto codecs = activation_codecs(cfg);  // rotation applies to integer codes only
  summary.activation_rotation = codecs.activations.rotate || codecs.gradients.rotate;
  summary.activation_subspace = cfg.pipeline.activation_subspace;
  if (stages > 1) {  // over the hidden-state values a step's boundaries carry, both directions
    const double boundary_values = double(cfg.run.replicas * (stages - 1) * 2 * cfg.inner.grad_accum *
                                          cfg.inner.batch * cfg.model.context * cfg.model.hidden);
    summary.activation_bits_per_value = summary.activation_bytes_per_step * 8 / boundary_values;
  }
  return summary;
}

void warn_if_mostly_alone(const RunSummary& summary) {
  if (const auto lone = summary.outer_steps_alone_without_store.value_or(0.0); lone > 0)
    spdlog::warn("a replica took {:.0f} outer steps alone while the run's store did not answer; see summary.json "
                 "(outer_steps_alone_without_store)",
                 lone);
  if (summary.replicas_mostly_alone.empty()) return;
  spdlog::warn("{} {} exchanged with no partner at more than {:.0f}% of {} outer steps (worst: paired at {:.0f}%, "
               "{:.0f} outer steps alone in a row): the replicas drifted apart; see summary.json",
               summary.stages > 1 ? "workers" : "replicas", fmt::join(summary.replicas_mostly_alone, ", "),
               100 * kMostlyAlone, summary.replicas_mostly_alone.size() > 1 ? "their" : "its",
               100 * summary.paired_fraction_worst.value_or(0.0), summary.longest_alone_outer_steps.value_or(0.0));
}

// Our launcher writes its run's summary itself.
bool writes_run_summary(const WorkerEnv& env) { return env.rank == 0 && !launched_by_noloco(env); }

void save_run_summary(const TrainConfig& cfg, const RunSummary& summary) {
  // A resume that every worker refused leaves the summary of the run it resumed.
  if (summary.finished.empty() && cfg.run.resume && file_exists(run_files::in(cfg.run.out, run_files::kSummary))) return;
  write_json_atomic(run_files::in(cfg.run.out, run_files::kSummary), summary.to_json());
}

namespace {

// The run's store stayed away: the summary of the members whose summaries
// are on this disk; the others (and joiners, which only the store lists) are
// named as not heard from. Worker 0 writes it; every other worker sharing
// its disk that ends later writes it again, with its own summary on the
// disk by then. Under a lock on the run directory, so that of two workers
// ending at once, the one that writes last has read both summaries.
void write_run_summary_without_store(const TrainConfig& cfg, const WorkerEnv& env, double seconds) {
  const int dir = ::open(cfg.run.out.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", cfg.run.out, std::strerror(errno)));
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // closing releases the lock
  } unlock{dir};
  if (::flock(dir, LOCK_EX) != 0)
    throw std::runtime_error(fmt::format("cannot lock {}: {}", cfg.run.out, std::strerror(errno)));
  if (!writes_run_summary(env) && !file_exists(run_files::in(cfg.run.out, run_files::kSummary))) return;  // worker 0's to write
  const auto layout = run_layout(cfg);
  std::vector<WorkerExit> members;
  for (int stage = 0; stage < int(cfg.pipeline.stages); ++stage)
    for (int member = 0; member < int(cfg.run.replicas); ++member) {
      WorkerExit e;
      e.rank = layout.speaker(member, stage);
      if (!file_exists(worker_summary_path(cfg.run.out, layout, e.rank))) {
        e.exit_code = 1;
        e.why = "not heard from: the run's store is gone";
      }
      members.push_back(e);
    }
  const auto summary = summarize_run(cfg, members, seconds);
  save_run_summary(cfg, summary);
  spdlog::info("the run's summary, from this disk alone (the store is gone): {} of {} finished -> {}/summary.json",
               summary.finished.size(), members.size(), cfg.run.out);
}

}  // namespace

void write_run_summary(const TrainConfig& cfg, const Worker& worker, const nlohmann::json& own_summary,
                       double seconds) {
  const auto& env = worker.env;
  const auto& store = worker.links.store;
  if (!store) {  // a world of one: its own summary is the run's
    save_run_summary(cfg, summarize_lone_run(WorkerSummary::from_json(own_summary)));
    return;
  }
  if (!worker.membership()) return;  // no members to hear from (method none)
  if (own_summary.contains("store_gone")) return write_run_summary_without_store(cfg, env, seconds);
  if (!writes_run_summary(env)) return;
  const int stages = int(cfg.pipeline.stages);
  const int replicas = int(cfg.run.replicas);  // the launched workers' (run_worker set it from WORLD_SIZE)
  HeartbeatWatch heartbeats(store, env.token);
  auto& own = *worker.membership();  // has watched its own scope's heartbeats all along
  const auto layout = run_layout(cfg);
  const auto own_scope = record::replica_group(stages, layout.stage_of(env.rank));
  std::vector<WorkerExit> members;
  bool told = false;
  for (int stage = 0; stage < stages; ++stage) {
    const auto scope = record::replica_group(stages, stage);
    std::vector<int> ids(size_t(replicas), 0);
    for (int m = 0; m < replicas; ++m) ids[size_t(m)] = m;
    for (const int m : joined_members(store, env.token, scope)) ids.push_back(m);
    for (const int member : ids) {
      WorkerExit e;
      e.rank = layout.speaker(member, stage);
      e.joined = member >= replicas;
      if (!told && member_state(store, env.token, scope, member) != MemberState::finished) {
        spdlog::info("waiting for the other workers to finish: this worker writes the run's summary.json");
        told = true;
      }
      heartbeats.expect(e.rank);
      const auto given_up = [&]() -> std::optional<std::string> {
        if (leave_requested()) return "still training when worker 0 was asked to leave (SIGTERM)";
        if (scope == own_scope && own.silent(member))
          return fmt::format("no heartbeat for {:.0f} s", cfg.comm.heartbeat_timeout);
        return std::nullopt;
      };
      if (const auto why = await_member_end(store, env.token, scope, member, e.rank, heartbeats,
                                            cfg.comm.heartbeat_timeout, given_up)) {
        e.exit_code = 1;
        e.why = *why;
      }
      // Its own worker wrote it where it ran: here too (the same bytes, if this disk is that one).
      const auto text = member_summary(store, env.token, scope, member);
      if (!text.empty()) write_file_atomic(worker_summary_path(cfg.run.out, layout, e.rank), text);
      members.push_back(e);
    }
  }
  const auto summary = summarize_run(cfg, members, seconds);
  save_run_summary(cfg, summary);
  spdlog::info("the run's summary: {} of {} {} finished{} -> {}/summary.json", summary.finished.size(),
               members.size(), stages > 1 ? "workers" : "replicas",
               summary.failed.empty() ? "" : fmt::format(" ({} failed)", summary.failed.size()), cfg.run.out);
  warn_if_mostly_alone(summary);
}

}  // namespace noloco
