// The run's key-value store (a c10d::Store): rendezvous of process groups,
// membership lists, heartbeats. Every key lives under a secret prefix derived
// from the run's token (comm/store/run_keys.h), never the token itself.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store/run_keys.h"
#include "comm/store/run_record.h"
#include "config/worker_env.h"

namespace noloco {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// A new connection to the run's store: etcd at env.store_url (our launcher's,
// one the user runs, or the one worker 0 hosts), else torchrun's TCPStore.
// Waits up to `timeout` for an etcd that is not up yet; a wrong token is
// refused at once.
StorePtr connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout);
// Where connect_store connects, as a message names it: the URL, or
// tcp://MASTER_ADDR:MASTER_PORT for torchrun's store.
std::string store_address(const WorkerEnv& env);
// A joiner reaching the run's store at an https:// URL pins the key the token
// gives (the store worker 0 hosts), unless NOLOCO_STORE_CA names the CA of a
// store of one's own.
void pin_hosted_store_key(WorkerEnv& env);
// The keys of `scope` in the run with `token`: "noloco/<store_key_prefix(token)>/<scope>/...";
// what the scopes and keys are: comm/store/run_record.h.
StorePtr run_scope(const StorePtr& store, const std::string& token, const std::string& scope);
// The whole key of `key` in that run, for a store without the prefix.
std::string run_store_key(const std::string& token, const std::string& key);

// Comma-separated lists under one key, changed atomically with compareSet,
// so that reading a whole list costs one round trip however long it is.
std::string read_or_empty(c10d::Store& store, const std::string& key);
std::vector<std::string> list_items(const std::string& text);
bool list_has(const std::string& text, const std::string& item);
void append_item(c10d::Store& store, const std::string& key, const std::string& item);
void remove_item(c10d::Store& store, const std::string& key, const std::string& item);
// Writes `value` under `key` unless a value is there; returns the one that stays (first writer wins).
std::string set_once(c10d::Store& store, const std::string& key, const std::string& value);

// A fresh token for a run (256 random bits from libsodium, in hex): the
// launcher's and serve's alike.
std::string new_run_token();

}  // namespace noloco
