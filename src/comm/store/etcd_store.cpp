#include "comm/store/etcd_store.h"

#include <curl/curl.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/store/store_outage.h"
#include "comm/store/store_traffic.h"
#include "util/parse_number.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& in) {
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out.push_back(kAlphabet[(v >> s) & 63]);
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  uint32_t v = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const char* p = std::strchr(kAlphabet, c);
    if (!p || !*p) throw std::runtime_error("etcd sent malformed base64");
    v = (v << 6) | uint32_t(p - kAlphabet);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((v >> bits) & 0xff));
    }
  }
  return out;
}

int64_t number(const Json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return 0;
  return it->is_string() ? std::stoll(it->get<std::string>()) : it->get<int64_t>();
}

size_t append_body(char* data, size_t size, size_t count, void* body) {
  static_cast<std::string*>(body)->append(data, size * count);
  return size * count;
}

void curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// Cluster members that a connection of this process found hung, and when:
// the process's other connections (a worker has several) skip them for a
// while instead of each paying the wait to find out.
class HungMembers {
 public:
  void mark(const std::string& member) {
    std::lock_guard<std::mutex> lock(mutex_);
    since_[member] = Clock::now();
  }
  bool recently(const std::string& member) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = since_.find(member);
    return it != since_.end() && Clock::now() - it->second < std::chrono::seconds(30);
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::string, Clock::time_point> since_;
};

HungMembers& hung_members() {
  static HungMembers members;
  return members;
}

std::string as_string(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
std::vector<uint8_t> as_bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Where EtcdStore::add leaves its mark for `key`: after every key a caller
// makes (theirs are text; the run's scopes hex), so that getNumKeys can leave marks out.
std::string add_mark_key(const std::string& key) { return "\xff" "add mark/" + key; }

}  // namespace

constexpr long kConnectTimeoutMs = 10000;

struct EtcdStore::Http {
  std::string endpoint, user, password, token;
  StoreTlsKey tls;  // with a pin: the only TLS key this store may present, and what this client presents
  // What request paths are appended to: one per member of an etcd cluster,
  // the one in use first; a member that cannot be reached hands over to the next.
  std::vector<std::string> bases;
  std::string unix_socket;  // the socket's path for a unix:// endpoint, else empty
  std::chrono::milliseconds timeout;
  CURL* curl = nullptr;

  ~Http() {
    if (curl) curl_easy_cleanup(curl);
  }

