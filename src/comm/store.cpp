#include "comm/store.h"

#include <functional>
#include <random>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/etcd_store.h"

namespace noloco {

namespace {
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
}  // namespace

StorePtr connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  if (!env.store_url.empty()) return c10::make_intrusive<EtcdStore>(env.store_url, "root", env.token, timeout);
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = c10::nullopt;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
}

StorePtr run_scope(const StorePtr& store, const std::string& token, const std::string& scope) {
  return c10::make_intrusive<c10d::PrefixStore>("noloco/" + token + "/" + scope, store);
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

void append_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  while (!list_has(current, item)) {
    const auto result = store.compareSet(key, bytes_of(current), bytes_of(current + item + ","));
    current.assign(result.begin(), result.end());
  }
}

void remove_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  while (list_has(current, item)) {
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
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

int64_t run_id_of(const std::string& token) {
  return int64_t(std::hash<std::string>{}(token) & 0x7fffffffffffffffull);
}

}  // namespace noloco
