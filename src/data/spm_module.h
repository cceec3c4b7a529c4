// Debian's libsentencepiece bundles its own protobuf 3.14 and exports it,
// while LibTorch loads the system protobuf 3.21: linked into one program they
// interpose and crash at start-up. So sentencepiece lives in a module
// (libnoloco_spm.so) loaded with RTLD_DEEPBIND, which binds it to its own
// protobuf. This is the module's whole interface.
#pragma once
#include <string>
#include <vector>

extern "C" {
// All return 0 on success, else set *error.
int noloco_spm_train(const std::string* args, std::string* model, std::string* error);
void* noloco_spm_load(const std::string* model, std::string* error);
void noloco_spm_free(void* processor);
int noloco_spm_encode(void* processor, const std::string* text, std::vector<int>* ids, std::string* error);
int noloco_spm_decode(void* processor, const std::vector<int>* ids, std::string* text, std::string* error);
int noloco_spm_piece_size(void* processor);
// The end-of-sentence id (-1 if the model has none) and its piece.
int noloco_spm_eos(void* processor, std::string* piece);
}
