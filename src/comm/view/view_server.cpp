#include "comm/view/view_server.h"

#include <sodium.h>

#include <stdexcept>

#include <fmt/format.h>
#include <httplib.h>
#include <spdlog/spdlog.h>

#include "comm/membership/membership.h"
#include "comm/store/run_keys.h"
#include "comm/view/view_assets.h"
#include "util/error_text.h"
#include "util/parse_number.h"
#include "util/process_stats.h"

namespace noloco {

namespace {

// Sleeps `d` in short slices, returning early once `stopping` is set.
void sleep_unless(const std::atomic<bool>& stopping, std::chrono::milliseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (!stopping.load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

const ViewAsset* asset_at(const std::string& path) {
  for (const auto& a : view_assets())
    if (path == a.path) return &a;
  return nullptr;
}

}  // namespace

RunWatch::RunWatch(std::function<StorePtr(const std::string&)> connect, std::string endpoints, std::string token,
                   std::chrono::milliseconds poll)
    : connect_(std::move(connect)), endpoints_(std::move(endpoints)), token_(std::move(token)), poll_(poll) {
  thread_ = std::thread([this] { run(); });
  if (comma_separated(endpoints_).size() > 1) members_thread_ = std::thread([this] { ask_store_members(); });
}

RunWatch::~RunWatch() {
  stopping_ = true;
  thread_.join();
  if (members_thread_.joinable()) members_thread_.join();
}

nlohmann::json RunWatch::state() const {
  std::lock_guard lock(mutex_);
  return view_.state(unix_seconds());
}

void RunWatch::run() {
  StatusReader reader(token_);
  StorePtr store;
  auto membership_read = std::chrono::steady_clock::now();
  while (!stopping_) {
    try {
      if (!store) {
        store = connect_(endpoints_);
        std::lock_guard lock(mutex_);
        view_.store_back();
      }
      read_store(reader, store, membership_read);
    } catch (const std::exception& e) {
      // The page keeps what it has; a store that comes back (a restarted serve) is read on.
      {
        std::lock_guard lock(mutex_);
        view_.store_gone(fmt::format(
            "the run's store cannot be read: the run has ended, or the store's host is down; shown is what was read "
            "until then ({})",
            error_text(e)));
      }
      store.reset();
      sleep_unless(stopping_, std::chrono::seconds(2));
    }
    sleep_unless(stopping_, poll_);
  }
}

void RunWatch::read_store(StatusReader& reader, const StorePtr& store,
                          std::chrono::steady_clock::time_point& membership_read) {
  const auto scope = run_scope(store, token_, record::kStatus);
  const auto entries = reader.poll(*scope);
  if (!entries.empty()) found_ = true;
  {
    std::lock_guard lock(mutex_);
    for (const auto& entry : entries) view_.add(entry, unix_seconds());
    view_.set_refused(reader.refused());
  }
  if (std::chrono::steady_clock::now() - membership_read < std::chrono::seconds(2)) return;
  membership_read = std::chrono::steady_clock::now();
  std::vector<nlohmann::json> running;
  {
    std::lock_guard lock(mutex_);
    running = view_.running();
  }
  for (const auto& m : running) {
    const auto scope_name = record::replica_group(m["stages"].get<int>(), m["stage"].get<int>());
    if (member_state(store, token_, scope_name, m["replica"].get<int>()) != MemberState::dead) continue;
    std::lock_guard lock(mutex_);
    view_.mark_lost(m["rank"].get<int>(), unix_seconds());
  }
}

// A member that answers a read is up; one that cannot be reached, or has lost
// its quorum (it cannot answer a read), is down. Each member on its own
// connection, so that one down costs its own timeout, not the others' turn.
void RunWatch::ask_store_members() {
  std::vector<StoreMemberHealth> health;
  for (const auto& endpoint : comma_separated(endpoints_)) health.push_back({endpoint, true, ""});
  std::vector<StorePtr> stores(health.size());
  while (!stopping_) {
    for (size_t i = 0; i < health.size() && !stopping_; ++i) {
      auto& h = health[i];
      const bool was_up = h.up;
      try {
        if (!stores[i]) stores[i] = connect_(h.endpoint);
        stores[i]->check({record::kStatus});
        h.up = true;
        h.why.clear();
      } catch (const std::exception& e) {
        stores[i].reset();
        h.up = false;
        h.why = error_text(e);
      }
      if (was_up && !h.up) spdlog::warn("the run's store member at {} is down: {}", h.endpoint, h.why);
      if (!was_up && h.up) spdlog::info("the run's store member at {} is back", h.endpoint);
    }
    {
      std::lock_guard lock(mutex_);
      view_.set_store_members(health);
    }
    sleep_unless(stopping_, std::chrono::seconds(2));
  }
}

ViewServer::ViewServer(const std::string& bind, int port, std::string key, std::function<nlohmann::json()> state)
    : bind_(bind), key_(std::move(key)), server_(std::make_unique<httplib::Server>()) {
  const auto allowed = [this](const httplib::Request& request) {
    const auto given = request.get_param_value("key");
    return given.size() == key_.size() && sodium_memcmp(given.data(), key_.data(), key_.size()) == 0;
  };
  const auto refuse = [](httplib::Response& response) {
    response.status = 403;
    response.set_content("refused: this page needs the key in the URL that noloco printed for the run\n",
                         "text/plain");
  };
  server_->Get("/state.json", [allowed, refuse, state](const httplib::Request& request, httplib::Response& response) {
    if (!allowed(request)) return refuse(response);
    response.set_header("Cache-Control", "no-store");
    response.set_content(state().dump(), "application/json");
  });
  // The page and the library hold nothing of the run; the page alone waits for the key, so that a wrong URL shows nothing.
  server_->Get(R"(/[a-z.\-]*)", [allowed, refuse](const httplib::Request& request, httplib::Response& response) {
    const ViewAsset* asset = asset_at(request.path);
    if (!asset) {
      response.status = 404;
      return;
    }
    if (request.path == "/" && !allowed(request)) return refuse(response);
    response.set_content(reinterpret_cast<const char*>(asset->data), asset->size, asset->type);
  });
  // The page takes no body: one announced (a stranger's 300 MB POST was read
  // whole before its 404) is refused before it is read. A client that sends
  // its request a byte at a time loses its connection after 2 s without one,
  // and the pool has threads to spare for keyed requests while strangers
  // hold some (two slow ones held both threads of the pool it had).
  server_->set_payload_max_length(1024);
  server_->set_read_timeout(std::chrono::seconds(2));
  server_->set_keep_alive_timeout(2);
  server_->new_task_queue = [] { return new httplib::ThreadPool(kPageThreads); };
  port_ = port == 0 ? server_->bind_to_any_port(bind) : (server_->bind_to_port(bind, port) ? port : -1);
  if (port_ <= 0)
    throw std::runtime_error(fmt::format("the live page cannot listen on {}:{} (in use, or not this machine's)", bind,
                                         port));
  thread_ = std::thread([this] { server_->listen_after_bind(); });
}

ViewServer::~ViewServer() {
  server_->stop();
  thread_.join();
}

std::string ViewServer::url() const {
  const std::string host = bind_ == "0.0.0.0" ? "127.0.0.1" : bind_;
  return fmt::format("http://{}:{}/?key={}", host, port_, key_);
}

}  // namespace noloco
