// The package's inputs for one step, built in C++ (docs/EXPORT.md, "Package inputs" 0-8).
//
// Owns the token layout (what gr_plugin.modules.tokens.build_token_layout computes in Python:
// per user its new history events c[b] .. L[b]-1, then its candidates; absolute positions clamped
// to max_positions - 1; a candidate at position L[b] with action and time 0) and the page inputs
// taken from the cache core's plan metadata (slots, kv_indices, kv_indptr, lengths). It does not
// touch the cache or the model.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_core.h"
#include "stream.h"

namespace gr_runner {

constexpr int kNumIntInputs = 9;
extern const char* const kInputNames[kNumIntInputs];  // "token_ids", ..., "candidate_rows"

struct StepInputs {
  // In kInputNames order; token_ids is [4, Nq] row-major (item, action, time bucket, position).
  std::vector<int64_t> values[kNumIntInputs];
  int64_t num_query_tokens = 0;
};

// A view of one BatchMetadata field (kv_core.h's kMetadataFields order).
struct Field {
  const int64_t* data;
  int64_t size;
};
Field metadata_field(const gr_kv_core::BatchMetadata& meta, const char* name);

// Inputs for `batch` given the plan's metadata (whose cached_lengths say which events are new).
StepInputs build_step_inputs(const BatchView& batch, const gr_kv_core::BatchMetadata& meta, int64_t page_size,
                             int64_t max_positions);

}  // namespace gr_runner
