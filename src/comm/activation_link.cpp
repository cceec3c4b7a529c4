#include "comm/activation_link.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMagic = 0x6e6f6c6f7069LL;  // "nolopi"
constexpr int kHeaderWords = 7;

torch::Tensor encode(int64_t run, const ActivationHeader& h) {
  return torch::tensor({kMagic, run, h.step, h.micro, h.kind, h.boundary, h.origin}, torch::kInt64);
}

const char* kind_name(int64_t kind) {
  switch (kind) {
    case ActivationLink::kForward: return "activations";
    case ActivationLink::kBackward: return "gradients";
    case ActivationLink::kEvaluation: return "evaluation activations";
    default: return "unknown";
  }
}

}  // namespace

ActivationLink::ActivationLink(const c10::intrusive_ptr<c10d::Store>& store, const WorkerEnv& env,
                               const std::string& bind, std::chrono::milliseconds timeout)
    : rank_(env.rank), timeout_(timeout), run_id_(run_id_of(env.token)) {
  pg_ = join_process_group(store, env, "pipeline", env.rank, env.world, bind, timeout);
}

ActivationLink::~ActivationLink() {
  try {
    finish_sends();
  } catch (const std::exception&) {
    // a peer already gone: nothing left to deliver to
  }
}

int ActivationLink::next_tag(std::map<int, int64_t>& counters, int peer) {
  // Each message is a header and up to two tensors: three consecutive tags.
  return int((counters[peer]++ % (1 << 28)) * 3);
}

void ActivationLink::send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors) {
  TORCH_CHECK(tensors.size() <= 2, "a pipeline message carries at most two tensors");
  const int tag = next_tag(sent_to_, peer);
  std::vector<torch::Tensor> keep{encode(run_id_, header)};
  for (const auto& t : tensors) keep.push_back(t.detach().to(torch::kCPU).contiguous());
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < keep.size(); ++i) {
    std::vector<torch::Tensor> one{keep[i]};
    works.push_back(pg_->send(one, peer, tag + int(i)));
    if (i == 0) continue;
    (header.kind == kEvaluation ? stats_.evaluation_bytes_sent : stats_.bytes_sent) += keep[i].nbytes();
  }
  if (header.kind != kEvaluation) stats_.messages += 1;
  waits_.push_back([works, keep, timeout = timeout_] {
    for (auto& w : works) w->wait(timeout);
  });
}

void ActivationLink::recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors) {
  const int tag = next_tag(received_from_, peer);
  const auto start = Clock::now();
  auto header = torch::empty({kHeaderWords}, torch::kInt64);
  std::vector<torch::Tensor> one{header};
  try {
    pg_->recv(one, peer, tag)->wait(timeout_);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("no {} from worker {} (step {}, micro-batch {}): {}", kind_name(expected.kind),
                                         peer, expected.step, expected.micro,
                                         std::string(e.what()).substr(0, std::string(e.what()).find('\n'))));
  }
  const auto* h = header.data_ptr<int64_t>();
  std::string problem;
  if (h[0] != kMagic) {
    problem = "not a noloco pipeline message";
  } else if (h[1] != run_id_) {
    problem = "message from another run (token mismatch)";
  } else if (h[2] != expected.step || h[3] != expected.micro || h[4] != expected.kind || h[5] != expected.boundary) {
    problem = fmt::format("got {} of step {}, micro-batch {}, boundary {}; expected {} of step {}, micro-batch {}, "
                          "boundary {}",
                          kind_name(h[4]), h[2], h[3], h[5], kind_name(expected.kind), expected.step, expected.micro,
                          expected.boundary);
  } else if (h[6] != expected.origin) {
    problem = fmt::format("micro-batch from data replica {}, routing says {} (workers disagree on the routes)", h[6],
                          expected.origin);
  }
  if (!problem.empty())
    throw std::runtime_error(fmt::format("rejected a pipeline message from worker {}: {}", peer, problem));
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<torch::Tensor> in{tensors[i]};
    pg_->recv(in, peer, tag + 1 + int(i))->wait(timeout_);
    if (expected.kind != kEvaluation) stats_.bytes_received += tensors[i].nbytes();
  }
  if (expected.kind != kEvaluation) stats_.idle_seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

void ActivationLink::finish_sends() {
  auto waits = std::move(waits_);
  waits_.clear();
  for (auto& wait : waits) wait();
}

}  // namespace noloco