  void common(CURL* c, const std::string& path, const std::string& body, curl_slist* headers, long timeout_ms) const {
    curl_easy_setopt(c, CURLOPT_URL, (bases.front() + path).c_str());
    if (!unix_socket.empty()) curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, unix_socket.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, long(body.size()));
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    // A store whose host is gone (no reset comes) would hold each request
    // the whole timeout; a connection takes well under a second.
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::min(timeout_ms, kConnectTimeoutMs));
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    if (const char* ca = std::getenv("NOLOCO_STORE_CA")) curl_easy_setopt(c, CURLOPT_CAINFO, ca);
    if (!tls.pin.empty()) {
      // The key is the identity: no certificate authority vouches for a
      // self-signed certificate, the pin (derived from the token) does.
      curl_easy_setopt(c, CURLOPT_PINNEDPUBLICKEY, tls.pin.c_str());
      curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    if (!tls.certificate_pem.empty()) {
      // curl copies the blobs (CURL_BLOB_COPY).
      curl_blob certificate{const_cast<char*>(tls.certificate_pem.data()), tls.certificate_pem.size(),
                            CURL_BLOB_COPY};
      curl_blob key{const_cast<char*>(tls.private_key_pem.data()), tls.private_key_pem.size(), CURL_BLOB_COPY};
      curl_easy_setopt(c, CURLOPT_SSLCERT_BLOB, &certificate);
      curl_easy_setopt(c, CURLOPT_SSLCERTTYPE, "PEM");
      curl_easy_setopt(c, CURLOPT_SSLKEY_BLOB, &key);
      curl_easy_setopt(c, CURLOPT_SSLKEYTYPE, "PEM");
    }
  }

  curl_slist* headers() const {
    curl_slist* h = curl_slist_append(nullptr, "Content-Type: application/json");
    if (!token.empty()) h = curl_slist_append(h, ("Authorization: " + token).c_str());
    return h;
  }

  // A cluster electing a leader (its leader died) answers with these for a
  // moment: asked again until the timeout, as etcd's own client does.
  static bool electing(const Json& j) {
    const std::string error = j.value("message", "");
    return error.find("leader changed") != std::string::npos || error.find("no leader") != std::string::npos ||
           error.find("request timed out") != std::string::npos;
  }

  Json post_once(const std::string& path, const Json& request) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      auto j = perform(path, request);
      if (!electing(j) || Clock::now() > deadline) return j;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // With several members, how long one may take before it counts as hung and
  // the request goes to the next (every request here is safe to repeat:
  // writes are puts, or compare-and-sets read back). A healthy member answers
  // in a Raft round; a stopped one (SIGSTOP, a paused VM) never does, and
  // waiting `timeout` for it had frozen every worker as long as it was stopped.
  static constexpr std::chrono::milliseconds kHungMember{3000};
  static constexpr std::chrono::milliseconds kOutageProbe{2000};

  CURLcode attempt(const std::string& path, const std::string& body, std::string& response,
                   std::chrono::milliseconds wait) {
    response.clear();
    curl_slist* h = headers();
    curl_easy_reset(curl);
    common(curl, path, body, h, long(std::max<int64_t>(100, wait.count())));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response);
    const CURLcode rc = curl_easy_perform(curl);
    curl_slist_free_all(h);
    count_store_request(response.size());
    return rc;
  }

  static long status_of(CURL* c) {
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    return status;
  }

  Json perform(const std::string& path, const Json& request) {
    const std::string body = request.dump();
    const auto deadline = Clock::now() + timeout;
    std::string response;
    for (size_t skipped = 1; skipped < bases.size() && hung_members().recently(bases.front()); ++skipped)
      next_member();
    // While the store is away, a request is a probe: one that reached a
    // store still coming up (its port open, not serving yet) had held its
    // caller, the heartbeat that finds the store back, the whole timeout.
    const auto lone_wait = store_outage().ongoing() ? std::min(timeout, kOutageProbe) : timeout;
    for (size_t tries = 1;; ++tries) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      CURLcode rc = attempt(path, body, response, bases.size() > 1 ? std::min(left, kHungMember) : lone_wait);
      // A lone store's request that timed out is asked once more: a process
      // stopped for a while (SIGSTOP, a VM paused) finds its timer run out on
      // waking, though the store never failed it. (A cluster asks the next member.)
      if (rc == CURLE_OPERATION_TIMEDOUT && bases.size() == 1) rc = attempt(path, body, response, lone_wait);
      if (rc == CURLE_OK) break;
      if (rc == CURLE_SSL_PINNEDPUBKEYNOTMATCH && !store_outage().ever_reached())
        throw StoreRefused(fmt::format("could not join the run's store at {}: its TLS key is not the one "
                                       "NOLOCO_RUN_TOKEN gives (another run's token, or another run's store there)",
                                       endpoint));
      if (!unreachable(rc)) throw std::runtime_error(fmt::format("store at {}: {}", endpoint, curl_easy_strerror(rc)));
      if (bases.size() < 2 || Clock::now() >= deadline) throw_unreachable(curl_easy_strerror(rc));
      if (rc == CURLE_OPERATION_TIMEDOUT) hung_members().mark(bases.front());
      next_member();
      // Every member down at once: ask again, but not in a busy loop.
      if (tries % bases.size() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    store_outage().reached();
    auto j = Json::parse(response, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      throw std::runtime_error(fmt::format("store at {}: not an etcd answer to {} (HTTP {}: {:.120})", endpoint, path,
                                           status_of(curl), response));
    return j;
  }

  [[noreturn]] void throw_unreachable(const std::string& why) const {
    const auto what = fmt::format("store at {}: {}", endpoint, why);
    store_outage().unreachable(what);
    throw StoreUnreachable(what);
  }

  // A member that died: also mid-handshake over TLS (the reset comes as an
  // SSL connect error). A store with another key where the run's answered
  // before is not the run's: its serve restarted with another token, or
  // something else took the port, and the run's may come back.
  static bool unreachable(CURLcode rc) {
    return rc == CURLE_COULDNT_CONNECT || rc == CURLE_OPERATION_TIMEDOUT || rc == CURLE_SEND_ERROR ||
           rc == CURLE_RECV_ERROR || rc == CURLE_GOT_NOTHING || rc == CURLE_PARTIAL_FILE ||
           rc == CURLE_SSL_CONNECT_ERROR || rc == CURLE_SSL_PINNEDPUBKEYNOTMATCH;
  }

  // Moves on to the next cluster member (and logs in there: etcd's simple
  // auth tokens live in one member).
  void next_member() {
    std::rotate(bases.begin(), bases.begin() + 1, bases.end());
    if (!user.empty() && !authenticating) {
      authenticating = true;
      try {
        authenticate();
      } catch (...) {
        authenticating = false;
        throw;
      }
      authenticating = false;
    }
  }
  bool authenticating = false;

  void authenticate() {
    token.clear();
    const auto j = post_once("/v3/auth/authenticate", {{"name", user}, {"password", password}});
    if (!j.contains("token")) {
      // Only a refused password is the token's fault; a cluster without quorum fails logins too.
      const std::string why = j.value("message", "refused");
      throw StoreRefused(fmt::format("could not join the run's store at {}{}: {}", endpoint,
                                           why.find("authentication failed") != std::string::npos
                                               ? " (wrong NOLOCO_RUN_TOKEN?)"
                                               : "",
                                           why));
    }
    token = j["token"].get<std::string>();
  }

  Json post(const std::string& path, const Json& request) {
    auto j = post_once(path, request);
    const std::string error = j.value("message", "");
    if (!user.empty() && error.find("invalid auth token") != std::string::npos) {
      authenticate();  // simple tokens expire: take a new one and try again
      j = post_once(path, request);
    }
    if (j.contains("error"))
      throw std::runtime_error(fmt::format("store at {}: {}", endpoint, j.value("message", j["error"].dump())));
    return j;
  }

  // Streams the watch of `key` from `revision` until it is put (true), or
  // `deadline` passes (false; never before it: curl's timer may fire a little
  // early, and the watch is then resumed for what is left).
  bool watch_put(const std::string& key, int64_t revision, Clock::time_point deadline) {
    struct Stream {
      std::string pending;
      bool put = false, failed = false, hung = false;
      std::string why;
      uint64_t bytes = 0;
      Http* http = nullptr;
      Clock::time_point heard = Clock::now();
    } stream;
    stream.http = this;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    CURL* w = curl_easy_init();
    const std::string body =
        Json{{"create_request", {{"key", base64(key)}, {"start_revision", std::to_string(revision)}}}}.dump();
    curl_slist* h = headers();
    common(w, "/v3/watch", body, h, long(left));
    curl_easy_setopt(w, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t count, void* user) -> size_t {
      auto& s = *static_cast<Stream*>(user);
      s.heard = Clock::now();
      s.bytes += size * count;
      s.pending.append(data, size * count);
      for (size_t end; (end = s.pending.find('\n')) != std::string::npos;) {
        const auto line = Json::parse(s.pending.substr(0, end), nullptr, false);
        s.pending.erase(0, end + 1);
        if (line.is_discarded()) continue;
        if (line.contains("error")) {
          s.failed = true;
          s.why = line.value("message", line["error"].dump());
          return 0;
        }
        const auto& result = line.value("result", Json::object());
        for (const auto& e : result.value("events", Json::array()))
          if (e.value("type", "PUT") == "PUT") s.put = true;
        if (s.put || result.value("canceled", false)) return 0;  // stop the stream
      }
      return size * count;
    });
    curl_easy_setopt(w, CURLOPT_WRITEDATA, &stream);
    if (bases.size() > 1) {
      // A watch is quiet until its key is put, and a hung member (stopped,
      // its machine paused) keeps its connection open: so while it is quiet,
      // the member is asked something small every second (a count, well
      // under a millisecond), and one that does not answer within
      // kHungMember is left for the next, as requests are.
      using Quiet = int (*)(void*, curl_off_t, curl_off_t, curl_off_t, curl_off_t);
      const Quiet when_quiet = [](void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
        auto& s = *static_cast<Stream*>(user);
        if (Clock::now() - s.heard < std::chrono::seconds(1)) return 0;
        std::string answer;
        const auto probe = Json{{"key", base64("noloco/alive")}, {"count_only", true}}.dump();
        s.hung = s.http->attempt("/v3/kv/range", probe, answer, kHungMember) != CURLE_OK;
        if (s.hung) hung_members().mark(s.http->bases.front());
        s.heard = Clock::now();
        return s.hung ? 1 : 0;  // non-zero ends the transfer
      };
      curl_easy_setopt(w, CURLOPT_NOPROGRESS, 0L);
      curl_easy_setopt(w, CURLOPT_XFERINFODATA, &stream);
      curl_easy_setopt(w, CURLOPT_XFERINFOFUNCTION, when_quiet);
    }
    const CURLcode rc = curl_easy_perform(w);
    curl_slist_free_all(h);
    curl_easy_cleanup(w);
    count_store_request(stream.bytes);
    if (stream.put) return true;
    if (stream.failed && !user.empty() && stream.why.find("invalid auth token") != std::string::npos) {
      authenticate();  // a restarted store knows no token it gave before
      return watch_put(key, revision, deadline);
    }
    if (stream.failed) throw std::runtime_error(fmt::format("store at {}: watch failed: {}", endpoint, stream.why));
    if (rc == CURLE_OPERATION_TIMEDOUT) return Clock::now() < deadline && watch_put(key, revision, deadline);
    if ((unreachable(rc) || stream.hung) && bases.size() > 1 && Clock::now() < deadline) {  // the same revision, elsewhere
      next_member();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return watch_put(key, revision, deadline);
    }
    if (unreachable(rc) || stream.hung) throw_unreachable(fmt::format("watch ended: {}", curl_easy_strerror(rc)));
    throw std::runtime_error(fmt::format("store at {}: watch ended: {}", endpoint, curl_easy_strerror(rc)));
  }
};

