// Helpers shared by the tests: temporary directories and running the CLI.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <thread>
#include <map>
#include <utility>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <exception>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "comm/link/link.h"
#include "comm/store/etcd_server.h"
#include "wire/message.h"

namespace noloco::testing {

// What one message of `payload` bytes costs on a sealed link
// (comm/link/link.h): its header's frame and its payload's frames.
inline uint64_t sealed_message(uint64_t payload) {
  return Link::wire_bytes(MessageHeader::kBytes, true) + Link::wire_bytes(payload, true);
}
// What a link adds once at each end: its sealed stream's header.
constexpr uint64_t kLinkStart = Link::kStreamHeaderBytes;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "noloco_test_XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// What `f` threw (its what()), or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// The URL of the live page's data, from the page's URL that a command printed.
inline std::string state_url_of(const std::string& page_url) {
  return page_url.substr(0, page_url.find("/?key=")) + "/state.json" + page_url.substr(page_url.find("?key="));
}

// The first `bytes` of the bundled corpus.
inline std::string shakespeare(size_t bytes) {
  return read_text(std::string(NOLOCO_SOURCE_DIR) + "/data/tinyshakespeare.txt").substr(0, bytes);
}

// A loopback TCP port that was free a moment ago (the kernel's choice).
inline int free_port() { return noloco::free_port("127.0.0.1"); }

// A TCP connection to 127.0.0.1:port (its receives bounded at 5 s), or -1.
inline int connect_to_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  timeval bound{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  return fd;
}

struct CliResult {
  int exit_code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line in the source directory with a hard time limit,
// so a hang fails the test instead of CI. `env` is prepended as VAR=value assignments.
inline CliResult run_command(const std::string& command, int timeout_s, const std::string& env = "") {
  const std::string cmd = "cd " NOLOCO_SOURCE_DIR " && " + env + " timeout -k 5 " + std::to_string(timeout_s) + " " +
                          command + " 2>&1";
  CliResult r{-1, ""};
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Runs tests/python/ecosystem.py with `args` in the project's Python (the
// real transformers, tokenizers, safetensors and TensorBoard, pinned in
// requirements-dev.txt), offline: nothing may come from a hub.
inline CliResult run_ecosystem(const std::string& args, int timeout_s = 180) {
  return run_command(NOLOCO_TORCH_PYTHON " " NOLOCO_SOURCE_DIR "/tests/python/ecosystem.py " + args, timeout_s,
                     "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false");
}

// Runs build/noloco with `args` (run_command's limit and environment).
inline CliResult run_cli(const std::string& args, int timeout_s = 120, const std::string& env = "") {
  return run_command(NOLOCO_BINARY " " + args, timeout_s, env);
}

// A `noloco` command running on its own thread while the test acts on the
// run (kills a worker, sends a signal); wait() joins it.
class BackgroundCli {
 public:
  BackgroundCli(const std::string& args, int timeout_s, const std::string& env = "")
      : thread_([this, args, timeout_s, env] { result_ = run_cli(args, timeout_s, env); }) {}
  ~BackgroundCli() {
    if (thread_.joinable()) thread_.join();
  }
  const CliResult& wait() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  CliResult result_;
  std::thread thread_;
};

// `train` arguments for a small, fast model on `data`, writing to `out`.
inline std::string small_train_args(const std::string& data, const std::string& out) {
  return "train configs/shakespeare.yaml data=" + data + " out=" + out +
         " hidden=32 layers=2 heads=2 intermediate=64 context=32 warmup=2 eval_interval=1000"
         " eval_batches=2 log_interval=1 sample_tokens=0 peer_timeout=30";
}

// The records of one split ("train", "val", "outer") of a run's metrics.jsonl;
// of a run still going, the complete lines written so far.
inline std::vector<nlohmann::json> metrics_records(const std::string& run, const std::string& split) {
  std::vector<nlohmann::json> out;
  auto text = read_text(run + "/metrics.jsonl");
  text.resize(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["split"] == split) out.push_back(j);
  }
  return out;
}

// Training losses of a run by (replica, step), from the workers that compute
// the loss (a pipeline's last stage); a resumed run's later records win.
inline std::map<std::pair<int, int64_t>, double> train_losses(const std::string& run) {
  std::map<std::pair<int, int64_t>, double> out;
  for (auto& r : metrics_records(run, "train"))
    if (r.contains("loss")) out[{r["replica"].get<int>(), r["step"].get<int64_t>()}] = r["loss"].get<double>();
  return out;
}

// Expects two runs to have logged the same `records` train losses, bit for
// bit (a run stopped and resumed against one that never stopped).
inline void expect_same_train_losses(const std::string& a_run, const std::string& b_run, size_t records) {
  const auto a = train_losses(a_run), b = train_losses(b_run);
  ASSERT_EQ(a.size(), records);
  ASSERT_EQ(b.size(), records);
  for (auto& [key, loss] : a) EXPECT_EQ(b.at(key), loss) << "replica " << key.first << " step " << key.second;
}

// Tests that launch `train` runs of the small model on a Shakespeare sample in a temporary directory.
class LaunchedRuns : public ::testing::Test {
 protected:
  void SetUp() override { write_text(dir / "c.txt", shakespeare(20000)); }
  // Trains into dir/name with `extra` overrides, expecting exit 0 within run_timeout_s; returns the run directory.
  std::string run(const std::string& name, const std::string& extra) {
    auto r = run_cli(small_train_args(dir / "c.txt", dir / name) + " " + extra, run_timeout_s);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return dir / name;
  }
  int run_timeout_s = 120;
  TempDir dir;
};

// The launcher of the run in `run_dir`: the noloco process given out=run_dir
// whose command line does not end with it (its workers' do).
inline pid_t launcher_of(const std::string& run_dir) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_text(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    const std::string out = "out=" + run_dir + " ";
    if (cmdline.rfind(NOLOCO_BINARY " train ", 0) != 0 || cmdline.find(out) == std::string::npos) continue;
    if (cmdline.size() >= out.size() && cmdline.compare(cmdline.size() - out.size(), out.size(), out) == 0) continue;
    return pid_t(std::stol(name));
  }
  return -1;
}

// The value of variable `name` in the environment of process `pid` ("" if unset).
inline std::string environment_of(pid_t pid, const std::string& name) {
  const auto vars = read_text("/proc/" + std::to_string(pid) + "/environ");
  for (size_t pos = 0; pos < vars.size();) {
    const size_t end = std::min(vars.find('\0', pos), vars.size());
    if (vars.compare(pos, name.size() + 1, name + "=") == 0) return vars.substr(pos + name.size() + 1, end - pos - name.size() - 1);
    pos = end + 1;
  }
  return "";
}

// The process of worker `rank` of the run in `run_dir` (-1 if none): its
// command line ends with out=run_dir and its environment holds RANK=rank.
inline pid_t worker_of(const std::string& run_dir, int rank) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_text(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    const std::string out = "out=" + run_dir + " ";
    if (cmdline.rfind(NOLOCO_BINARY " train ", 0) != 0 || cmdline.size() < out.size() ||
        cmdline.compare(cmdline.size() - out.size(), out.size(), out) != 0)
      continue;
    const pid_t pid = pid_t(std::stol(name));
    if (environment_of(pid, "RANK") == std::to_string(rank)) return pid;
  }
  return -1;
}

// A child of `parent` whose command line starts with `program` (-1 if none).
inline pid_t child_of(pid_t parent, const std::string& program) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto stat = read_text(entry.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    if (read_text(entry.path().string() + "/cmdline").rfind(program, 0) == 0) return pid_t(std::stol(name));
  }
  return -1;
}

// Waits (bounded) until some replica of the run in `run_dir` has logged training step `step`.
inline bool wait_for_step(const std::string& run_dir, int64_t step, int seconds) {
  for (int i = 0; i < seconds * 10; ++i) {
    if (std::filesystem::exists(run_dir + "/metrics.jsonl"))
      for (auto& r : metrics_records(run_dir, "train"))
        if (r["step"].get<int64_t>() >= step) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Waits (bounded) until `run_dir`'s metrics hold a record of `split`.
inline bool wait_for_record(const std::string& run_dir, const std::string& split, int seconds) {
  for (int i = 0; i < seconds * 20; ++i) {
    if (std::filesystem::exists(run_dir + "/metrics.jsonl") &&
        read_text(run_dir + "/metrics.jsonl").find("\"split\":\"" + split + "\"") != std::string::npos)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}


}  // namespace noloco::testing
