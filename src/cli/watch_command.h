// `noloco watch [RUN_DIR|STORE]`: the live page of a run whose store is
// somewhere this machine reaches — a local run's directory (its launcher's
// join.json and run_token), or the store's URL with NOLOCO_RUN_TOKEN set, or
// with neither named NOLOCO_STORE (a home with `serve`'s lines). Prints the page's URL, key included, on a line that
// starts with http, and serves it until SIGTERM or Ctrl-C.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "comm/store/store.h"

namespace noloco {

int watch_command(std::string where, std::vector<std::string> args);

// A connection to the run's store at `url` (http(s)://, tcp://HOST:PORT for
// a torchrun store), pinning the key the token gives for an https store that
// names no CA of its own.
StorePtr connect_to_run_store(const std::string& url, const std::string& token, std::chrono::milliseconds timeout);

}  // namespace noloco