EtcdStore::EtcdStore(std::string endpoint, std::string user, std::string password, std::chrono::milliseconds timeout,
                     StoreTlsKey tls)
    : c10d::Store(timeout), endpoint_(std::move(endpoint)), http_(std::make_unique<Http>()) {
  curl_once();
  http_->endpoint = endpoint_;
  http_->tls = std::move(tls);
  constexpr std::string_view kUnix = "unix://";
  if (endpoint_.rfind(kUnix, 0) == 0) {
    http_->unix_socket = endpoint_.substr(kUnix.size());
    http_->bases = {"http://localhost"};
  } else {
    http_->bases = comma_separated(endpoint_);
    if (http_->bases.empty()) throw std::invalid_argument("store: no endpoint given");
  }
  http_->user = std::move(user);
  http_->password = std::move(password);
  http_->timeout = timeout;
  http_->curl = curl_easy_init();
  if (!http_->curl) throw std::runtime_error("cannot start an HTTP client (libcurl)");
  if (!http_->user.empty()) http_->authenticate();
}

EtcdStore::~EtcdStore() = default;

c10::intrusive_ptr<c10d::Store> EtcdStore::clone() {
  return c10::make_intrusive<EtcdStore>(endpoint_, http_->user, http_->password, timeout_, http_->tls);
}

