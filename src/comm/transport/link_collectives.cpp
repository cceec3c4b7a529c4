#include "comm/transport/link_collectives.h"

#include <fmt/format.h>

#include "comm/transport/link_messages.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

enum Piece : int64_t { kGather = 1, kToAll = 2, kBroadcast = 3 };

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

LinkCollectives::LinkCollectives(std::vector<LinkPtr> links, int rank, int64_t run_id,
                                 std::chrono::milliseconds timeout)
    : links_(std::move(links)), rank_(rank), run_id_(run_id), timeout_(timeout) {}

bool LinkCollectives::intact() const {
  for (int r = 0; r < world(); ++r)
    if (r != rank_ && (!links_[size_t(r)] || links_[size_t(r)]->broken())) return false;
  return true;
}

void LinkCollectives::trade(int64_t kind, const std::vector<torch::Tensor>& out, std::vector<torch::Tensor>& in,
                            bool send, bool receive, const std::vector<bool>& with, CommStats& cost) {
  const int64_t number = count_++;
  std::vector<LinkTrade> trades;
  std::vector<int> members;
  for (int r = 0; r < world(); ++r) {
    if (r == rank_ || !with[size_t(r)]) continue;
    const auto& link = links_[size_t(r)];
    if (!link || link->broken())
      throw std::runtime_error(fmt::format("collective {}: the link to member {} is down{}", number, r,
                                           link ? ": " + link->problem() : ""));
    LinkTrade t;
    t.link = link.get();
    t.send = send;
    t.receive = receive;
    t.header.run = run_id_;
    t.header.kind = int64_t(MessageKind::collective);
    t.header.exchange = number;
    t.header.micro = kind;
    if (send) {
      const auto& piece = out[size_t(r)];
      t.header.bytes = int64_t(piece.nbytes());
      t.payload = {{bytes_ptr(piece), piece.nbytes()}};
    }
    if (receive) {
      t.expected = t.header;
      auto target = in[size_t(r)];
      t.expected.bytes = int64_t(target.nbytes());
      t.place = [target](const MessageHeader&) { return std::vector<Link::Slot>{{bytes_ptr(target), target.nbytes()}}; };
    }
    trades.push_back(std::move(t));
    members.push_back(r);
  }
  trade_messages(trades, Clock::now() + timeout_);
  for (size_t i = 0; i < trades.size(); ++i) {
    const auto& t = trades[i];
    cost.sent_over(t.link->route(), t.bytes_sent);
    cost.bytes_received += t.bytes_received;
  }
  for (size_t i = 0; i < trades.size(); ++i) {
    const auto& t = trades[i];
    if (t.send && !t.sent)
      throw std::runtime_error(
          fmt::format("collective {}: the piece for member {} did not leave: {}", number, members[i], t.link->problem()));
    if (t.receive && t.incoming.delivery != Delivery::received)
      throw std::runtime_error(fmt::format("collective {}: member {}'s piece did not come: {}", number, members[i],
                                           t.incoming.problem));
  }
}

std::vector<torch::Tensor> LinkCollectives::pieces(int64_t kind, const std::vector<torch::Tensor>& out,
                                                    CommStats& cost) {
  std::vector<torch::Tensor> in;
  for (int r = 0; r < world(); ++r) in.push_back(r == rank_ ? out[size_t(r)].clone() : torch::empty_like(out[size_t(r)]));
  trade(kind, out, in, true, true, std::vector<bool>(size_t(world()), true), cost);
  return in;
}

std::vector<torch::Tensor> LinkCollectives::to_all(const torch::Tensor& bytes, CommStats& cost) {
  TORCH_CHECK(bytes.numel() % world() == 0, "all_to_all needs equal chunks");
  const auto chunks = bytes.contiguous().chunk(world());
  return pieces(kToAll, {chunks.begin(), chunks.end()}, cost);
}

std::vector<torch::Tensor> LinkCollectives::gather(const torch::Tensor& bytes, CommStats& cost) {
  return pieces(kGather, std::vector<torch::Tensor>(size_t(world()), bytes.contiguous()), cost);
}

std::vector<torch::Tensor> LinkCollectives::all_to_all(const torch::Tensor& bytes) {
  const auto start = Clock::now();
  CommStats cost;
  auto in = to_all(bytes, cost);
  finish(cost, start);
  return in;
}

std::vector<torch::Tensor> LinkCollectives::all_gather(const torch::Tensor& bytes) {
  const auto start = Clock::now();
  CommStats cost;
  auto in = gather(bytes, cost);
  finish(cost, start);
  return in;
}

void LinkCollectives::all_reduce_mean(torch::Tensor& t) {
  const auto start = Clock::now();
  const int n_members = world();
  const auto flat = t.detach().to(torch::kCPU).contiguous().view(-1);
  const int64_t n = flat.numel(), slice = (n + n_members - 1) / n_members;
  auto padded = torch::zeros({slice * n_members}, flat.options());
  padded.narrow(0, 0, n).copy_(flat);
  CommStats cost;
  const auto parts = to_all(padded.view(torch::kUInt8), cost);
  auto own = torch::zeros({slice}, flat.options());
  for (const auto& part : parts) own.add_(part.view(flat.scalar_type()));
  own.div_(n_members);
  const auto slices = gather(own.view(torch::kUInt8), cost);
  std::vector<torch::Tensor> values;
  for (const auto& b : slices) values.push_back(b.view(flat.scalar_type()));
  t.copy_(torch::cat(values).narrow(0, 0, n).view_as(t));
  finish(cost, start);
}

void LinkCollectives::finish(CommStats cost, Clock::time_point start) {
  cost.collectives = 1;
  cost.comm_seconds = cost.wait_seconds = since(start);  // a collective is one barrier: all of it is waiting
  charge(cost);
}

void LinkCollectives::broadcast(torch::Tensor& t, int root) {
  const auto start = Clock::now();
  auto plain = t.detach().to(torch::kCPU).contiguous();
  auto bytes = plain.view(-1).view(torch::kUInt8);
  const bool sending = rank_ == root;
  std::vector<torch::Tensor> out(size_t(world()), bytes), in(size_t(world()), bytes);
  std::vector<bool> with(size_t(world()), sending);
  if (!sending) with[size_t(root)] = true;
  CommStats cost;
  trade(kBroadcast, out, in, sending, !sending, with, cost);
  if (!sending && plain.data_ptr() != t.data_ptr()) t.copy_(plain);
  finish(cost, start);
}

}  // namespace noloco
