#include "util/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace noloco {

bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file_atomic(const std::string& path, std::string_view bytes, unsigned mode) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  ::unlink(tmp.c_str());  // O_CREAT keeps an existing file's permissions
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, mode_t(mode));
  if (fd < 0) throw std::runtime_error(fmt::format("cannot write '{}': {}", tmp, std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw std::runtime_error(fmt::format("cannot write '{}': {}", tmp, std::strerror(err)));
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot flush '{}': {}", tmp, std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(errno)));
  }
}

nlohmann::json read_json(const std::string& path) {
  const auto text = read_file(path);
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw std::runtime_error(fmt::format("'{}' is not valid JSON", path));
  return j;
}

void write_json_atomic(const std::string& path, const nlohmann::json& j) {
  write_file_atomic(path, j.dump(2) + "\n");
}

}  // namespace noloco
