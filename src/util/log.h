// Diagnostics go through spdlog to stderr, one line each, prefixed with who
// speaks: "noloco:" (a lone run or the launcher) or "noloco[worker N]:".
// Warnings and errors say so after the prefix. Command output (tables,
// generated text) goes to stdout, not here.
#pragma once
#include <string>

#include <spdlog/spdlog.h>

namespace noloco {

// Sets the prefix of every later line, e.g. "noloco" or "noloco[worker 3]".
void init_logging(const std::string& who);

}  // namespace noloco
