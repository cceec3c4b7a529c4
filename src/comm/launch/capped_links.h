// Slow links on one machine: every local worker in a Linux network namespace
// of its own, joined to the launcher's namespace by a bridge, its link capped
// with a token bucket (tc tbf) in both directions, so each worker uploads and
// downloads at most `rate`, like a machine on its own slow link. Latency is
// not modelled (this kernel has no netem): it stays with the simulator.
//
// Needs root (namespaces, links, qdiscs) and iproute2. Everything created is
// named after the launcher's process id and removed by the destructor, also
// when a run fails; leftovers of a launcher that was killed are removed by
// the next one.
#pragma once
#include <string>
#include <vector>

namespace noloco {

class CappedLinks {
 public:
  // Creates the network for `workers` workers; throws std::runtime_error
  // naming the command that failed (after removing what it had made).
  CappedLinks(int workers, double bits_per_second);
  ~CappedLinks();
  CappedLinks(const CappedLinks&) = delete;
  CappedLinks& operator=(const CappedLinks&) = delete;

  double bits_per_second() const { return rate_; }
  // The launcher's address on the bridge: where the workers find the store.
  const std::string& host_address() const { return host_; }
  const std::string& worker_address(int worker) const { return addresses_.at(size_t(worker)); }
  // The network namespace file a worker process joins (setns) before exec.
  std::string netns_path(int worker) const;

  // Empty if this process can create capped links, else why not.
  static std::string unavailable_reason();
  // Names of the network namespaces of this kind that exist now (for tests).
  static std::vector<std::string> existing_namespaces();

 private:
  void create(int workers);
  void remove();
  std::string id_;
  double rate_;
  std::string subnet_, host_;  // "10.a.b", its .1
  std::vector<std::string> namespaces_, addresses_;
  bool bridge_ = false;
};

}  // namespace noloco
