// The run's store when nobody else hosts one: a one-member etcd started for
// the run (its peer port a unix socket in its private data directory), with
// authentication on (user root; password: the run's token) before anyone
// else can reach it. Stopped and removed with the run; it dies with its host
// process, and the next one removes what a killed one left in the temporary
// directory (unless its data is kept: `noloco serve`'s).
//
// Two kinds. The launcher's store is a unix socket in that private (0700)
// directory: its local workers reach it through the file system (from their
// own network namespaces too), and nobody else, on the network or another
// local user, can connect at all. A store other machines reach (worker 0
// hosting it, as under PyTorch's env://) listens on `bind`:`port` only, and
// opens that port after authentication is on: etcd is first started on the
// private socket alone, the root user made and authentication enabled there,
// then restarted on the TCP port, over TLS when given a key (see run_keys.h:
// the run's workers pin its public key, derived from the token).
#pragma once
#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/store/run_keys.h"

namespace noloco {

// A port on IPv4 address `bind` that the kernel found free a moment ago, for
// a program of another's (etcd, a test's server) to listen on; throws
// std::runtime_error naming `bind` where it cannot be bound.
int free_port(const std::string& bind);

// This machine's place in a store cluster that several `noloco serve`s host
// (no one machine holds the run): etcd members that reach each other over
// TLS on their peer ports, each presenting the token-derived key's
// certificate that names every member's address (StoreTlsKey::peer_certificate_pem)
// and taking no other.
struct EtcdClusterMember {
  std::string name;             // this member's, as in `members`
  std::string members;          // name=https://host:peer_port,... every member, this one included
  std::string listen_peer_url;  // https://bind:peer_port
  std::string peer_url;         // https://host:peer_port, as in `members`
  std::string cluster_token;    // keeps another run's cluster on the same hosts apart
};

class EtcdServer {
 public:
  // The launcher's store, on a private unix socket. Throws std::runtime_error
  // with the reason (no etcd binary, did not come up, `interrupted` while waiting).
  explicit EtcdServer(const std::string& password, bool (*interrupted)() = nullptr);
  // A store on `bind`:`port` (port 0: a free one), over TLS with `tls` (null:
  // plain HTTP); also throws when it cannot listen there. With `cluster`
  // (and `tls`), this machine's member of a store cluster: up once a majority
  // of the members are (they may be started minutes apart), waiting until
  // `interrupted` or 10 minutes.
  // With `data_dir`, the store's data lives there and stays after the store
  // stops or dies (a directory made for it, private): a store started again
  // on it holds the keys it held.
  EtcdServer(const std::string& bind, int port, const std::string& password, const StoreTlsKey* tls = nullptr,
             bool (*interrupted)() = nullptr, const EtcdClusterMember* cluster = nullptr,
             const std::string& data_dir = "");
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // unix:///path/to/client.sock, or http[s]://bind:port
  const std::string& endpoint() const { return endpoint_; }
  // The TCP port; 0 on a unix socket.
  int port() const { return port_; }
  // Once etcd has ended by itself (killed, crashed): how ("killed by signal
  // 9"); nullopt while it runs. Never blocks.
  std::optional<std::string> exited();
  // Starts etcd again on its data, as it was (once exited() says it ended):
  // the keys it held are there, and its clients reconnect. Not for a
  // cluster's member, which the others carry meanwhile. Throws as the
  // constructor does.
  void restart();
  // The supervisor's check, every while: once etcd has ended, starts it
  // again, saying so on the log behind `prefix` ("serve: ") with `meanwhile`
  // (what goes on without it). False once it did not start again (said
  // too): asking once more would fail the same way.
  bool restart_if_ended(const std::string& prefix, const std::string& meanwhile);
  // Stops the store and removes its data, a kept data_dir too.
  void remove_data();
  // Where private stores live: tmpfs when there is one (a store is scratch, and etcd syncs every write).
  static std::string temp_root();

  // The etcd binary: $NOLOCO_ETCD, else etcd on PATH or /usr/bin/etcd; empty if none.
  static std::string binary();
  // Makes user root with `password`, grants it the root role and switches
  // authentication on, at a store where it is off. Safe to call again after a
  // failure part way (a reply lost under load): steps already taken are not
  // errors. Throws std::runtime_error with etcd's reason.
  static void turn_on_authentication(const std::string& endpoint, const std::string& password);

 private:
  // A private directory of its own in temp_root(), or `kept` (made if need be).
  void make_directory(const std::string& kept = "");
  template <class Start>
  void stop_if_thrown(Start start);
  // Starts etcd serving clients at `client_url` (reached at `endpoint`) and
  // waits until it answers: with `enable_auth`, by making the root user and
  // switching authentication on; else by a login as root. Throws otherwise.
  void start(const std::string& client_url, const std::string& endpoint, const std::string& password,
             bool (*interrupted)(), bool enable_auth, const StoreTlsKey* tls = nullptr,
             const EtcdClusterMember* cluster = nullptr);
  // Writes the key and its certificate into the private directory.
  void write_certificate(const StoreTlsKey& tls);
  void stop_process();
  void stop();
  std::string dir_, endpoint_;
  bool kept_ = false;  // dir_ outlives this store
  // How it was last started, for restart().
  std::string client_url_, password_;
  bool (*interrupted_)() = nullptr;
  std::optional<StoreTlsKey> tls_;
  bool in_cluster_ = false;
  int port_ = 0;
  pid_t pid_ = -1;
  std::optional<std::string> ended_;
};

}  // namespace noloco
