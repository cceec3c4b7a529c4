#include "comm/store/abandonable_store.h"

#include <stdexcept>


namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

class AbandonableStore final : public c10d::Store {
 public:
  AbandonableStore(StorePtr inner, std::function<bool()> abandon, std::chrono::milliseconds slice)
      : Store(inner->getTimeout()), inner_(std::move(inner)), abandon_(std::move(abandon)), slice_(slice) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_->set(key, value); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key});
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<AbandonableStore>(inner_->clone(), abandon_, slice_);
  }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, getTimeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = Clock::now() + timeout;
    // Asked even when the keys are there: a member that gave up may have
    // written its keys before it did.
    for (;;) {
      if (abandon_()) throw std::runtime_error("a member of the group was given up while it formed");
      if (inner_->check(keys)) return;
      const auto now = Clock::now();
      if (now >= deadline) throw std::runtime_error("timed out waiting for a member of the group");
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
      try {
        inner_->wait(keys, std::min(left, slice_));
      } catch (const std::exception&) {
        // a slice ran out: look again (or give up above)
      }
    }
  }

 private:
  StorePtr inner_;
  std::function<bool()> abandon_;
  std::chrono::milliseconds slice_;
};

}  // namespace

StorePtr abandonable(StorePtr inner, std::function<bool()> abandon, std::chrono::milliseconds slice) {
  return c10::make_intrusive<AbandonableStore>(std::move(inner), std::move(abandon), slice);
}

}  // namespace noloco
