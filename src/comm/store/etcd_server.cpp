#include "comm/store/etcd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/store/etcd_store.h"
#include "comm/store/run_keys.h"
#include "util/error_text.h"
#include "util/log.h"
#include "util/files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

const char* kDirPrefix = "noloco-etcd-";  // noloco-etcd-<launcher pid>-XXXXXX

}  // namespace

int free_port(const std::string& bind) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, bind.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    throw std::runtime_error(fmt::format("bind={} is not an IPv4 address of this machine", bind));
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("cannot listen on bind={}: {}", bind, std::strerror(err)));
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

namespace {

void remove_leftovers(const std::string& root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const auto name = entry.path().filename().string();
    if (name.rfind(kDirPrefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + std::strlen(kDirPrefix), nullptr, 10);
    if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove_all(entry.path(), ec);
  }
}

std::string tail_of(const std::string& path) {
  try {
    const auto text = read_file(path);
    return text.substr(text.size() > 400 ? text.size() - 400 : 0);
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

std::string EtcdServer::binary() {
  if (const char* e = std::getenv("NOLOCO_ETCD")) return ::access(e, X_OK) == 0 ? e : "";
  if (const char* path = std::getenv("PATH")) {
    std::string p = path;
    for (size_t start = 0; start <= p.size();) {
      const size_t end = std::min(p.find(':', start), p.size());
      const auto candidate = p.substr(start, end - start) + "/etcd";
      if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate;
      start = end + 1;
    }
  }
  return ::access("/usr/bin/etcd", X_OK) == 0 ? "/usr/bin/etcd" : "";
}

std::string EtcdServer::temp_root() {
  for (const char* d : {"/dev/shm", "/tmp"})
    if (::access(d, W_OK) == 0) return d;
  return fs::temp_directory_path().string();
}

void EtcdServer::make_directory(const std::string& kept) {
  if (!kept.empty()) {
    std::error_code ec;
    fs::create_directories(kept, ec);
    if (ec || ::chmod(kept.c_str(), 0700) != 0)
      throw std::runtime_error(fmt::format("cannot make the store's directory {}: {}", kept,
                                           ec ? ec.message() : std::strerror(errno)));
    dir_ = kept;
    kept_ = true;
    // A killed store's sockets stay behind, and etcd will not listen where a file is.
    for (const char* socket : {"client.sock:1", "peer.sock:1"}) fs::remove(dir_ + "/" + socket, ec);
    return;
  }
  const auto root = temp_root();
  remove_leftovers(root);
  std::string tmpl = fmt::format("{}/{}{}-XXXXXX", root, kDirPrefix, ::getpid());
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error(fmt::format("cannot create {}: {}", tmpl, std::strerror(errno)));
  dir_ = tmpl;
  ::chmod(dir_.c_str(), 0700);  // mkdtemp's already; said again because the sockets' privacy rests on it
}

// etcd names a unix socket "unix://NAME:PORT" and creates the file NAME:PORT in its working directory.
constexpr const char* kClientSocket = "client.sock:1";

// A start that failed or was interrupted (a signal while a cluster formed)
// leaves no etcd running and, unless kept, no data: no destructor runs.
template <class Start>
void EtcdServer::stop_if_thrown(Start start) {
  try {
    start();
  } catch (...) {
    stop();
    throw;
  }
}

EtcdServer::EtcdServer(const std::string& password, bool (*interrupted)()) {
  make_directory();
  endpoint_ = fmt::format("unix://{}/{}", dir_, kClientSocket);
  stop_if_thrown([&] {
    start(fmt::format("unix://{}", kClientSocket), endpoint_, password, interrupted, /*enable_auth=*/true);
  });
}


EtcdServer::EtcdServer(const std::string& bind, int port, const std::string& password, const StoreTlsKey* tls,
                       bool (*interrupted)(), const EtcdClusterMember* cluster, const std::string& data_dir) {
  if (cluster && !tls) throw std::logic_error("a store cluster's member needs the TLS key (its peers' too)");
  port_ = port > 0 ? port : free_port(bind);
  make_directory(data_dir);
  stop_if_thrown([&] {
    if (tls) write_certificate(*tls);  // a cluster's peers present it from the first start on
    // Authentication is on before the client port opens: etcd first serves
    // the private socket alone (a cluster forms over its peer ports meanwhile,
    // and whichever member gets there first switches it on for all).
    const std::string private_endpoint = fmt::format("unix://{}/{}", dir_, kClientSocket);
    start(fmt::format("unix://{}", kClientSocket), private_endpoint, password, interrupted, /*enable_auth=*/true,
          /*tls=*/nullptr, cluster);
    stop_process();
    endpoint_ = fmt::format("{}://{}:{}", tls ? "https" : "http", bind, port_);
    start(endpoint_, endpoint_, password, interrupted, /*enable_auth=*/false, tls, cluster);
  });
}

void EtcdServer::write_certificate(const StoreTlsKey& tls) {
  const std::string key = dir_ + "/store.key", cert = dir_ + "/store.crt";
  {
    const int fd = ::open(key.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const bool written = fd >= 0 && ::write(fd, tls.private_key_pem.data(), tls.private_key_pem.size()) ==
                                        ssize_t(tls.private_key_pem.size());
    if (fd >= 0) ::close(fd);
    if (!written) throw std::runtime_error(fmt::format("cannot write the store's TLS key to {}", key));
  }
  // Self-signed: clients trust the key (pinned), not a signature on it.
  write_file_atomic(cert, tls.certificate_pem);
  if (!tls.peer_certificate_pem.empty()) write_file_atomic(dir_ + "/peer.crt", tls.peer_certificate_pem);
}

void EtcdServer::turn_on_authentication(const std::string& endpoint, const std::string& password) {
  try {
    const EtcdStore root(endpoint, "root", password, std::chrono::milliseconds(2000));
    return;  // on already: an earlier call's enable went through, its reply did not
  } catch (const std::exception&) {
  }
  EtcdStore admin(endpoint, "", "", std::chrono::milliseconds(2000));
  try {
    admin.request("/v3/auth/user/add", nlohmann::json{{"name", "root"}, {"password", password}}.dump());
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("user name already exists") == std::string::npos) throw;
  }
  admin.request("/v3/auth/user/grant", R"({"user":"root","role":"root"})");  // etcd ignores a second grant
  admin.request("/v3/auth/enable", "{}");
}

void EtcdServer::start(const std::string& client_url, const std::string& endpoint, const std::string& password,
                       bool (*interrupted)(), bool enable_auth, const StoreTlsKey* tls,
                       const EtcdClusterMember* cluster) {
  client_url_ = client_url;
  password_ = password;
  interrupted_ = interrupted;
  if (tls) tls_ = *tls;
  in_cluster_ = cluster != nullptr;
  const auto exe = binary();
  if (exe.empty()) {
    stop();
    throw std::runtime_error("the run's store is an etcd, and no etcd was found (install etcd-server, or set "
                             "NOLOCO_ETCD)");
  }
  const std::string peer = "unix://peer.sock:1";  // a socket file in dir_, not a port
  std::vector<std::string> args = {exe,
                                   "--name=" + (cluster ? cluster->name : "noloco"),
                                   "--data-dir=" + dir_ + "/data",
                                   "--listen-client-urls=" + client_url,
                                   "--advertise-client-urls=" + client_url,
                                   "--listen-peer-urls=" + (cluster ? cluster->listen_peer_url : peer),
                                   "--initial-advertise-peer-urls=" + (cluster ? cluster->peer_url : peer),
                                   "--initial-cluster=" + (cluster ? cluster->members : "noloco=" + peer),
                                   "--auto-compaction-mode=revision",
                                   "--auto-compaction-retention=100000",
                                   "--quota-backend-bytes=536870912",
                                   // The password is derived from the run token (Argon2id, 256 bits):
                                   // bcrypt's default cost 10 made every login ~60 ms of the store's
                                   // CPU and protected nothing a guess could reach.
                                   "--bcrypt-cost=4",
                                   "--logger=zap",
                                   "--log-level=error"};
  if (tls) {
    args.push_back("--cert-file=store.crt");  // in dir_, etcd's working directory
    args.push_back("--key-file=store.key");
    // Only token holders get past the handshake: their certificate is this one.
    args.push_back("--client-cert-auth");
    args.push_back("--trusted-ca-file=store.crt");
  }
  if (cluster) {
    args.push_back("--initial-cluster-token=" + cluster->cluster_token);
    args.push_back("--peer-cert-file=peer.crt");
    args.push_back("--peer-key-file=store.key");
    args.push_back("--peer-client-cert-auth");
    args.push_back("--peer-trusted-ca-file=peer.crt");
  }
  const std::string log = dir_ + "/etcd.log";
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the store dies with its host
    ::setpgid(0, 0);                     // and does not take the host's Ctrl-C before the host does
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    if (::chdir(dir_.c_str()) != 0) ::_exit(127);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  // Up within 20 s: authentication is switched on (first start), or a login
  // works (restart). A cluster's member waits for a majority of the others.
  const auto deadline = std::chrono::steady_clock::now() + (cluster ? std::chrono::seconds(600) : std::chrono::seconds(20));
  std::string last_error;
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      const auto why = tail_of(log);
      stop();
      throw std::runtime_error(fmt::format("etcd did not start on {}: {}", endpoint, why));
    }
    try {
      if (enable_auth) {
        turn_on_authentication(endpoint, password);
      } else {
        const EtcdStore login(endpoint, "root", password, std::chrono::milliseconds(2000), tls ? *tls : StoreTlsKey{});
      }
      return;
    } catch (const std::exception& e) {
      last_error = e.what();
    }
    if (interrupted && interrupted()) {
      stop();
      throw Interrupted(SIGINT);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      stop();
      throw std::runtime_error(fmt::format("etcd on {} did not come up within {} s{}: {}", endpoint,
                                           cluster ? 600 : 20, cluster ? " (a majority of the cluster's members)" : "",
                                           last_error));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

EtcdServer::~EtcdServer() { stop(); }

void EtcdServer::stop() {
  stop_process();
  std::error_code ec;
  if (!dir_.empty() && !kept_) fs::remove_all(dir_, ec);
  dir_.clear();
}

void EtcdServer::restart() {
  if (in_cluster_) throw std::logic_error("a store cluster's member is not restarted alone");
  stop_process();
  ended_.reset();
  std::error_code ec;
  for (const char* socket : {"client.sock:1", "peer.sock:1"}) fs::remove(dir_ + "/" + socket, ec);
  // Authentication is on in its data already: a login as root says it is up.
  start(client_url_, endpoint_, password_, interrupted_, /*enable_auth=*/false, tls_ ? &*tls_ : nullptr);
}

bool EtcdServer::restart_if_ended(const std::string& prefix, const std::string& meanwhile) {
  const auto how = exited();
  if (!how) return true;
  spdlog::error("{}the run's store (etcd) {}: starting it again on its data; {}", prefix, *how, meanwhile);
  try {
    restart();
    spdlog::info("{}the run's store is back", prefix);
    return true;
  } catch (const std::exception& e) {
    spdlog::error("{}the run's store did not start again ({}); {}", prefix, error_text(e), meanwhile);
    return false;
  }
}

void EtcdServer::remove_data() {
  kept_ = false;
  stop();
}

std::optional<std::string> EtcdServer::exited() {
  if (pid_ <= 0) return ended_;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  pid_ = -1;
  ended_ = WIFSIGNALED(status) ? fmt::format("killed by signal {}", WTERMSIG(status))
                               : fmt::format("exited with status {}", WEXITSTATUS(status));
  return ended_;
}

void EtcdServer::stop_process() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
}

}  // namespace noloco
