// `noloco join RUN_DIR [key=value...]`: a new replica of a running NoLoCo
// run (train/worker_entry.h's join_run), with its keys parsed and checked.
#pragma once
#include <string>
#include <vector>

namespace noloco {

int join_command(const std::string& run_dir, const std::vector<std::string>& args);
// The keys join_command takes, for `noloco join --help`.
std::string join_keys_help();

}  // namespace noloco