EtcdStore::Value EtcdStore::read(const std::string& key) {
  const auto j = http_->post("/v3/kv/range", {{"key", base64(key)}});
  Value v;
  v.header_revision = number(j.value("header", Json::object()), "revision");
  const auto kvs = j.value("kvs", Json::array());
  if (kvs.empty()) return v;
  v.exists = true;
  v.value = unbase64(kvs[0].value("value", ""));
  v.mod_revision = number(kvs[0], "mod_revision");
  return v;
}

void EtcdStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  http_->post("/v3/kv/put", {{"key", base64(key)}, {"value", base64(as_string(value))}});
}

std::vector<uint8_t> EtcdStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  const auto k = base64(key);
  const auto put = Json::array({{{"request_put", {{"key", k}, {"value", base64(as_string(desired))}}}}});
  const auto range = Json::array({{{"request_range", {{"key", k}}}}});
  // Holding exactly `expected`: write; either way read back. An empty
  // `expected` matches an absent key and, as in TCPStore, a key holding the
  // empty value (a list emptied by remove_item): the second is compared by
  // revision, since etcd's VALUE compare cannot name an empty value reliably.
  Json compare = expected.empty()
                     ? Json{{"target", "CREATE"}, {"key", k}, {"create_revision", "0"}, {"result", "EQUAL"}}
                     : Json{{"target", "VALUE"}, {"key", k}, {"value", base64(as_string(expected))}, {"result", "EQUAL"}};
  // Bounded: each round either writes or finds the key changed under it.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto j = http_->post("/v3/kv/txn", {{"compare", Json::array({compare})}, {"success", put}, {"failure", range}});
    if (j.value("succeeded", false)) return desired;
    const auto& responses = j.value("responses", Json::array());
    const auto kvs = responses.empty()
                         ? Json::array()
                         : responses[0].value("response_range", Json::object()).value("kvs", Json::array());
    // TCPStore's answer for an absent key and a non-empty `expected`: `expected` itself.
    if (kvs.empty()) {
      if (!expected.empty()) return expected;
      continue;  // deleted meanwhile: create it
    }
    auto value = as_bytes(unbase64(kvs[0].value("value", "")));
    if (!expected.empty() || !value.empty()) return value;
    compare = Json{{"target", "MOD"}, {"key", k}, {"mod_revision", std::to_string(number(kvs[0], "mod_revision"))},
                   {"result", "EQUAL"}};
  }
  throw std::runtime_error(fmt::format("store at {}: compare-and-set of a key kept changing for 1000 rounds", endpoint_));
}

