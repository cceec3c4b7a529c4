#include "comm/launch/capped_links.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "util/log.h"

namespace noloco {

namespace {

const char* kNamespacePrefix = "noloco-";  // noloco-<launcher pid>-w<worker>

struct CommandResult {
  int status = -1;
  std::string output;
};

// Runs an iproute2 command (ip, tc) with the system directories on PATH.
CommandResult run_command(const std::string& command) {
  CommandResult r;
  const std::string line = "PATH=\"$PATH:/usr/sbin:/sbin\" " + command + " 2>&1";
  FILE* p = ::popen(line.c_str(), "r");
  if (!p) return r;
  char buf[512];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  r.status = ::pclose(p);
  while (!r.output.empty() && (r.output.back() == '\n' || r.output.back() == ' ')) r.output.pop_back();
  return r;
}

void must(const std::string& command) {
  const auto r = run_command(command);
  if (r.status != 0) throw std::runtime_error(fmt::format("capped links: '{}' failed: {}", command, r.output));
}

std::string tbf(double rate) {
  // A burst of at least 32 KB and 4 ms at the rate: a full-size packet always
  // fits, and the bucket refills finer than the kernel's timer.
  const auto burst = std::max<int64_t>(32768, int64_t(rate / 8 / 250));
  return fmt::format("tbf rate {}bit burst {} latency 100ms", int64_t(rate), burst);
}

bool process_alive(long pid) { return ::kill(pid_t(pid), 0) == 0 || errno == EPERM; }

// Namespaces, bridges and veths left by launchers that are gone (killed).
void remove_leftovers() {
  std::istringstream list(run_command("ip netns list").output);
  for (std::string line; std::getline(list, line);) {
    const auto name = line.substr(0, line.find(' '));
    if (name.rfind(kNamespacePrefix, 0) != 0) continue;
    const auto pid_text = name.substr(std::string(kNamespacePrefix).size(), name.find("-w", 7) - 7);
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || process_alive(pid)) continue;
    run_command("ip netns del " + name);
    run_command(fmt::format("ip link del nlc{}br", pid));
  }
}

}  // namespace

std::string CappedLinks::unavailable_reason() {
  if (::geteuid() != 0) return "capped links need root (network namespaces, veth pairs, tc qdiscs)";
  if (run_command("ip -V").status != 0 || run_command("tc -V").status != 0)
    return "capped links need iproute2 (ip, tc)";
  const std::string probe = fmt::format("{}probe{}", kNamespacePrefix, ::getpid());
  const auto made = run_command("ip netns add " + probe);
  if (made.status != 0) return "cannot create a network namespace here: " + made.output;
  run_command("ip netns del " + probe);
  return "";
}

std::vector<std::string> CappedLinks::existing_namespaces() {
  std::vector<std::string> out;
  std::istringstream list(run_command("ip netns list").output);
  for (std::string line; std::getline(list, line);) {
    const auto name = line.substr(0, line.find(' '));
    if (name.rfind(kNamespacePrefix, 0) == 0) out.push_back(name);
  }
  return out;
}

CappedLinks::CappedLinks(int workers, double bits_per_second) : id_(std::to_string(::getpid())), rate_(bits_per_second) {
  if (workers < 1 || workers > 250) throw std::invalid_argument("capped links: between 1 and 250 workers");
  const auto reason = unavailable_reason();
  if (!reason.empty()) throw std::runtime_error(reason);
  remove_leftovers();
  // A /24 of the private range named by the process id.
  const long pid = ::getpid();
  subnet_ = fmt::format("10.{}.{}", 100 + (pid >> 8) % 100, pid & 255);
  host_ = subnet_ + ".1";
  try {
    create(workers);
  } catch (...) {
    remove();
    throw;
  }
}

CappedLinks::~CappedLinks() { remove(); }

std::string CappedLinks::netns_path(int worker) const { return "/var/run/netns/" + namespaces_.at(size_t(worker)); }

void CappedLinks::create(int workers) {
  const std::string bridge = "nlc" + id_ + "br";
  must(fmt::format("ip link add {} type bridge", bridge));
  bridge_ = true;
  must(fmt::format("ip addr add {}/24 dev {}", host_, bridge));
  must(fmt::format("ip link set {} up", bridge));
  for (int w = 0; w < workers; ++w) {
    const std::string ns = fmt::format("{}{}-w{}", kNamespacePrefix, id_, w);
    const std::string host_side = fmt::format("nlc{}v{}", id_, w), worker_side = fmt::format("nlc{}p{}", id_, w);
    const std::string address = fmt::format("{}.{}", subnet_, w + 2);
    must("ip netns add " + ns);
    namespaces_.push_back(ns);
    must(fmt::format("ip link add {} type veth peer name {}", host_side, worker_side));
    must(fmt::format("ip link set {} netns {}", worker_side, ns));
    must(fmt::format("ip link set {} mtu 1500 master {} up", host_side, bridge));
    must(fmt::format("ip -n {} link set lo up", ns));
    must(fmt::format("ip -n {} addr add {}/24 dev {}", ns, address, worker_side));
    must(fmt::format("ip -n {} link set {} mtu 1500 up", ns, worker_side));
    // Download (bridge to worker) and upload (worker to bridge), each capped.
    must(fmt::format("tc qdisc add dev {} root {}", host_side, tbf(rate_)));
    must(fmt::format("tc -n {} qdisc add dev {} root {}", ns, worker_side, tbf(rate_)));
    addresses_.push_back(address);
  }
}

void CappedLinks::remove() {
  // Deleting a namespace deletes the veth end inside it, and with it the pair.
  for (const auto& ns : namespaces_) {
    const auto r = run_command("ip netns del " + ns);
    if (r.status != 0) spdlog::warn("capped links: could not remove namespace {}: {}", ns, r.output);
  }
  namespaces_.clear();
  if (bridge_) run_command("ip link del nlc" + id_ + "br");
  bridge_ = false;
}

}  // namespace noloco
