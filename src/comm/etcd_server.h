// The store our launcher hosts for its workers: a one-member etcd started for
// the run, listening on `bind` only (its peer port is a unix socket in its
// private data directory), with authentication on (user root; password: the
// run's token) before any worker connects. Stopped and removed with the run;
// it dies with the launcher, and the next launcher removes what a killed one
// left in the temporary directory.
#pragma once
#include <sys/types.h>

#include <string>

namespace noloco {

class EtcdServer {
 public:
  // Throws std::runtime_error with the reason (no etcd binary, cannot listen
  // on `bind`, did not come up, `interrupted` while waiting). port 0: a free one.
  EtcdServer(const std::string& bind, int port, const std::string& password,
             bool (*interrupted)() = nullptr);
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // http://bind:port
  const std::string& endpoint() const { return endpoint_; }
  int port() const { return port_; }

  // The etcd binary: $NOLOCO_ETCD, else etcd on PATH or /usr/bin/etcd; empty if none.
  static std::string binary();

 private:
  void stop();
  std::string dir_, endpoint_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace noloco
