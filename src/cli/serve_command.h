// `noloco serve`: what a run across the internet needs on one machine with a
// public address (issue 66), so that workers behind NAT routers and
// firewalls need nothing but what it prints. It hosts the run's store (etcd
// over TLS with authentication, both derived from the run's token, as worker
// 0's store is: nobody makes a certificate) and a relay
// (comm/link/relay.h), prints the environment a worker needs as
// `export NAME=VALUE` lines, and runs until SIGTERM or Ctrl-C.
#pragma once
#include <string>
#include <vector>

#include "config/options.h"

namespace noloco {

struct ServeArgs {
  std::string bind = "0.0.0.0";
  std::string advertise;  // the address workers reach this machine at; empty: bind's, or this machine's first
  int port = 29500;       // the store's
  int relay_port = 29501;
  bool store = true;      // false: a relay only (another serve holds the store)
  // HOST:PORT,... every serve of a store cluster, this one included, each at
  // its store's port (its relay at PORT+1, its etcd peers at PORT+2); the
  // same list, in the same order, on every one. Empty: a store of its own.
  std::string cluster;
  // Where the store keeps its data, so that a serve restarted after a crash
  // or a kill (same port and token) takes the run back. Empty: a directory
  // of its own in the machine's temporary files, removed when the serve is
  // stopped (Ctrl-C, SIGTERM), and for a cluster's member none that
  // outlives it; one named here is always kept.
  std::string store_dir;
  // The run's live page (comm/view/), for holders of the token: on
  // view_bind:view_port (0: a free port), its URL printed after the exports.
  bool view = true;
  std::string view_bind = "127.0.0.1";
  int view_port = 0;
};
Options serve_options(ServeArgs& args);

// Parses `args` (key=value) and serves until SIGTERM or SIGINT; the exit code.
int serve_command(const std::vector<std::string>& args);

// `noloco store-password`: the store's password for NOLOCO_RUN_TOKEN (for an etcd of one's own).
int store_password_command();

// The environment `noloco serve` prints for the token, addresses and ports given.
std::vector<std::string> serve_exports(const std::string& token, const ServeArgs& args, const std::string& host);

}  // namespace noloco
