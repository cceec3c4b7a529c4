#include "train/pace_record.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "util/files.h"

namespace noloco {

PaceRecord::PaceRecord(std::string path, int64_t from, int64_t last_step, bool replays) : path_(std::move(path)) {
  if (std::filesystem::exists(path_)) {
    // No further than the run's steps: a longer file is not read, nor held.
    const auto size = std::min<uintmax_t>(std::filesystem::file_size(path_), uintmax_t(std::max<int64_t>(0, last_step)));
    std::ifstream in(path_, std::ios::binary);
    slots_.resize(size_t(size));
    in.read(slots_.data(), std::streamsize(slots_.size()));
    slots_.resize(size_t(in.gcount()));
    const auto bad = slots_.find_first_not_of("01-");
    if (bad != std::string::npos)
      throw std::runtime_error(fmt::format("{}: slot {} holds byte {}; a pace record holds only 0, 1 and -", path_,
                                           bad, int(static_cast<unsigned char>(slots_[bad]))));
  }
  if (replays)
    for (size_t i = size_t(std::max<int64_t>(0, from)); i < slots_.size() && slots_[i] != '-'; ++i)
      replay_.push_back(slots_[i] == '1');
  slots_.resize(size_t(std::max<int64_t>(0, from)), '-');
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
  rewrite();
}

void PaceRecord::note(int64_t slot, bool trained) {
  if (slot < 0) return;
  if (size_t(slot) != slots_.size()) {
    slots_.resize(size_t(slot), '-');
    slots_.push_back(trained ? '1' : '0');
    rewrite();
    return;
  }
  slots_.push_back(trained ? '1' : '0');
  out_.put(slots_.back());
  out_.flush();  // a run killed later still replays this slot
}

void PaceRecord::rewrite() {
  out_.close();
  write_file_atomic(path_, slots_);
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) throw std::runtime_error(fmt::format("{}: cannot append to the pace record", path_));
}

}  // namespace noloco
