// The host half of a ranking step's request in C++: torch.ops.gr_kv_core.token_layout, validate_columns,
// cache_keys and pack_cached_step (a graphed cached step's ints into its staging buffer).
//
// token_layout owns one pass over a request's columns that says which query rows a step computes: per user its
// uncached history events (the events past its cached prefix) then its candidates. The semantics are
// gr_plugin.modules.tokens.host_token_layout's numpy form (the reference the tests compare against);
// this one does in one loop what that does in ~30 numpy calls, on the serving step's host path.
// Bad input (a cached length outside [0, history length], negative lengths, columns whose sizes do not
// match the lengths, lengths summing past int64) raises ValueError naming the value; nothing is read
// out of bounds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

// The step-input loops below are cloned for AVX-512 and AVX2 where the compiler can (x86-64 GCC or
// Clang with ifunc support: the variant is picked when the library loads); elsewhere one plain build.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__) && (!defined(__clang__) || __clang_major__ >= 14)
#define GR_KV_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GR_KV_CLONES
#endif

namespace gr_kv_core {
namespace {

constexpr int64_t kFeatures = 4;  // item, action, time bucket, position (EMBEDDING_KEYS)

const int64_t* int64_data(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
                    " must be a contiguous 1-D int64 CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ",
                    t.device());
  return t.data_ptr<int64_t>();
}

at::Tensor longs(int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kLong)); }

std::vector<int64_t> lengths_of(const at::Tensor& t, const char* name) {
  const int64_t* p = int64_data(t, name);
  return std::vector<int64_t>(p, p + t.numel());
}

// The sum of non-negative lengths, or ValueError where it passes int64 (a wrapped sum could match a
// column's size and let the fill run past it).
int64_t checked_sum(const std::vector<int64_t>& lengths, const char* what) {
  int64_t total = 0;
  for (int64_t v : lengths) {
    TORCH_CHECK_VALUE(!__builtin_add_overflow(total, v, &total), what, " lengths sum past 2**63 - 1");
  }
  return total;
}

// (token_ids [4 * N] (the [4, N] rows flattened), q_offsets [B+1], new_lengths [B], candidate_rows [C],
// new_rows [sum(new_lengths)]) of the layout; N = sum(new_lengths + candidate_lengths).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_layout(
    const at::Tensor& history_lengths, const at::Tensor& items, const at::Tensor& actions, const at::Tensor& times,
    const at::Tensor& candidate_lengths, const at::Tensor& candidate_items,
    const std::optional<at::Tensor>& cached_lengths, int64_t max_positions) {
  TORCH_CHECK_VALUE(max_positions >= 1, "max_positions must be at least 1, got ", max_positions);
  const int64_t bsz = history_lengths.numel();
  // NOTE: the lengths are copied once and read from the copies: another thread changing a tensor in
  // place (the op runs without the GIL) cannot make the fill below disagree with the checks.
  const std::vector<int64_t> hl = lengths_of(history_lengths, "history_lengths");
  const std::vector<int64_t> cl = lengths_of(candidate_lengths, "candidate_lengths");
  TORCH_CHECK_VALUE(static_cast<int64_t>(cl.size()) == bsz, "candidate_lengths has ", cl.size(), " entries for ",
                    bsz, " users");
  std::vector<int64_t> ca(bsz, 0);
  if (cached_lengths.has_value()) {
    ca = lengths_of(*cached_lengths, "cached_lengths");
    TORCH_CHECK_VALUE(static_cast<int64_t>(ca.size()) == bsz, "cached_lengths has ", ca.size(), " entries for ",
                      bsz, " users");
  }
  // the reference's order: every history length, every candidate length, every cached length
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(hl[b] >= 0, "history_lengths[", b, "] = ", hl[b], " is negative");
  }
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(cl[b] >= 0, "candidate_lengths[", b, "] = ", cl[b], " is negative");
  }
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(ca[b] >= 0 && ca[b] <= hl[b], "cached_lengths[", b, "] = ", ca[b], " is outside [0, ", hl[b],
                      "] (the history length)");
  }
  const int64_t num_events = checked_sum(hl, "history"), num_candidates = checked_sum(cl, "candidate");
  const int64_t num_new = num_events - checked_sum(ca, "cached");
  const int64_t* cols[3] = {int64_data(items, "history items"), int64_data(actions, "history actions"),
                            int64_data(times, "history time buckets")};
  const char* names[3] = {"item", "action", "time"};
  const at::Tensor* col_tensors[3] = {&items, &actions, &times};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(col_tensors[i]->numel() == num_events, names[i], " column has ", col_tensors[i]->numel(),
                      " entries but the history lengths sum to ", num_events);
  }
  const int64_t* cand = int64_data(candidate_items, "candidate_items");
  TORCH_CHECK_VALUE(candidate_items.numel() == num_candidates, "candidate item column has ", candidate_items.numel(),
                    " entries but the candidate lengths sum to ", num_candidates);

  const int64_t n = num_new + num_candidates;
  at::Tensor token_ids = at::zeros({kFeatures * n}, at::TensorOptions().dtype(at::kLong));
  at::Tensor q_offsets = longs(bsz + 1), new_lengths = longs(bsz), cand_rows = longs(num_candidates),
             new_rows = longs(num_new);
  int64_t* ids = token_ids.data_ptr<int64_t>();
  int64_t *qo = q_offsets.data_ptr<int64_t>(), *nl = new_lengths.data_ptr<int64_t>();
  int64_t *cr = cand_rows.data_ptr<int64_t>(), *nr = new_rows.data_ptr<int64_t>();
  const int64_t last = max_positions - 1;
  int64_t row = 0, h_off = 0, c_off = 0, n_off = 0;
  qo[0] = 0;
  for (int64_t b = 0; b < bsz; ++b) {
    const int64_t cached = ca[b], fresh = hl[b] - cached;
    nl[b] = fresh;
    const int64_t src = h_off + cached;
    for (int64_t j = 0; j < fresh; ++j, ++row) {
      for (int i = 0; i < 3; ++i) ids[i * n + row] = cols[i][src + j];
      ids[3 * n + row] = std::min(cached + j, last);
      nr[n_off + j] = row;
    }
    const int64_t cand_pos = std::min(hl[b], last);
    for (int64_t j = 0; j < cl[b]; ++j, ++row) {
      ids[row] = cand[c_off + j];  // action and time stay 0
      ids[3 * n + row] = cand_pos;
      cr[c_off + j] = row;
    }
    h_off += hl[b];
    c_off += cl[b];
    n_off += fresh;
    qo[b + 1] = row;
  }
  return {token_ids, q_offsets, new_lengths, cand_rows, new_rows};
}

