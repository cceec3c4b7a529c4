#include "comm/store/store.h"

#include <functional>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <sodium.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/store/etcd_store.h"
#include "comm/store/store_outage.h"

namespace noloco {

namespace {
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
}  // namespace

std::string store_address(const WorkerEnv& env) {
  return env.store_url.empty() ? fmt::format("tcp://{}:{}", env.master_addr, env.master_port) : env.store_url;
}

StorePtr connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  if (env.store_url.empty()) {
    if (!env.agent_store)
      throw std::logic_error("connect_store: without torchrun's agent the store is an etcd (store_url unset)");
    c10d::TCPStoreOptions opts;
    opts.port = uint16_t(env.master_port);
    opts.isServer = false;
    opts.numWorkers = c10::nullopt;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  }
  // Worker 0's store may still be starting: try again until the timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    try {
      return c10::make_intrusive<EtcdStore>(env.store_url, "root", store_password(env.token), timeout,
                                            env.store_pin.empty() ? StoreTlsKey{} : store_tls_key(env.token));
    } catch (const StoreRefused&) {
      throw;  // waiting does not change the token
    } catch (const std::runtime_error&) {
      if (std::chrono::steady_clock::now() > deadline) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void pin_hosted_store_key(WorkerEnv& env) {
  if (env.store_url.rfind("https://", 0) == 0 && !std::getenv("NOLOCO_STORE_CA"))
    env.store_pin = store_tls_key(env.token).pin;
}

std::string run_store_key(const std::string& token, const std::string& key) {
  return "noloco/" + store_key_prefix(token) + "/" + key;
}

StorePtr run_scope(const StorePtr& store, const std::string& token, const std::string& scope) {
  return c10::make_intrusive<c10d::PrefixStore>(run_store_key(token, scope), store);
}

std::string read_or_empty(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return "";
  const auto bytes = store.get(key);
  return {bytes.begin(), bytes.end()};
}

std::vector<std::string> list_items(const std::string& text) {
  std::vector<std::string> items;
  for (size_t pos = 0; pos < text.size();) {
    const size_t comma = text.find(',', pos);
    if (comma == std::string::npos) break;
    if (comma > pos) items.push_back(text.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return items;
}

bool list_has(const std::string& text, const std::string& item) {
  return ("," + text).find("," + item + ",") != std::string::npos;
}

namespace {

// Each round either writes or sees the list changed by another writer; a
// store that answers neither (a broken compareSet) must not spin a process
// forever.
constexpr int kListRounds = 1000;

[[noreturn]] void list_kept_changing(const std::string& key) {
  throw std::runtime_error(fmt::format("store: the list {} kept changing for {} rounds", key, kListRounds));
}

}  // namespace

void append_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  for (int round = 0; !list_has(current, item); ++round) {
    if (round == kListRounds) list_kept_changing(key);
    const auto result = store.compareSet(key, bytes_of(current), bytes_of(current + item + ","));
    current.assign(result.begin(), result.end());
  }
}

void remove_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  for (int round = 0; list_has(current, item); ++round) {
    if (round == kListRounds) list_kept_changing(key);
    std::string wanted = "," + current;
    wanted.erase(wanted.find("," + item + ","), item.size() + 1);
    const auto result = store.compareSet(key, bytes_of(current), bytes_of(wanted.substr(1)));
    current.assign(result.begin(), result.end());
  }
}

std::string set_once(c10d::Store& store, const std::string& key, const std::string& value) {
  const auto kept = store.compareSet(key, {}, bytes_of(value));
  return {kept.begin(), kept.end()};
}

std::string new_run_token() {
  if (sodium_init() < 0) throw std::runtime_error("libsodium did not initialise");
  uint8_t bytes[32];
  randombytes_buf(bytes, sizeof(bytes));
  char hex[2 * sizeof(bytes) + 1];
  sodium_bin2hex(hex, sizeof(hex), bytes, sizeof(bytes));
  return hex;
}

}  // namespace noloco
