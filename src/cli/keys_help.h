// A command's key=value options as its --help lists them.
#pragma once
#include <string>

#include "config/options.h"

namespace noloco {

// `options` bound to a default-constructed Args: every key with its help and default.
template <class Args>
std::string keys_help(Options (*options)(Args&)) {
  Args defaults;
  return "\nKeys (key=value):\n" + options(defaults).help();
}

}  // namespace noloco
