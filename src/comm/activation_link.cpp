#include "comm/activation_link.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "util/error_text.h"

namespace noloco {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

ActivationLink::ActivationLink(const StorePtr& store, const WorkerEnv& env, const std::string& bind,
                               std::chrono::milliseconds timeout)
    : rank_(env.rank), timeout_(timeout), run_id_(run_id_of(env.token)) {
  pg_ = join_gloo_group(store, env, "pipeline", env.rank, env.world, gloo_device(bind), timeout);
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

MessageHeader ActivationLink::header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const {
  MessageHeader m;
  m.run = run_id_;
  m.kind = int64_t(h.kind);
  m.exchange = h.step;
  m.micro = h.micro;
  m.boundary = h.boundary;
  m.origin = h.origin;
  for (const auto& t : tensors) m.bytes += int64_t(t.numel()) * int64_t(t.element_size());
  return m;
}

void ActivationLink::send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors) {
  TORCH_CHECK(tensors.size() <= 2, "a pipeline message carries at most two tensors");
  const int tag = next_tag(sent_to_, peer);
  std::vector<torch::Tensor> keep;
  for (const auto& t : tensors) keep.push_back(t.detach().to(torch::kCPU).contiguous());
  const auto w = header_of(header, keep).words();
  keep.insert(keep.begin(), torch::tensor(std::vector<int64_t>(w.begin(), w.end()), torch::kInt64));
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  const bool evaluation = header.kind == MessageKind::evaluation;
  for (size_t i = 0; i < keep.size(); ++i) {
    std::vector<torch::Tensor> one{keep[i]};
    works.push_back(pg_->send(one, peer, tag + int(i)));
    if (i == 0) continue;
    (evaluation ? stats_.evaluation_bytes_sent : stats_.bytes_sent) += keep[i].nbytes();
  }
  if (!evaluation) stats_.messages += 1;
  waits_.push_back([works, keep, timeout = timeout_] {
    for (auto& w : works) w->wait(timeout);
  });
}

void ActivationLink::recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors) {
  const int tag = next_tag(received_from_, peer);
  const auto start = Clock::now();
  auto header = torch::empty({MessageHeader::kWords}, torch::kInt64);
  std::vector<torch::Tensor> one{header};
  try {
    pg_->recv(one, peer, tag)->wait(timeout_);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("no {} from worker {} (step {}, micro-batch {}): {}",
                                         message_kind_name(int64_t(expected.kind)), peer, expected.step,
                                         expected.micro, error_text(e)));
  }
  // The payload is received only into buffers of the size the header was checked to announce.
  const auto problem = check_message_header(header_of(expected, tensors),
                                            MessageHeader::from_words(header.data_ptr<int64_t>()));
  if (!problem.empty())
    throw std::runtime_error(fmt::format("rejected a pipeline message from worker {}: {}", peer, problem));
  const bool evaluation = expected.kind == MessageKind::evaluation;
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<torch::Tensor> in{tensors[i]};
    pg_->recv(in, peer, tag + 1 + int(i))->wait(timeout_);
    if (!evaluation) stats_.bytes_received += tensors[i].nbytes();
  }
  if (!evaluation) stats_.idle_seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

void ActivationLink::finish_sends() {
  auto waits = std::move(waits_);
  waits_.clear();
  for (auto& wait : waits) wait();
}

}  // namespace noloco
