// The run's token as a user gives it: NOLOCO_RUN_TOKEN, read here only
// (comm/store/store.h mints one; comm/launch/launcher.h reads a kept file).
#pragma once
#include <cstdlib>
#include <optional>
#include <string>

namespace noloco {

// NOLOCO_RUN_TOKEN, or nullopt where it is unset or empty.
inline std::optional<std::string> run_token_in_environment() {
  const char* token = std::getenv("NOLOCO_RUN_TOKEN");
  if (!token || !*token) return std::nullopt;
  return std::string(token);
}

}  // namespace noloco
