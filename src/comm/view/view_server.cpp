#include "comm/view/view_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/link/socket_io.h"
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

namespace {

// One connection of the page: its request head read until its deadline, its
// answer written until another.
struct PageConnection {
  int fd = -1;
  std::chrono::steady_clock::time_point deadline;
  std::string in, out;
  size_t sent = 0;
  bool answering() const { return !out.empty(); }
};

std::string response(int status, const std::string& type, const std::string& body, bool no_store = false) {
  const char* reason = status == 200   ? "OK"
                       : status == 403 ? "Forbidden"
                       : status == 404 ? "Not Found"
                       : status == 405 ? "Method Not Allowed"
                       : status == 413 ? "Payload Too Large"
                                       : "Request Header Fields Too Large";
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{}",
                     status, reason, type, body.size(), no_store ? "Cache-Control: no-store\r\n" : "", body);
}

// The value of `name` in a query string ("a=1&key=..."); the page's key is
// hex, so no percent-decoding is needed to compare it.
std::string query_value(const std::string& query, const std::string& name) {
  for (size_t start = 0; start <= query.size();) {
    const size_t end = std::min(query.find('&', start), query.size());
    const auto pair = query.substr(start, end - start);
    if (pair.rfind(name + "=", 0) == 0) return pair.substr(name.size() + 1);
    start = end + 1;
  }
  return "";
}

// Whether a request head announces a body (the page takes none).
bool announces_body(const std::string& head) {
  std::string lower(head.size(), '\0');
  std::transform(head.begin(), head.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  const auto length = lower.find("\r\ncontent-length:");
  if (length != std::string::npos) {
    const auto value = lower.substr(length + 17, lower.find("\r\n", length + 2) - length - 17);
    if (value.find_first_of("123456789") != std::string::npos) return true;
  }
  return lower.find("\r\ntransfer-encoding:") != std::string::npos;
}

}  // namespace

ViewServer::ViewServer(const std::string& bind, int port, std::string key, std::function<nlohmann::json()> state)
    : bind_(bind), key_(std::move(key)), state_(std::move(state)) {
  listen_fd_ = listen_socket(bind, port, 128, "the live page");
  port_ = local_port(listen_fd_);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  thread_ = std::thread([this] { serve(); });
}

ViewServer::~ViewServer() {
  stopping_ = true;
  (void)!::eventfd_write(wake_fd_, 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

std::string ViewServer::answer(const std::string& head) const {
  if (announces_body(head)) return response(413, "text/plain", "the page takes no request body\n");
  const auto line = head.substr(0, head.find("\r\n"));
  const auto first = line.find(' '), second = line.find(' ', first + 1);
  if (first == std::string::npos || second == std::string::npos) return response(405, "text/plain", "");
  if (line.substr(0, first) != "GET") return response(405, "text/plain", "the page answers GET alone\n");
  const auto target = line.substr(first + 1, second - first - 1);
  const auto question = target.find('?');
  const auto path = target.substr(0, question);
  const auto given = question == std::string::npos ? "" : query_value(target.substr(question + 1), "key");
  const bool allowed = given.size() == key_.size() && sodium_memcmp(given.data(), key_.data(), key_.size()) == 0;
  const auto refused =
      response(403, "text/plain", "refused: this page needs the key in the URL that noloco printed for the run\n");
  if (path == "/state.json") return allowed ? response(200, "application/json", state_().dump(), true) : refused;
  // The page and the library hold nothing of the run; the page alone waits for the key, so that a wrong URL shows nothing.
  const ViewAsset* asset = asset_at(path);
  if (!asset) return response(404, "text/plain", "");
  if (path == "/" && !allowed) return refused;
  return response(200, asset->type, std::string(reinterpret_cast<const char*>(asset->data), asset->size));
}

// One thread, every connection polled: a stranger that sends its request a
// byte at a time holds a descriptor until its deadline, never a thread, so
// keyed requests are answered however many trickle (issue 100 item 9).
void ViewServer::serve() {
  std::vector<PageConnection> connections;
  const auto drop = [&](PageConnection& c) {
    ::close(c.fd);
    c.fd = -1;
  };
  while (!stopping_) {
    std::vector<pollfd> polled{{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const auto& c : connections) polled.push_back({c.fd, short(c.answering() ? POLLOUT : POLLIN), 0});
    ::poll(polled.data(), polled.size(), 200);
    if (stopping_) break;
    const auto now = std::chrono::steady_clock::now();
    for (size_t k = 0; k < connections.size(); ++k) {
      auto& c = connections[k];
      const auto events = polled[k + 2].revents;
      if (now > c.deadline || (events & (POLLERR | POLLNVAL))) {
        drop(c);
        continue;
      }
      if (c.answering() && (events & (POLLOUT | POLLHUP))) {
        const auto n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno != EAGAIN && errno != EINTR) drop(c);
        if (n > 0 && (c.sent += size_t(n)) == c.out.size()) drop(c);
        continue;
      }
      if (!(events & (POLLIN | POLLHUP))) continue;
      std::array<char, 4096> buffer{};
      const auto n = ::recv(c.fd, buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        drop(c);
        continue;
      }
      if (n > 0) c.in.append(buffer.data(), size_t(n));
      const auto end = c.in.find("\r\n\r\n");
      if (end == std::string::npos && c.in.size() <= kLongestHead) continue;
      c.out = end == std::string::npos ? response(431, "text/plain", "") : answer(c.in.substr(0, end + 2));
      c.in.clear();
      c.deadline = now + kAnswerDeadline;
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(), [](const auto& c) { return c.fd < 0; }),
                      connections.end());
    if (!(polled[1].revents & POLLIN)) continue;
    for (int fd; (fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
      if (connections.size() >= kMostConnections) {  // the oldest goes: a flood cannot keep newcomers out
        ::close(connections.front().fd);
        connections.erase(connections.begin());
      }
      connections.push_back({fd, now + kRequestDeadline, {}, {}, 0});
    }
  }
  for (auto& c : connections) ::close(c.fd);
}

std::string ViewServer::url() const {
  const std::string host = bind_ == "0.0.0.0" ? "127.0.0.1" : bind_;
  return fmt::format("http://{}:{}/?key={}", host, port_, key_);
}

}  // namespace noloco