// Whether any of v[0, n) lies outside [lo, hi]: one unsigned compare per value and no branch, so the
// loop vectorises (GR_KV_CLONES); a failing column is scanned again by min_max for the value to name.
GR_KV_CLONES bool any_outside(const int64_t* v, int64_t n, int64_t lo, int64_t hi) {
  if (hi < lo) return n > 0;
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  uint64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (static_cast<uint64_t>(v[i]) - static_cast<uint64_t>(lo)) > span;
  return bad != 0;
}

std::pair<int64_t, int64_t> min_max(const int64_t* v, int64_t n) {
  int64_t lo = v[0], hi = v[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  return {lo, hi};
}

// The length and id-range checks of a request's columns (gr_plugin.modules.tokens.validate_ids, whose
// numpy form is the reference): every user has >= 1 history event and >= 1 candidate, each column's
// size is its lengths' sum, and each column's ids lie in its table's range; the first failing check
// raises ValueError with the reference's message (a range names the column's min or max).
void validate_columns(const at::Tensor& history_lengths, const at::Tensor& items, const at::Tensor& actions,
                      const at::Tensor& times, const at::Tensor& candidate_lengths, const at::Tensor& candidate_items,
                      int64_t num_items, int64_t num_actions, int64_t num_time_buckets) {
  const int64_t tables[3] = {num_items, num_actions, num_time_buckets};
  const char* table_names[3] = {"num_items", "num_actions", "num_time_buckets"};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(tables[i] >= 0, table_names[i], " must be >= 0, got ", tables[i]);
  }
  const std::vector<int64_t> l[2] = {lengths_of(history_lengths, "history_lengths"),
                                     lengths_of(candidate_lengths, "candidate_lengths")};
  const char* what[2] = {"history", "candidates"};
  for (int k = 0; k < 2; ++k) {  // (the reference's order: both positivity checks, then both sums)
    for (size_t b = 0; b < l[k].size(); ++b) {
      TORCH_CHECK_VALUE(l[k][b] > 0, "user at batch index ", b, " has ", l[k][b], " ", what[k],
                        " events; at least 1 is required");
    }
  }
  const int64_t sums[2] = {checked_sum(l[0], "history"), checked_sum(l[1], "candidate")};
  struct Column {
    const char* key;
    const at::Tensor* values;
    int64_t want, lo, hi;
  };
  const Column columns[4] = {{"item", &items, sums[0], 1, num_items},
                             {"action", &actions, sums[0], 0, num_actions - 1},
                             {"time", &times, sums[0], 0, num_time_buckets - 1},
                             {"candidate item", &candidate_items, sums[1], 1, num_items}};
  for (const Column& c : columns) {
    TORCH_CHECK_VALUE(c.values->numel() == c.want, c.key, " column has ", c.values->numel(),
                      " entries but the lengths sum to ", c.want);
  }
  for (const Column& c : columns) {
    const int64_t* v = int64_data(*c.values, c.key);
    const int64_t n = c.values->numel();
    if (n == 0 || !any_outside(v, n, c.lo, c.hi)) continue;
    const auto [lo, hi] = min_max(v, n);
    TORCH_CHECK_VALUE(false, c.key, " id ", lo < c.lo ? lo : hi, " is outside the table range [", c.lo, ", ", c.hi,
                      "]");
  }
}

