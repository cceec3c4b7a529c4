// Workers in network namespaces behind capped links (rate=...). Root only:
// elsewhere these tests skip and say why. Every test leaves no namespace of
// a finished launcher behind, whatever happened.
#include <gtest/gtest.h>

#include <signal.h>

#include <sstream>

#include <fmt/format.h>

#include "comm/launch/capped_links.h"
#include "wire/message.h"
#include "comm/transport/seal.h"
#include "test_util.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::TempDir;

namespace {

// Namespaces whose launcher is gone: what a clean-up failed to remove.
std::vector<std::string> orphaned_namespaces() {
  std::vector<std::string> out;
  for (const auto& name : CappedLinks::existing_namespaces()) {
    const long pid = std::strtol(name.c_str() + 7, nullptr, 10);  // noloco-<pid>-w<k>
    if (pid > 0 && ::kill(pid_t(pid), 0) != 0) out.push_back(name);
  }
  return out;
}

#define SKIP_WITHOUT_CAPPED_LINKS()                                           \
  do {                                                                        \
    const auto reason = CappedLinks::unavailable_reason();                    \
    if (!reason.empty()) GTEST_SKIP() << "skipped: " << reason;               \
  } while (0)

}  // namespace

TEST(CappedLinks, OneNamespacePerWorkerAllRemovedAfterwards) {
  SKIP_WITHOUT_CAPPED_LINKS();
  const std::string mine = fmt::format("noloco-{}-w", ::getpid());
  auto count_mine = [&] {
    int n = 0;
    for (const auto& name : CappedLinks::existing_namespaces()) n += name.rfind(mine, 0) == 0;
    return n;
  };
  {
    CappedLinks links(3, 10e6);
    EXPECT_EQ(count_mine(), 3);
    EXPECT_EQ(links.worker_address(0).substr(0, links.host_address().size() - 1),
              links.host_address().substr(0, links.host_address().size() - 1));
    EXPECT_NE(links.worker_address(1), links.worker_address(2));
    FILE* p = ::popen(fmt::format("PATH=$PATH:/usr/sbin tc -n {}1 qdisc show 2>&1", mine).c_str(), "r");
    ASSERT_NE(p, nullptr);
    char buf[512];
    std::string shown;
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) shown.append(buf, n);
    ::pclose(p);
    EXPECT_NE(shown.find("tbf"), std::string::npos) << shown;
    EXPECT_NE(shown.find("10Mbit"), std::string::npos) << shown;
  }
  EXPECT_EQ(count_mine(), 0);
}

// The cap is real: a pair exchange cannot beat payload / rate. (A lower bound
// of physics, not a performance target: those live in bench comm's results.)
TEST(CappedLinks, APairExchangeTakesAtLeastThePayloadOverTheRate) {
  SKIP_WITHOUT_CAPPED_LINKS();
  TempDir dir;
  const auto r = noloco::testing::run_cli(
      "bench comm method=noloco replicas=2 megabytes=0.5 rounds=2 rate=10mbit out=" + dir / "bench", 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto csv = noloco::testing::read_text(dir / "bench/bench_comm.csv");
  const auto row = csv.substr(csv.find('\n') + 1);
  std::vector<std::string> cells;
  std::stringstream s(row);
  for (std::string cell; std::getline(s, cell, ',');) cells.push_back(cell);
  ASSERT_EQ(cells.size(), 17u) << csv;
  EXPECT_EQ(cells[12], "10mbit");
  const double sync = std::stod(cells[7]), bytes = std::stod(cells[13]), ideal = std::stod(cells[14]);
  EXPECT_EQ(bytes, double(noloco::testing::sealed_message(500000)) + noloco::testing::kLinkStart / 2.0)
      << "one fp32 message of 0.5 MB a round, its header, its frames, and the link's start over 2 rounds";
  EXPECT_NEAR(ideal, bytes * 8 / 10e6, 1e-6);  // the CSV keeps 6 decimals
  EXPECT_GT(sync, 0.8 * ideal) << "faster than the link allows: the cap is not applied";
  EXPECT_TRUE(orphaned_namespaces().empty());
}

TEST(CappedLinks, AFailedRunLeavesNothingBehind) {
  SKIP_WITHOUT_CAPPED_LINKS();
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  const auto r = noloco::testing::run_cli(noloco::testing::small_train_args(dir / "c.txt", dir / "run") +
                                              " method=ddp replicas=2 batch=2 steps=30 rate=100mbit inject_crash=1:3",
                                          90);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("worker 1 was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_TRUE(orphaned_namespaces().empty());
}
