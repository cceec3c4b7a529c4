// The files a run keeps in its directory, named once (its store keys are in
// comm/store/run_record.h). RUN_DIR/NAME through `in`.
#pragma once
#include <string>

namespace noloco::run_files {

inline constexpr const char* kConfig = "config.yaml";  // the resolved config a resume and a joiner read
inline constexpr const char* kMetrics = "metrics.jsonl";
inline constexpr const char* kSummary = "summary.json";  // the run's; each replica's below
inline constexpr const char* kCheckpoints = "checkpoints";
inline constexpr const char* kLock = "run.lock";
inline constexpr const char* kRunToken = "run_token";  // a launcher-minted token, mode 0600
inline constexpr const char* kJoinInvitation = "join.json";  // while a launcher runs: its store, for joiners
inline constexpr const char* kTokens = "tokens";        // the corpus tokenized for this run
inline constexpr const char* kCorpus = "corpus.json";   // what the tokens were made from
inline constexpr const char* kTokenizer = "tokenizer.json";

// Beside a replica's checkpoints: the slots it trained in (train/pace_record.h).
inline constexpr const char* kPaceSlots = "pace_slots";

inline std::string in(const std::string& run_dir, const char* name) { return run_dir + "/" + name; }

// The checkpoints of the worker that speaks for replica `speaker`'s shard.
inline std::string worker_checkpoints(const std::string& run_dir, int speaker) {
  return in(run_dir, kCheckpoints) + "/r" + std::to_string(speaker);
}

// A replica's summary (summary_r<replica>.json); in a pipeline, a stage
// worker's (summary_r<replica>_s<stage>.json).
inline std::string replica_summary(const std::string& run_dir, int replica, int stage = -1) {
  return run_dir + "/summary_r" + std::to_string(replica) + (stage >= 0 ? "_s" + std::to_string(stage) : "") + ".json";
}

}  // namespace noloco::run_files
