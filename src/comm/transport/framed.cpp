#include "comm/transport/framed.h"

#include <fmt/format.h>

#include "comm/transport/seal.h"
#include "util/error_text.h"

namespace noloco {

namespace {

int64_t bytes_of(const std::vector<torch::Tensor>& parts) {
  int64_t n = 0;
  for (const auto& t : parts) n += int64_t(t.nbytes());
  return n;
}

torch::Tensor words_of(const MessageHeader& h) {
  const auto w = h.words();
  return torch::tensor(std::vector<int64_t>(w.begin(), w.end()), torch::kInt64);
}

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// A part is bound to its message (every header word), its place in it, and
// the direction it travels in its group.
std::vector<uint8_t> part_context(const MessageHeader& h, int from, int to, size_t part) {
  const auto w = h.words();
  return seal_context({w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], from, to, int64_t(part)});
}
static_assert(MessageHeader::kWords == 9, "part_context binds every header word");

}  // namespace


FramedSend::FramedSend(c10d::ProcessGroupGloo& group, int member, int tag, const MessageHeader& header,
                       std::vector<torch::Tensor> parts, const Seal* seal, bool corrupt)
    : tensors_(std::move(parts)) {
  TORCH_CHECK(header.bytes == bytes_of(tensors_), "a framed message's header announces its payload's size");
  payload_bytes_ = uint64_t(header.bytes);
  if (seal) {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto plain = tensors_[i].contiguous();
      auto sealed = torch::empty({int64_t(plain.nbytes() + Seal::kOverhead)}, torch::kUInt8);
      seal->seal(bytes_ptr(plain), plain.nbytes(), part_context(header, group.getRank(), member, i),
                 bytes_ptr(sealed));
      tensors_[i] = sealed;
    }
  }
  if (corrupt && !tensors_.empty() && tensors_.back().nbytes() > 0) {
    auto& last = tensors_.back();
    last = last.contiguous().clone();
    bytes_ptr(last)[last.nbytes() / 2] ^= 0x01;
  }
  tensors_.insert(tensors_.begin(), words_of(header));
  for (const auto& t : tensors_) wire_bytes_ += uint64_t(t.nbytes());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    std::vector<torch::Tensor> one{tensors_[i]};
    works_.push_back(group.send(one, member, tag + int(i)));
  }
}

void FramedSend::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_)
    if (!w->wait(timeout)) throw std::runtime_error("the send was aborted");
}

void FramedSend::abort() {
  for (auto& w : works_) w->abort();
}

FramedReceive::FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected,
                             std::vector<torch::Tensor> parts, bool eager, const Seal* seal)
    : group_(&group),
      member_(member),
      tag_(tag),
      expected_(expected),
      header_words_(torch::empty({MessageHeader::kWords}, torch::kInt64)),
      parts_(std::move(parts)),
      eager_(eager),
      seal_(seal) {
  TORCH_CHECK(expected_.bytes == bytes_of(parts_), "a framed receive's buffers hold the expected payload");
  std::vector<torch::Tensor> one{header_words_};
  header_work_ = group_->recv(one, member_, tag_);
  if (eager_) post_parts();
}

FramedReceive::FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected,
                             int64_t max_bytes, const Seal* seal)
    : FramedReceive(group, member, tag, expected, {}, false, seal) {
  max_bytes_ = max_bytes;
}

void FramedReceive::post_parts() {
  std::lock_guard<std::mutex> lock(*posting_);
  if (aborted_) throw std::runtime_error("the receive was aborted");
  sealed_.clear();
  for (size_t i = 0; i < parts_.size(); ++i) {
    auto target = parts_[i];
    if (seal_) {
      sealed_.push_back(torch::empty({int64_t(parts_[i].nbytes() + Seal::kOverhead)}, torch::kUInt8));
      target = sealed_.back();
    }
    std::vector<torch::Tensor> one{target};
    part_works_.push_back(group_->recv(one, member_, tag_ + 1 + int(i)));
  }
}

bool FramedReceive::open_parts() {
  for (size_t i = 0; i < sealed_.size(); ++i) {
    if (!seal_->open(bytes_ptr(sealed_[i]), parts_[i].nbytes(), part_context(got_, member_, group_->getRank(), i),
                     bytes_ptr(parts_[i]))) {
      problem_ = fmt::format("payload part {} failed authentication (changed on the way, replayed, or sealed "
                             "with another token): not used",
                             i);
      return false;
    }
  }
  return true;
}

uint64_t FramedReceive::wire_bytes() const {
  uint64_t n = MessageHeader::kBytes;
  for (const auto& t : seal_ ? sealed_ : parts_) n += uint64_t(t.nbytes());
  return n;
}

Delivery FramedReceive::check_header() {
  got_ = MessageHeader::from_words(header_words_.data_ptr<int64_t>());
  if (!eager_ && check_message_header(dropped_notice(expected_), got_).empty()) return Delivery::dropped;
  if (max_bytes_ >= 0 && got_.bytes >= 0 && got_.bytes <= max_bytes_) {
    expected_.bytes = got_.bytes;
    parts_ = {torch::empty({got_.bytes}, torch::kUInt8)};
  }
  problem_ = check_message_header(expected_, got_);
  if (!problem_.empty() && max_bytes_ >= 0 && got_.bytes > max_bytes_)
    problem_ = fmt::format("{} payload bytes, at most {} expected", got_.bytes, max_bytes_);
  return problem_.empty() ? Delivery::received : Delivery::rejected;
}

Delivery FramedReceive::wait(std::chrono::milliseconds timeout) {
  try {
    if (!header_work_->wait(timeout)) throw std::runtime_error("the receive was aborted");
    const auto checked = check_header();
    if (checked != Delivery::received) {
      // An eager receive's parts are posted and come whole: let them land
      // before their buffers go, or the pair's stream stops there.
      if (eager_) {
        try {
          for (auto& w : part_works_) w->wait(timeout);
        } catch (const std::exception&) {
        }
      }
      return checked;
    }
    if (!eager_) post_parts();
    for (auto& w : part_works_)
      if (!w->wait(timeout)) throw std::runtime_error("the receive was aborted");
    if (seal_ && !open_parts()) return Delivery::unauthentic;
    return Delivery::received;
  } catch (const std::exception& e) {
    problem_ = error_text(e);
    return Delivery::peer_lost;
  }
}

void FramedReceive::abort() {
  std::lock_guard<std::mutex> lock(*posting_);
  aborted_ = true;
  header_work_->abort();
  for (auto& w : part_works_) w->abort();
}

}  // namespace noloco
