// Precompiled header for the LibTorch-heavy targets.
#pragma once
#include <torch/torch.h>
