#include "cli/watch_command.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/launch/launcher.h"
#include "comm/view/view_server.h"
#include "config/options.h"
#include "config/worker_env.h"
#include "util/error_text.h"
#include "util/stop_signal.h"
#include "util/run_files.h"
#include "util/run_token.h"

namespace noloco {

namespace {

struct WatchArgs {
  std::string token_file;  // empty: RUN_DIR/run_token
  std::string bind = "127.0.0.1";
  int port = 0;
  double wait = 60;
};

// The store and the token of the run in RUN_DIR (its launcher's invitation),
// or at a store's URL, or (nothing named) at NOLOCO_STORE: a home with the
// lines `serve` printed watches the run as its workers do.
std::pair<std::string, std::string> run_of(std::string where, const std::string& token_file) {
  if (where.empty()) {
    const char* store = std::getenv("NOLOCO_STORE");
    if (!store || !*store)
      throw std::invalid_argument(
          "watch: name the run's directory or its store's URL, or export the lines `noloco serve` printed "
          "(NOLOCO_STORE, NOLOCO_RUN_TOKEN)");
    where = store;
  }
  if (std::filesystem::is_directory(where))
    return {read_join_invitation(where, "watch").store,
            run_token_of(token_file.empty() ? run_files::in(where, run_files::kRunToken) : token_file, "watch")};
  const auto token = run_token_in_environment();
  if (!token) throw std::invalid_argument("watch: set NOLOCO_RUN_TOKEN to the run's token");
  return {where, *token};
}

}  // namespace

StorePtr connect_to_run_store(const std::string& url, const std::string& token, std::chrono::milliseconds timeout) {
  WorkerEnv env;
  env.token = token;
  use_store(env, url, "the store");
  pin_hosted_store_key(env);
  return connect_store(env, timeout);
}

int watch_command(std::string where, std::vector<std::string> args) {
  // With the run left to NOLOCO_STORE, the command line's first key=value lands where the run is named.
  if (where.find('=') != std::string::npos && where.find("://") == std::string::npos &&
      !std::filesystem::is_directory(where)) {
    args.insert(args.begin(), where);
    where.clear();
  }
  WatchArgs a;
  Options options("watch");
  options.add("token_file", a.token_file, "where the token is when NOLOCO_RUN_TOKEN is unset (default: RUN_DIR/run_token)")
      .add("bind", a.bind, "the address the page listens on (loopback unless told otherwise)")
      .add("port", a.port, "the page's port (0: a free one, printed)")
      .add("wait", a.wait, "seconds to wait for the run's first status before giving up");
  options.parse(args);
  const auto [store, token] = run_of(where, a.token_file);
  stop_on_signal();
  try {
    connect_to_run_store(store, token, std::chrono::seconds(10));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("watch: the run's store at {} cannot be read with this token: {}", store,
                                         error_text(e)));
  }
  RunWatch watch(
      [token = token](const std::string& at) { return connect_to_run_store(at, token, std::chrono::seconds(5)); },
      store, token);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(a.wait * 1000));
  while (!watch.found_run()) {
    if (stop_signalled()) return 0;
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(fmt::format(
          "watch: no worker of a run with this token has published a status at {} in {} s (another run's token? "
          "live_status=false?)",
          store, a.wait));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ViewServer page(a.bind, a.port, view_key(token), [&watch] { return watch.state(); });
  std::cout << page.url() << std::endl;
  spdlog::info("watch: the live page of the run at {} is served at the address above until SIGTERM or Ctrl-C", store);
  wait_for_stop();
  return 0;
}

}  // namespace noloco
