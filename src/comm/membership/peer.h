// A member of a group in one of its lives: a restarted worker is the same
// rank in a new incarnation, and must never be paired with a stale connection.
#pragma once

namespace noloco {

struct Peer {
  int rank = 0;
  int incarnation = 0;
  bool operator==(const Peer& o) const { return rank == o.rank && incarnation == o.incarnation; }
};

}  // namespace noloco
