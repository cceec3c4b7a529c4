#include "data/spm_module.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace sentencepiece::logging {
// Exported by libsentencepiece but not declared in its public headers.
void SetMinLogLevel(int level);
}  // namespace sentencepiece::logging

namespace {
// Logging goes through a std::cerr that, under RTLD_DEEPBIND, may not be the
// program's constructed one: keep sentencepiece silent and report through statuses.
struct Silence {
  Silence() { sentencepiece::logging::SetMinLogLevel(4); }
} silence;
}  // namespace

extern "C" {

int noloco_spm_train(const std::string* args, std::string* model, std::string* error) {
  auto status = sentencepiece::SentencePieceTrainer::Train(*args, nullptr, model);
  if (status.ok()) return 0;
  *error = status.ToString();
  return 1;
}

void* noloco_spm_load(const std::string* model, std::string* error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  auto status = sp->LoadFromSerializedProto(*model);
  if (status.ok()) return sp;
  *error = status.ToString();
  delete sp;
  return nullptr;
}

void noloco_spm_free(void* processor) { delete static_cast<sentencepiece::SentencePieceProcessor*>(processor); }

int noloco_spm_encode(void* processor, const std::string* text, std::vector<int>* ids, std::string* error) {
  auto status = static_cast<sentencepiece::SentencePieceProcessor*>(processor)->Encode(*text, ids);
  if (status.ok()) return 0;
  *error = status.ToString();
  return 1;
}

int noloco_spm_decode(void* processor, const std::vector<int>* ids, std::string* text, std::string* error) {
  auto status = static_cast<sentencepiece::SentencePieceProcessor*>(processor)->Decode(*ids, text);
  if (status.ok()) return 0;
  *error = status.ToString();
  return 1;
}

int noloco_spm_piece_size(void* processor) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(processor)->GetPieceSize();
}

int noloco_spm_eos(void* processor, std::string* piece) {
  auto* sp = static_cast<sentencepiece::SentencePieceProcessor*>(processor);
  const int id = sp->eos_id();
  if (id >= 0 && id < sp->GetPieceSize()) *piece = sp->IdToPiece(id);
  return id;
}

}  // extern "C"
