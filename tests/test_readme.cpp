// The README's "Training" block, run as a new user runs it (issue 84): every
// `build/noloco` line of it, in a fresh directory holding the project's
// configs/ and data/, in order. Two lines train the whole CPU budget; they
// run here shortened (steps=60 appended, so their outer steps still come)
// and write runs/a and runs/b, the runs the block's `report` line compares.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "test_util.h"

namespace {

// The block's command lines, without their comments.
std::vector<std::string> training_block() {
  const auto readme = noloco::testing::read_text(NOLOCO_SOURCE_DIR "/README.md");
  const auto section = readme.find("\n## Training\n");
  if (section == std::string::npos) return {};
  const auto open = readme.find("```sh\n", section), close = readme.find("```\n", open + 6);
  if (open == std::string::npos || close == std::string::npos) return {};
  std::istringstream lines(readme.substr(open + 6, close - open - 6));
  std::vector<std::string> commands;
  for (std::string line; std::getline(lines, line);) {
    if (const auto comment = line.find("  #"); comment != std::string::npos) line.resize(comment);
    line.erase(line.find_last_not_of(' ') + 1);
    if (line.rfind("build/noloco ", 0) == 0) commands.push_back(line.substr(13));
  }
  return commands;
}

bool has_key(const std::string& command, const std::string& key) {
  return command.find(" " + key + "=") != std::string::npos;
}

}  // namespace

TEST(Readme, EveryCommandOfTheTrainingBlockRunsAsWritten) {
  const auto commands = training_block();
  ASSERT_GE(commands.size(), 7u) << "the README's Training block was not found";
  noloco::testing::TempDir home;
  const std::filesystem::path dir = home.path();
  for (const char* folder : {"configs", "data"})
    std::filesystem::create_directory_symlink(std::filesystem::path(NOLOCO_SOURCE_DIR) / folder, dir / folder);
  int full_budget = 0;
  for (auto command : commands) {
    const bool trains = command.rfind("train ", 0) == 0 && command.find("--help") == std::string::npos;
    if (trains && !has_key(command, "steps")) {
      EXPECT_FALSE(has_key(command, "out")) << command;
      command += fmt::format(" steps=60 out=runs/{}", full_budget++ == 0 ? "a" : "b");
    }
    // The line is shell text (quotes and all), run by a shell as a user's would be.
    noloco::testing::write_text(dir / "line.sh", fmt::format("cd '{}'\nexec " NOLOCO_BINARY " {}\n", dir.string(), command));
    const auto result = noloco::testing::run_command("bash " + (dir / "line.sh").string(), 300);
    ASSERT_EQ(result.exit_code, 0) << command << "\n" << result.output;
    const auto verb = command.substr(0, command.find(' '));
    if (command == "train --help") {
      EXPECT_NE(result.output.find("steps"), std::string::npos) << result.output;
    } else if (verb == "train") {
      const auto out = has_key(command, "out") ? command.substr(command.find(" out=") + 5) : "";
      const auto run = dir / out.substr(0, out.find(' '));
      EXPECT_TRUE(std::filesystem::exists(run / "config.yaml")) << command;
      EXPECT_TRUE(std::filesystem::exists(run / "metrics.jsonl")) << command;
    } else if (verb == "generate") {
      EXPECT_NE(result.output.find("ROMEO:"), std::string::npos) << result.output;
    } else if (verb == "export") {
      EXPECT_TRUE(std::filesystem::exists(dir / "hf_dir" / "config.json")) << result.output;
      EXPECT_TRUE(std::filesystem::exists(dir / "hf_dir" / "model.safetensors")) << result.output;
    } else if (verb == "report") {
      EXPECT_FALSE(std::filesystem::is_empty(dir / "cmp")) << result.output;
    }
  }
  EXPECT_EQ(full_budget, 2) << "the block's full-budget lines, shortened here, make runs/a and runs/b";
}
