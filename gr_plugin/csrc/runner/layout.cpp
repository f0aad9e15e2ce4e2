// build_step_inputs of layout.h.
#include "layout.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gr_runner {

const char* const kInputNames[kNumIntInputs] = {"token_ids",  "q_offsets",       "new_rows",
                                                "slots",      "kv_indices",      "kv_indptr",
                                                "history_lengths", "new_lengths", "candidate_rows"};

Field metadata_field(const gr_kv_core::BatchMetadata& meta, const char* name) {
  const int64_t B = meta.batch_size, M = meta.num_batch_pages, N = meta.num_new_tokens;
  // NOTE: lengths of kMetadataFields in order (kv_core.cpp, build_metadata).
  const int64_t sizes[gr_kv_core::kNumMetadataFields] = {B + 1, B, B, B, B, B + 1, B + 1, M, N, N};
  int64_t at = 0;
  for (int i = 0; i < gr_kv_core::kNumMetadataFields; ++i) {
    if (std::strcmp(gr_kv_core::kMetadataFields[i], name) == 0) return Field{meta.buffer.data() + at, sizes[i]};
    at += sizes[i];
  }
  throw std::invalid_argument(std::string("no metadata field '") + name + "'");
}

StepInputs build_step_inputs(const BatchView& batch, const gr_kv_core::BatchMetadata& meta, int64_t page_size,
                             int64_t max_positions) {
  const int64_t B = batch.batch_size;
  if (meta.batch_size != B) {
    throw std::invalid_argument("plan is for " + std::to_string(meta.batch_size) + " users, batch has " + std::to_string(B));
  }
  const Field cached = metadata_field(meta, "cached_lengths");
  const Field total = metadata_field(meta, "total_lengths");
  const Field indptr = metadata_field(meta, "kv_indptr");
  const Field indices = metadata_field(meta, "kv_indices");
  StepInputs in;
  auto& [token_ids, q_offsets, new_rows, slots, kv_indices, kv_indptr, history_lengths, new_lengths, candidate_rows] =
      in.values;
  int64_t nq = 0;
  q_offsets.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    if (total.data[b] != batch.history_lengths[b]) {
      throw std::invalid_argument("plan has " + std::to_string(total.data[b]) + " history events for user " +
                                  std::to_string(batch.user_ids[b]) + ", the batch " +
                                  std::to_string(batch.history_lengths[b]));
    }
    nq += total.data[b] - cached.data[b] + batch.candidate_lengths[b];
    q_offsets.push_back(nq);
  }
  in.num_query_tokens = nq;
  token_ids.resize(static_cast<size_t>(4 * nq));
  int64_t* item = token_ids.data();
  int64_t* action = item + nq;
  int64_t* time = action + nq;
  int64_t* position = time + nq;
  const int64_t last = max_positions - 1;
  const int64_t* events = batch.events;  // this user's first event
  const int64_t* cands = batch.candidate_items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = total.data[b], c = cached.data[b], n = L - c, C = batch.candidate_lengths[b];
    const int64_t row0 = q_offsets[b];
    const int64_t* pages = indices.data + indptr.data[b];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = row0 + i, pos = c + i;
      item[r] = events[3 * pos];
      action[r] = events[3 * pos + 1];
      time[r] = events[3 * pos + 2];
      position[r] = std::min(pos, last);
      new_rows.push_back(r);
      slots.push_back(pages[pos / page_size] * page_size + pos % page_size);
    }
    for (int64_t j = 0; j < C; ++j) {
      const int64_t r = row0 + n + j;
      item[r] = cands[j];
      action[r] = 0;
      time[r] = 0;
      position[r] = std::min(L, last);
      candidate_rows.push_back(r);
    }
    history_lengths.push_back(L);
    new_lengths.push_back(n);
    events += 3 * L;
    cands += C;
  }
  kv_indices.assign(indices.data, indices.data + indices.size);
  kv_indptr.assign(indptr.data, indptr.data + indptr.size);
  return in;
}

}  // namespace gr_runner
