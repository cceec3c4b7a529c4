// The run's store on etcd: a c10d::Store over etcd's v3 JSON gateway, so
// that Gloo's rendezvous and our membership keys live in a hardened,
// authenticated key-value store instead of c10d's TCPStore server (which a
// single slow or malformed client can freeze, and which listens on every
// interface; docs/rendezvous.md has the measurements).
//
// Semantics follow TCPStore's: get() and wait() block until the keys exist
// (etcd watches, no polling), add() keeps a decimal counter, compareSet()
// writes when the key holds `expected` (or is absent and `expected` is
// empty) and returns what the key holds afterwards. One instance is one
// connection: use it from one thread at a time, as a TCPStore client.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store/run_keys.h"

namespace noloco {

class EtcdStore final : public c10d::Store {
 public:
  // `endpoint`: "http://host:port" (a cluster: its members' endpoints,
  // comma-separated; a member that cannot be reached hands over to the next)
  // (or https://, with NOLOCO_STORE_CA naming a CA bundle, or `tls` from the
  // run's token: the one public key the store may present, and the
  // certificate and key this client presents), or "unix:///path/to/socket".
  // Authenticates as `user` with `password` unless `user` is empty. Throws
  // std::runtime_error naming the endpoint on failure (unreachable, or
  // refused: wrong password, another key).
  EtcdStore(std::string endpoint, std::string user, std::string password, std::chrono::milliseconds timeout,
            StoreTlsKey tls = {});
  ~EtcdStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // A new connection to the same store (c10d asks for one per process group).
  c10::intrusive_ptr<c10d::Store> clone() override;

  // A request to etcd's JSON gateway (e.g. "/v3/auth/enable", "{}"); returns
  // the answer's text. Throws if etcd answers with an error.
  std::string request(const std::string& path, const std::string& json_body);

 private:
  struct Http;
  struct Value {
    bool exists = false;
    std::string value;
    int64_t mod_revision = 0;
    int64_t header_revision = 0;  // the store's revision when this was read
  };
  Value read(const std::string& key);
  // Blocks until `key` exists, at most until `deadline`; false on timeout.
  bool wait_for(const std::string& key, std::chrono::steady_clock::time_point deadline);
  std::string endpoint_;
  std::unique_ptr<Http> http_;
};

}  // namespace noloco
