// The model a run hands over by default (`export`, `generate`, summary.json):
// the mean of its replicas' weights only where the run's own validation found
// it at least as good as its best replica, else that replica. NoLoCo's mean is
// usually better than every replica, but under very sparse messages the
// replicas drift apart and their mean can be worse than any of them.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

namespace noloco {

// Which model of a run directory the key `replica` names: "best" (the rule
// below), "mean" (the mean of its replicas' weights at their newest common
// checkpoint) or a replica's number. A checkpoint given itself is that one.
constexpr const char* kBestModel = "best";
constexpr const char* kMeanOfReplicas = "mean";

// What a run's validation said of its models at one step.
struct ValidatedModels {
  std::map<int, double> replica_loss;     // by replica
  std::optional<double> mean_model_loss;  // the mean of the replicas' weights
};

struct ModelChoice {
  std::optional<int> replica;  // none: the mean of the replicas
  std::string why;             // one line for the user, the figures behind the choice
};

// A mean within this share of the best replica's loss counts as as good:
// float rounding (DiLoCo's identical replicas' mean is evaluated through
// another sum, and came out 1e-7 above them).
constexpr double kLossRounding = 1e-5;

// The replica of the lowest loss (the lowest number among equals) and its
// loss; none without validated replicas.
std::optional<std::pair<int, double>> best_replica(const ValidatedModels& validated);

// The mean where it validated at least as well as the best replica (to
// kLossRounding) or where there is nothing to choose between (one replica,
// or no validation); else the best replica.
ModelChoice choose_model(const ValidatedModels& validated);

// The validation records of `run_dir`'s metrics.jsonl by step (where a resume
// evaluated a step again, its latest records). Empty without metrics.
std::map<int64_t, ValidatedModels> validated_models(const std::string& run_dir);

}  // namespace noloco
