// The one authority on whether a peer is still worth waiting for. Every
// wait on a peer (an exchange, forming a group for an evaluation, a state
// hand-over) asks it, and every path that finds a peer gone tells it, so
// the reactions to a lost worker agree: what one path gave up, the next
// snapshot leaves out. Membership (membership.h) is the implementation; a
// transport without one waits out its timeout.
#pragma once
#include <chrono>
#include <cstdint>

namespace noloco {

class Liveness {
 public:
  virtual ~Liveness() = default;
  // Stop waiting for member `rank`, waited for since `waiting_since`: it was
  // declared dead, its heartbeat is silent, or it made no progress during
  // this wait. Pass `waiting_since` = now where every member is known to be
  // standing in the same wait (forming a group): then only death and
  // silence count.
  virtual bool given_up(int rank, std::chrono::steady_clock::time_point waiting_since) = 0;
  // Whether member `rank`'s heartbeat has been silent for the heartbeat
  // timeout, whatever it was declared: the question for a state hand-over,
  // whose receiver is a restarted rank still declared dead until it holds
  // the state.
  virtual bool silent(int rank) = 0;
  // Whether member `rank` went alone, for want of the run's store, at
  // exchange `id`, or with `or_later` at any exchange from `id` on (an
  // evaluation between exchanges, which a replica alone skips as well): it
  // will not come. Being at a later exchange says nothing: under overlap a
  // partner moves on as soon as its message of `id` is written, before this
  // worker has read it.
  virtual bool went_alone(int /*rank*/, int64_t /*id*/, bool /*or_later*/) { return false; }
  // The exchange this worker last went to (-1: none), for waits between exchanges.
  virtual int64_t exchange_reached() { return -1; }
  // Member `rank` failed this worker (its pair closed, its message never
  // came, its hand-over failed): later snapshots leave it out.
  virtual void declare_dead(int rank) = 0;
  // This worker moved on, or spent a moment waiting for members it has not
  // given up: those waiting for it keep waiting.
  virtual void progressed() = 0;
};

}  // namespace noloco
