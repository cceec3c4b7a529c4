#include "cli/join_command.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "config/options.h"
#include "config/train_config.h"
#include "train/worker_entry.h"
#include "util/human.h"
#include "util/run_files.h"

namespace noloco {

std::string join_keys_help() {
  return "\nKeys (key=value):\n" +
         wrap_words("  store=URL             ", "the run's store (default: NOLOCO_STORE, else RUN_DIR/join.json's)") +
         wrap_words("  token_file=PATH       ", "where the token is when NOLOCO_RUN_TOKEN is unset (default: "
                                               "RUN_DIR/run_token)") +
         wrap_words("  stage=S               ", "pipelined: the stage to serve (default: the one with the fewest "
                                               "live workers)") +
         wrap_words("  data= bind= threads= ", fmt::format("this machine's own keys ({}); every other key is the run's "
                                                       "(RUN_DIR/config.yaml, else the run's store)",
                                                       fmt::join(machine_keys(), " ")));
}

// `join RUN_DIR`: a new NoLoCo replica of the run training into RUN_DIR (of
// one pipeline stage, in a pipelined run; of replica_workers workers, each a
// process of this machine, where the run's replicas have several). It claims
// the next member id from the run's store, takes a live replica's state at
// that replica's next outer step and trains with the others to the end (or,
// a replica of one worker, until SIGTERM).
int join_command(const std::string& run_dir, const std::vector<std::string>& args) {
  JoinRequest request{"", run_files::in(run_dir, run_files::kRunToken), -1};
  Options options("join");
  options.add("store", request.store, "the run's store (NOLOCO_STORE's form); default: NOLOCO_STORE, else RUN_DIR/join.json's")
      .add("token_file", request.token_file, "where the token is when NOLOCO_RUN_TOKEN is unset")
      .add("stage", request.stage, "pipelined run: the stage to serve; default: the one with the fewest live workers");
  auto overrides = options.parse_known(args);
  // Everything else is the run's: a joiner with its own steps or model would
  // train apart from the run while the launcher waited for it.
  const auto& own = machine_keys();
  for (const auto& o : overrides) {
    const auto key = o.substr(0, o.find('='));
    if (key == "out" || std::find(own.begin(), own.end(), key) == own.end())
      throw std::invalid_argument(fmt::format("join: {} is the run's (its config); a joiner sets only its machine's "
                                              "own keys: {}",
                                              key, fmt::join(own, ", ")));
  }
  return join_run(run_dir, request, std::move(overrides), args);
}

}  // namespace noloco
