// pace=speed: the slots a replica trained in, kept beside its checkpoints as
// it goes, one character a slot: '1' trained, '0' left to faster replicas,
// '-' not this replica's (before it took a live replica's state). A resume
// from a checkpoint replays what the run did after it (Pace::replay), so it
// comes to where the run stopped bit for bit; past the record, the pace is
// measured again.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace noloco {

class PaceRecord {
 public:
  // The record at `path`, read up to `last_step` slots; training goes on at
  // slot `from`: what it held from there on is replay() (kept: `replays`),
  // and is written again as it is trained. Throws std::runtime_error naming
  // the file and slot where it holds anything but '0', '1' or '-'.
  PaceRecord(std::string path, int64_t from, int64_t last_step, bool replays);
  // The slots from `from` on that the record held, up to its first '-'.
  const std::vector<bool>& replay() const { return replay_; }
  // Slot `slot` trained or not; slots come in order, but a replica that took
  // a live replica's state goes on at that replica's step, back or ahead.
  void note(int64_t slot, bool trained);

 private:
  void rewrite();

  std::string path_;
  std::string slots_;  // slot i at index i
  std::vector<bool> replay_;
  std::ofstream out_;  // appends slots_.size() on
};

}  // namespace noloco