std::vector<uint8_t> EtcdStore::get(const std::string& key) {
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    const auto v = read(key);
    if (v.exists) return as_bytes(v.value);
    if (!http_->watch_put(key, v.header_revision + 1, deadline))
      throw std::runtime_error(fmt::format("store at {}: timed out after {} ms waiting for a key", endpoint_,
                                           timeout_.count()));
  }
}

int64_t EtcdStore::add(const std::string& key, int64_t value) {
  const auto k = base64(key);
  // A compare-and-set is asked again at the next member when the one asked
  // died before it answered: the first may have gone through, and its
  // repeat then fails the compare. Reading on and adding again counted the
  // add twice (a NoLoCo arrival counter at 2 reads "given up": the two
  // replicas went alone, or each waited for the other at another exchange).
  // So each add leaves its mark (add_mark_key), in the same transaction, and
  // a failed compare that finds this add's mark has its answer.
  const auto mark_key = base64(add_mark_key(key));
  const auto mark = fmt::format("{:016x}{:016x}", std::random_device{}(), uint64_t(Clock::now().time_since_epoch().count()));
  for (;;) {
    const auto current = read(key);
    if (current.exists && value == 0) return std::stoll(current.value);  // a read: nothing to write
    const int64_t next = (current.exists ? std::stoll(current.value) : 0) + value;
    const Json compare = current.exists ? Json{{"target", "MOD"}, {"key", k},
                                               {"mod_revision", std::to_string(current.mod_revision)},
                                               {"result", "EQUAL"}}
                                        : Json{{"target", "CREATE"}, {"key", k}, {"create_revision", "0"},
                                               {"result", "EQUAL"}};
    const auto j = http_->post(
        "/v3/kv/txn",
        {{"compare", Json::array({compare})},
         {"success", Json::array({{{"request_put", {{"key", k}, {"value", base64(std::to_string(next))}}}},
                                  {{"request_put", {{"key", mark_key}, {"value", base64(mark + " " + std::to_string(next))}}}}})},
         {"failure", Json::array({{{"request_range", {{"key", mark_key}}}}})}});
    if (j.value("succeeded", false)) return next;
    // Another writer came first (read again), unless the mark is this add's own.
    for (const auto& r : j.value("responses", Json::array()))
      for (const auto& kv : r.value("response_range", Json::object()).value("kvs", Json::array())) {
        const auto text = unbase64(kv.value("value", ""));
        if (text.rfind(mark + " ", 0) == 0) return std::stoll(text.substr(mark.size() + 1));
      }
  }
}

bool EtcdStore::deleteKey(const std::string& key) {
  const auto j = http_->post("/v3/kv/txn", {{"success", Json::array({{{"request_delete_range", {{"key", base64(key)}}}},
                                                                     {{"request_delete_range",
                                                                       {{"key", base64(add_mark_key(key))}}}}})}});
  const auto responses = j.value("responses", Json::array());
  return !responses.empty() && number(responses[0].value("response_delete_range", Json::object()), "deleted") > 0;
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  if (keys.empty()) return true;
  Json ranges = Json::array();
  for (const auto& key : keys) ranges.push_back({{"request_range", {{"key", base64(key)}, {"count_only", true}}}});
  const auto j = http_->post("/v3/kv/txn", {{"success", ranges}});
  for (const auto& r : j.value("responses", Json::array()))
    if (number(r.value("response_range", Json::object()), "count") == 0) return false;
  return true;
}

int64_t EtcdStore::getNumKeys() {
  // Every key but the adds' marks, which sort after every key a caller can make.
  const std::string all(1, '\0'), marks = add_mark_key("");
  const auto count = [&](const std::string& from) {
    return number(http_->post("/v3/kv/range", {{"key", base64(from)}, {"range_end", base64(all)}, {"count_only", true}}),
                  "count");
  };
  return count(all) - count(marks);
}

std::string EtcdStore::request(const std::string& path, const std::string& json_body) {
  const auto body = Json::parse(json_body, nullptr, false);
  if (body.is_discarded()) throw std::invalid_argument("etcd request body is not JSON: " + json_body);
  return http_->post(path, body).dump();
}

bool EtcdStore::wait_for(const std::string& key, Clock::time_point deadline) {
  for (;;) {
    const auto v = read(key);
    if (v.exists) return true;
    if (!http_->watch_put(key, v.header_revision + 1, deadline)) return false;
  }
}

void EtcdStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void EtcdStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = Clock::now() + timeout;
  for (const auto& key : keys)
    if (!wait_for(key, deadline))
      throw std::runtime_error(fmt::format("store at {}: wait timed out after {} ms", endpoint_, timeout.count()));
}

}  // namespace noloco