// One identity per history event, item << 24 | action << 16 | time (gr_plugin.modules.tokens.cache_token_keys,
// whose numpy form is the reference; the shifts wrap as numpy's do). The columns' bits are ORed as the keys are
// packed: a column whose OR has a bit at or past its field's width has an id outside [0, 2**bits).
GR_KV_CLONES void pack_keys(const int64_t* items, const int64_t* actions, const int64_t* times, int64_t* keys,
                           int64_t n, uint64_t* bits) {
  uint64_t a = 0, b = 0, c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = static_cast<uint64_t>(items[i]), y = static_cast<uint64_t>(actions[i]),
                   z = static_cast<uint64_t>(times[i]);
    a |= x;
    b |= y;
    c |= z;
    keys[i] = static_cast<int64_t>((x << 24) | (y << 16) | z);
  }
  bits[0] = a;
  bits[1] = b;
  bits[2] = c;
}

// check: ValueError for the first column (item, action, time bucket) with an id outside its bit field
// (39, 8, 16 bits), naming the column's min if it is negative else its max, as the reference does.
at::Tensor cache_keys(const at::Tensor& items, const at::Tensor& actions, const at::Tensor& times, bool check) {
  const char* names[3] = {"item", "action", "time bucket"};
  const at::Tensor* cols[3] = {&items, &actions, &times};
  const int64_t* data[3];
  const int64_t n = items.numel();
  for (int i = 0; i < 3; ++i) {
    data[i] = int64_data(*cols[i], names[i]);
    TORCH_CHECK_VALUE(cols[i]->numel() == n, names[i], " column has ", cols[i]->numel(), " entries, the item column ",
                      n);
  }
  at::Tensor keys = longs(n);
  uint64_t bits[3] = {0, 0, 0};
  if (n) pack_keys(data[0], data[1], data[2], keys.data_ptr<int64_t>(), n, bits);
  const int widths[3] = {39, 8, 16};
  for (int i = 0; check && i < 3; ++i) {
    if ((bits[i] >> widths[i]) == 0) continue;
    const auto [lo, hi] = min_max(data[i], n);
    TORCH_CHECK_VALUE(false, names[i], " id ", lo < 0 ? lo : hi, " is outside [0, 2**", widths[i],
                      ") and cannot be part of a cache key");
  }
  return keys;
}

// [start, end) of field `i` of a flat list of pairs, checked to lie in [0, size].
std::pair<int64_t, int64_t> field_of(at::IntArrayRef fields, size_t i, int64_t size, const char* what,
                                     const char* name) {
  const int64_t a = fields[2 * i], e = fields[2 * i + 1];
  TORCH_CHECK_VALUE(0 <= a && a <= e && e <= size, what, " field ", name, " [", a, ", ", e,
                    ") is not inside [0, ", size, ")");
  return {a, e};
}

