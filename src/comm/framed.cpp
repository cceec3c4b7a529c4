#include "comm/framed.h"

#include <fmt/format.h>

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

}  // namespace

MessageHeader dropped_notice(MessageHeader header) {
  header.bytes = 0;
  header.format = MessageHeader::kDropped;
  return header;
}

FramedSend::FramedSend(c10d::ProcessGroupGloo& group, int member, int tag, const MessageHeader& header,
                       std::vector<torch::Tensor> parts)
    : tensors_(std::move(parts)) {
  TORCH_CHECK(header.bytes == bytes_of(tensors_), "a framed message's header announces its payload's size");
  payload_bytes_ = uint64_t(header.bytes);
  tensors_.insert(tensors_.begin(), words_of(header));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    std::vector<torch::Tensor> one{tensors_[i]};
    works_.push_back(group.send(one, member, tag + int(i)));
  }
}

void FramedSend::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_) w->wait(timeout);
}

FramedReceive::FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected,
                             std::vector<torch::Tensor> parts, bool eager)
    : group_(&group),
      member_(member),
      tag_(tag),
      expected_(expected),
      header_words_(torch::empty({MessageHeader::kWords}, torch::kInt64)),
      parts_(std::move(parts)),
      eager_(eager) {
  TORCH_CHECK(expected_.bytes == bytes_of(parts_), "a framed receive's buffers hold the expected payload");
  std::vector<torch::Tensor> one{header_words_};
  header_work_ = group_->recv(one, member_, tag_);
  if (eager_) post_parts();
}

FramedReceive::FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected,
                             int64_t max_bytes)
    : FramedReceive(group, member, tag, expected, {}, false) {
  max_bytes_ = max_bytes;
}

void FramedReceive::post_parts() {
  for (size_t i = 0; i < parts_.size(); ++i) {
    std::vector<torch::Tensor> one{parts_[i]};
    part_works_.push_back(group_->recv(one, member_, tag_ + 1 + int(i)));
  }
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
    header_work_->wait(timeout);
    const auto checked = check_header();
    if (checked != Delivery::received) return checked;
    if (!eager_) post_parts();
    for (auto& w : part_works_) w->wait(timeout);
    return Delivery::received;
  } catch (const std::exception& e) {
    problem_ = error_text(e);
    return Delivery::peer_lost;
  }
}

}  // namespace noloco
