#include "util/log.h"

#include <cstring>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace noloco {

namespace {

// "warning: " / "error: " after the prefix; nothing for plain information.
class LevelWord final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const char* word = msg.level >= spdlog::level::err ? "error: " : msg.level == spdlog::level::warn ? "warning: " : "";
    dest.append(word, word + std::strlen(word));
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<LevelWord>(); }
};

}  // namespace

void init_logging(const std::string& who) {
  static auto logger = [] {
    auto l = std::make_shared<spdlog::logger>("noloco", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    l->flush_on(spdlog::level::trace);  // lines from several workers interleave whole, in time
    return l;
  }();
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<LevelWord>('*').set_pattern(who + ": %*%v");
  logger->set_formatter(std::move(formatter));
  spdlog::set_default_logger(logger);
}

}  // namespace noloco