// The cached graph step's int inputs packed into its bucket's host staging buffer `dst` in one pass
// (gr_plugin.modules.graphs.CachedStackGraphs._load; its numpy form, `pack_cached_numpy`, is the reference).
// `fields`: [start, end) pairs in `dst` of ids, q_offsets, rows, slots, kv_indptr, total_lengths,
// new_lengths, cand_rows, kv_indices; `meta_fields`: [start, end) pairs in the plan's host `metadata` of
// kv_indptr, kv_indices, new_token_batch, new_token_positions, total_lengths, new_lengths. Each field
// takes its values, then its fill to its end: ids 0 (4 key-major rows of the bucket's rows), q_offsets the
// bucket's rows (the padding user ends there), rows 0, slots `scratch_slots` past the real ones,
// kv_indptr the batch's page count, the lengths and cand_rows 0; kv_indices only the batch's pages (the
// kernels read no further). A new token's slot is its page's index times `page_size` plus its offset
// in the page. Returns the end of what the kernels read (kv_indices' start + the batch's pages), the
// copy's length. More values than a field holds, a scratch slot outside the table, a user's pages outside
// the batch's, a page id outside the table's `num_pages` and a new token whose page is not one of its
// user's raise ValueError, in that order, before anything is written (so every slot written lies in the
// table).
int64_t pack_cached_step(at::Tensor dst, at::IntArrayRef fields, const at::Tensor& token_ids,
                         const at::Tensor& q_offsets, const at::Tensor& new_rows, const at::Tensor& candidate_rows,
                         const at::Tensor& metadata, at::IntArrayRef meta_fields, int64_t page_size,
                         int64_t num_pages, const at::Tensor& scratch_slots) {
  enum { kIds, kQOffsets, kRows, kSlots, kIndptr, kTotal, kNew, kCandRows, kIndices, kFields };
  enum { mIndptr, mIndices, mBatch, mPositions, mTotal, mNew, kMetaFields };
  const char* names[kFields] = {"ids", "q_offsets", "rows", "slots", "kv_indptr", "total_lengths", "new_lengths",
                                "cand_rows", "kv_indices"};
  const char* meta_names[kMetaFields] = {"kv_indptr", "kv_indices", "new_token_batch", "new_token_positions",
                                         "total_lengths", "new_lengths"};
  TORCH_CHECK_VALUE(fields.size() == 2 * kFields, "fields takes ", 2 * kFields, " ints, got ", fields.size());
  TORCH_CHECK_VALUE(meta_fields.size() == 2 * kMetaFields, "meta_fields takes ", 2 * kMetaFields, " ints, got ",
                    meta_fields.size());
  TORCH_CHECK_VALUE(page_size >= 1, "page_size must be >= 1, got ", page_size);
  int64_t table_slots = 0;
  TORCH_CHECK_VALUE(num_pages >= 0 && !__builtin_mul_overflow(num_pages, page_size, &table_slots), "num_pages ",
                    num_pages, " of ", page_size, " slots is not a table size");
  int64_t* out = const_cast<int64_t*>(int64_data(dst, "dst"));
  const int64_t* meta = int64_data(metadata, "metadata");
  std::pair<int64_t, int64_t> f[kFields], mf[kMetaFields];
  for (int i = 0; i < kFields; ++i) f[i] = field_of(fields, i, dst.numel(), "dst", names[i]);
  for (int i = 0; i < kMetaFields; ++i) mf[i] = field_of(meta_fields, i, metadata.numel(), "metadata", meta_names[i]);
  auto room = [&](int i) { return f[i].second - f[i].first; };
  auto count = [&](int i) { return mf[i].second - mf[i].first; };
  const int64_t ids_room = room(kIds);
  TORCH_CHECK_VALUE(ids_room % kFeatures == 0, "the ids field holds ", ids_room, " ints, not ", kFeatures,
                    " rows of one length");
  const int64_t tokens = ids_room / kFeatures;
  TORCH_CHECK_VALUE(token_ids.numel() % kFeatures == 0, "token_ids has ", token_ids.numel(), " entries, not ",
                    kFeatures, " rows of one length");
  const int64_t nq = token_ids.numel() / kFeatures, bsz = count(mIndptr) - 1, pages = count(mIndices),
                n = count(mBatch);
  const at::Tensor* values[kFields] = {&token_ids, &q_offsets, &new_rows, nullptr, nullptr, nullptr, nullptr,
                                       &candidate_rows, nullptr};
  const int64_t* data[kFields] = {};
  int64_t sizes[kFields] = {nq,  q_offsets.numel(), new_rows.numel(), n, bsz + 1, count(mTotal), count(mNew),
                            candidate_rows.numel(), pages};
  const char* value_names[kFields] = {"token_ids", "q_offsets", "new_rows", "", "", "", "", "candidate_rows", ""};
  for (int i = 0; i < kFields; ++i) {
    if (values[i] != nullptr) data[i] = int64_data(*values[i], value_names[i]);
    const int64_t have = i == kIds ? tokens : room(i);
    TORCH_CHECK_VALUE(sizes[i] <= have, names[i], " has ", sizes[i], i == kIds ? " rows" : " entries",
                      " but its field holds ", have);
  }
  TORCH_CHECK_VALUE(bsz >= 0 && count(mTotal) == bsz && count(mNew) == bsz && count(mPositions) == n,
                    "metadata fields disagree: kv_indptr ", bsz + 1, ", total_lengths ", count(mTotal),
                    ", new_lengths ", count(mNew), ", new_token_batch ", n, ", new_token_positions ",
                    count(mPositions));
  TORCH_CHECK_VALUE(scratch_slots.numel() == room(kSlots), "scratch_slots has ", scratch_slots.numel(),
                    " entries for a slots field of ", room(kSlots));
  const int64_t* scratch = int64_data(scratch_slots, "scratch_slots");
  for (int64_t j = 0; j < room(kSlots); ++j) {
    TORCH_CHECK_VALUE(0 <= scratch[j] && scratch[j] < table_slots, "scratch_slots[", j, "] = ", scratch[j],
                      " is not a slot of the table's ", table_slots);
  }
  const int64_t* indptr = meta + mf[mIndptr].first;
  const int64_t* indices = meta + mf[mIndices].first;
  const int64_t* batch = meta + mf[mBatch].first;
  const int64_t* pos = meta + mf[mPositions].first;
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(0 <= indptr[b] && indptr[b] <= indptr[b + 1] && indptr[b + 1] <= pages, "kv_indptr[", b,
                      ":", b + 2, "] = [", indptr[b], ", ", indptr[b + 1], "] is not a range inside [0, ", pages, "]");
  }
  for (int64_t j = 0; j < pages; ++j) {
    TORCH_CHECK_VALUE(0 <= indices[j] && indices[j] < num_pages, "kv_indices[", j, "] = ", indices[j],
                      " is not a page of the table's ", num_pages);
  }
  // NOTE: the slots are computed before anything is written, so a bad token leaves `dst` as it was.
  std::vector<int64_t> slots(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = batch[i], p = pos[i];
    TORCH_CHECK_VALUE(0 <= b && b < bsz, "new token ", i, " belongs to batch row ", b, " of ", bsz);
    const int64_t page = p / page_size;
    TORCH_CHECK_VALUE(p >= 0 && page < indptr[b + 1] - indptr[b], "new token ", i, " at position ", p,
                      " lies past user ", b, "'s ", indptr[b + 1] - indptr[b], " pages of ", page_size);
    slots[i] = indices[indptr[b] + page] * page_size + (p - page * page_size);
  }
  auto put = [&](int i, const int64_t* v, int64_t k, int64_t fill) {
    int64_t* o = out + f[i].first;
    if (k) std::memcpy(o, v, k * sizeof(int64_t));
    std::fill(o + k, out + f[i].second, fill);
  };
  for (int64_t r = 0; r < kFeatures; ++r) {
    int64_t* o = out + f[kIds].first + r * tokens;
    if (nq) std::memcpy(o, data[kIds] + r * nq, nq * sizeof(int64_t));
    std::fill(o + nq, o + tokens, 0);
  }
  put(kQOffsets, data[kQOffsets], sizes[kQOffsets], tokens);
  put(kCandRows, data[kCandRows], sizes[kCandRows], 0);
  put(kRows, data[kRows], sizes[kRows], 0);
  if (n) std::memcpy(out + f[kSlots].first, slots.data(), n * sizeof(int64_t));
  std::copy(scratch + n, scratch + room(kSlots), out + f[kSlots].first + n);
  put(kIndptr, indptr, bsz + 1, pages);
  put(kTotal, meta + mf[mTotal].first, bsz, 0);
  put(kNew, meta + mf[mNew].first, bsz, 0);
  if (pages) std::memcpy(out + f[kIndices].first, indices, pages * sizeof(int64_t));
  return f[kIndices].first + pages;
}

}  // namespace
}  // namespace gr_kv_core

TORCH_LIBRARY_FRAGMENT(gr_kv_core, m) {
  m.def("token_layout(Tensor history_lengths, Tensor items, Tensor actions, Tensor times, Tensor candidate_lengths, "
        "Tensor candidate_items, Tensor? cached_lengths, int max_positions) -> "
        "(Tensor token_ids, Tensor q_offsets, Tensor new_lengths, Tensor candidate_rows, Tensor new_rows)",
        gr_kv_core::token_layout);
  m.def("validate_columns(Tensor history_lengths, Tensor items, Tensor actions, Tensor times, "
        "Tensor candidate_lengths, Tensor candidate_items, int num_items, int num_actions, int num_time_buckets) -> ()",
        gr_kv_core::validate_columns);
  m.def("cache_keys(Tensor items, Tensor actions, Tensor times, bool check) -> Tensor", gr_kv_core::cache_keys);
  m.def("pack_cached_step(Tensor(a!) dst, int[] fields, Tensor token_ids, Tensor q_offsets, Tensor new_rows, "
        "Tensor candidate_rows, Tensor metadata, int[] meta_fields, int page_size, int num_pages, "
        "Tensor scratch_slots) -> int",
        gr_kv_core::pack_cached_step);
}
