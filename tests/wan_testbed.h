// The testbed of scripts/wan_testbed.sh (homes behind NAT routers, a public
// host, in network namespaces), removed when the object goes (also on failure).
#pragma once
#include <unistd.h>

#include <string>

#include <fmt/format.h>

#include "test_util.h"

namespace noloco::testing {

// Why the testbed cannot be built here ("" if it can): a test skips with it.
inline std::string why_no_testbed() {
  if (::geteuid() != 0) return "the testbed needs root (network namespaces)";
  if (run_command("sh -c 'command -v nft && command -v tc && command -v ip'", 10).exit_code != 0)
    return "the testbed needs ip, tc and nft (scripts/setup.sh installs them)";
  return "";
}

class WanTestbed {
 public:
  // `env`: more of the script's variables (NLW_NAT=random, NLW_UPLINK=off).
  WanTestbed(int homes, const std::string& prefix, bool same_lan = true, const std::string& env = "")
      : prefix_(prefix) {
    const auto up = run_command(fmt::format(NOLOCO_SOURCE_DIR "/scripts/wan_testbed.sh up {}", homes), 60,
                                fmt::format("NLW_PREFIX={} NLW_SAME_LAN={} {}", prefix, same_lan ? 1 : 0, env));
    ok_ = up.exit_code == 0;
    why_ = up.output;
  }
  ~WanTestbed() { run_command(NOLOCO_SOURCE_DIR "/scripts/wan_testbed.sh down", 60, "NLW_PREFIX=" + prefix_); }
  WanTestbed(const WanTestbed&) = delete;
  WanTestbed& operator=(const WanTestbed&) = delete;
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  // Home `home`'s router forwards TCP `port` to its machine.
  bool forward(int home, int port) const {
    return run_command(fmt::format(NOLOCO_SOURCE_DIR "/scripts/wan_testbed.sh forward {} {}", home, port), 20,
                       "NLW_PREFIX=" + prefix_)
               .exit_code == 0;
  }
  std::string in(const std::string& host) const { return fmt::format("ip netns exec {}-{} ", prefix_, host); }

 private:
  std::string prefix_, why_;
  bool ok_ = false;
};

}  // namespace noloco::testing
