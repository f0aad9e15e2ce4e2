// The gr_kv op schemas and their CPU kernels (ATen, no Python).
//
// Owns: the schemas of gr_kv::append_kv, gr_kv::paged_hstu_attention, gr_kv::hstu_attention_jagged (and its
// backward, gr_kv::hstu_attention_jagged_backward, which CPU training runs), their
// whole-table forms gr_kv::append_kv_layer and gr_kv::paged_hstu_attention_layer, gr_kv::gather_pages and
// gr_kv::scatter_pages (frozen: docs/EXPORT.md), their boundary checks, and the
// CPU kernels (gather/scatter: one kernel for every device, ATen index ops). The semantics are those of the
// pure-torch references (gr_plugin/cache/paged_ops.py, gr_plugin/ops/pytorch/hstu_attention.py):
//   out_i = sum_j mask_ij * SiLU(alpha * <q_i, k_j>) / n_norm * v_j, per head;
//   a history token sees history at or before its position, a candidate sees the whole history and itself.
// Does not own: fake (meta) kernels and the CUDA kernels (Python, gr_plugin/ops/library.py), cache policy.
//
// Every check runs before anything is written and raises c10::ValueError (Python: ValueError) naming
// the offending value, so a bad call leaves the KV table as it was.

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace gr_kv {
namespace {

using at::Tensor;

// Python spelling of a dtype ("torch.float64"), so messages read the same from C++ and Python.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string shape_str(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    s += std::to_string(t.size(i));
    if (t.dim() == 1 || i + 1 < t.dim()) s += ",";
    if (i + 1 < t.dim()) s += " ";
  }
  return s + ")";
}

// kv_layer [num_pages, 2, P, H, D]; k or v [M, H, D] of its dtype and device.
void check_table(const Tensor& kv_layer, const Tensor& k, const char* name) {
  TORCH_CHECK_VALUE(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.size(2) > 0,
                    "kv_layer must be [num_pages, 2, P, H, D] with P > 0, got ", shape_str(kv_layer));
  TORCH_CHECK_VALUE(k.dim() == 3 && k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4), name,
                    " must be [M, ", kv_layer.size(3), ", ", kv_layer.size(4), "], got ", shape_str(k));
  TORCH_CHECK_VALUE(k.scalar_type() == kv_layer.scalar_type() && k.device() == kv_layer.device(), name, " is ",
                    dtype_name(k.scalar_type()), " on ", k.device(), ", kv_layer is ",
                    dtype_name(kv_layer.scalar_type()), " on ", kv_layer.device());
}

void check_index(const char* name, const Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong && t.dim() == 1, name, " must be a 1-D int64 tensor, got ",
                    dtype_name(t.scalar_type()), " of shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), ", expected ", device);
}

void check_float(const Tensor& q) {
  const auto t = q.scalar_type();
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
                    "q must be a floating tensor (float32, float64, float16, bfloat16), got ", dtype_name(t));
}

// q, k, v of an attention op: one floating dtype and one device.
void check_qkv_types(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type() &&
                        q.device() == k.device() && v.device() == k.device(),
                    "q, k, v must share a dtype and device, got ", dtype_name(q.scalar_type()), " on ", q.device(),
                    ", ", dtype_name(k.scalar_type()), " on ", k.device(), ", ", dtype_name(v.scalar_type()),
                    " on ", v.device());
  check_float(q);
}

// offsets [B+1]: 0, non-decreasing, ending at `total` rows.
void check_offsets(const char* name, const Tensor& offsets, int64_t total, const char* rows) {
  const auto o = offsets.accessor<int64_t, 1>();
  const int64_t n = offsets.size(0);
  TORCH_CHECK_VALUE(n >= 1, name, " must have B+1 >= 1 entries, got 0");
  TORCH_CHECK_VALUE(o[0] == 0, name, "[0] must be 0, got ", o[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    TORCH_CHECK_VALUE(o[b + 1] >= o[b], name, " must be non-decreasing, got ", name, "[", b, "] = ", o[b], " > ",
                      name, "[", b + 1, "] = ", o[b + 1]);
  }
  TORCH_CHECK_VALUE(o[n - 1] == total, name, "[-1] = ", o[n - 1], " but ", rows, " has ", total, " rows");
}

void check_size(const char* name, const Tensor& t, int64_t want, const char* what) {
  TORCH_CHECK_VALUE(t.size(0) == want, name, " has ", t.size(0), " entries, expected ", want, " (", what, ")");
}

// Strided [*, H, D] rows of one tensor: element (row, h, d).
template <typename scalar_t>
struct Rows {
  const scalar_t* p;
  int64_t s0, s1, s2;
  Rows(const Tensor& t)
      : p(t.const_data_ptr<scalar_t>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)) {}
  const scalar_t* at(int64_t row, int64_t h) const { return p + row * s0 + h * s1; }
};

// One user's queries against its history, with GEMMs over all heads (bmm, [H, rows, keys]), in the
// op-math dtype (fp32 for fp16/bf16). q, k, v: the user's query rows [n, H, D], the first num_causal of
// them history tokens at positions first_pos + i (they see history positions <= their own), the rest
// candidates (the whole history, plus their own k/v, which are never in the history). k_hist, v_hist:
// the user's history [L, H, D]. Writes out [n, H, D] (a view of the op's output).
void attend_user(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_hist, const Tensor& v_hist,
                 int64_t num_causal, int64_t first_pos, double alpha, double n_norm, const Tensor& out) {
  const at::ScalarType acc = at::toOpMathType(q.scalar_type());
  const Tensor kt = k_hist.to(acc).permute({1, 2, 0});  // [H, D, L]
  const Tensor vh = v_hist.to(acc).transpose(0, 1);     // [H, L, D]
  const auto silu_weights = [&](Tensor s) {  // SiLU(alpha * s) / n_norm, in place
    s.mul_(alpha);
    at::silu_(s);
    return s.div_(n_norm);
  };
  const int64_t n = q.size(0), num_cand = n - num_causal;
  if (num_causal > 0) {
    // NOTE: tril_(first_pos) keeps key j <= first_pos + i for row i: the causal mask of a new history token.
    const Tensor w = silu_weights(at::bmm(q.narrow(0, 0, num_causal).to(acc).transpose(0, 1), kt)).tril_(first_pos);
    out.narrow(0, 0, num_causal).copy_(at::bmm(w, vh).transpose(0, 1));
  }
  if (num_cand > 0) {
    const Tensor qc = q.narrow(0, num_causal, num_cand).to(acc);  // [C, H, D]
    Tensor o = at::bmm(silu_weights(at::bmm(qc.transpose(0, 1), kt)), vh);  // [H, C, D]
    const Tensor self_w = silu_weights((qc * k.narrow(0, num_causal, num_cand).to(acc)).sum(-1));  // [C, H]
    o.add_(self_w.t().unsqueeze(-1) * v.narrow(0, num_causal, num_cand).to(acc).transpose(0, 1));
    out.narrow(0, num_causal, num_cand).copy_(o.transpose(0, 1));
  }
}

// A piece of a batch's attention: heads [h0, h0 + nh) of user b, and its size (query rows x keys x heads).
struct Piece {
  int64_t b, h0, nh;
  double cost;
};

// Runs body(piece) over the batch's users, in parallel on the intra-op threads, costliest first, each thread
// taking the next piece as it frees up (longest-processing-time first). A user costing more than 1.25 even
// shares of the batch is cut into head ranges (up to one per thread), so one long history does not run on
// one thread while the others idle: its GEMMs run single-threaded inside the parallel region (a user just
// over one share is not cut: its pieces' fixed costs would outweigh the gain). One piece, or one thread, runs
// inline, where the ATen ops use the threads themselves. Each piece writes only its own output rows x heads
// (no cross-piece reduction), so at a given thread count repeated calls give the same bits, as far as the
// BLAS keeps its code path (after a change of the thread count MKL was seen to vary cut users' GEMMs by
// ~2e-8; MKL_CBWR=COMPATIBLE pins it). Across thread counts a cut user's bits may differ at that level.
// NOTE: measured on the CPU dev box (2 threads; `scripts/bench_cpu_attention.py`, docs/BENCHMARKS.md,
// "The CPU attention"): with one task per user in static chunks, a batch of one 1024-event history and seven
// of 32 took 1.9x the long user's time alone.
// The piece's heads of t (dimension dim); t itself where the piece holds them all (no view to make).
Tensor head_range(const Tensor& t, const Piece& w, int64_t heads, int64_t dim) {
  return w.nh == heads ? t : t.narrow(dim, w.h0, w.nh);
}

template <typename Cost, typename Body>
void for_each_piece(int64_t bsz, int64_t heads, const Cost& cost, const Body& body) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<double> costs(bsz);
  double total = 0;
  for (int64_t b = 0; b < bsz; ++b) total += (costs[b] = cost(b));
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < bsz; ++b) {
    if (costs[b] <= 0) continue;
    const double shares = costs[b] * threads / total;  // even shares of the batch it holds
    const int64_t most = std::max<int64_t>(1, std::min(heads, threads));
    const int64_t cuts = threads > 1 && shares > 1.25 ? std::min(most, static_cast<int64_t>(std::ceil(shares))) : 1;
    for (int64_t i = 0; i < cuts; ++i) {
      const int64_t h0 = heads * i / cuts, h1 = heads * (i + 1) / cuts;
      pieces.push_back({b, h0, h1 - h0, costs[b] * (h1 - h0) / heads});
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& c) { return a.cost > c.cost; });
  if (threads <= 1 || pieces.size() <= 1) {
    at::AutoDispatchBelowADInplaceOrView guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (const Piece& p : pieces) body(p);
    return;
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, static_cast<int64_t>(pieces.size())), 1, [&](int64_t, int64_t) {
    // NOTE: thread-local, so set in every worker: below autograd, and without autocast (whose per-thread state
    // the OpenMP workers do not inherit: under a caller's bf16 autocast the pieces run on the calling thread
    // took bf16 GEMMs and the others fp32, so the bits followed the schedule)
    at::AutoDispatchBelowADInplaceOrView guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) body(pieces[i]);
  });
}

// ---------------------------------------------------------------------------------------------------
// append_kv: kv_layer[page(slots[i]), {0,1}, offset(slots[i])] = k[rows[i]], v[rows[i]]

void append_kv_cpu(const Tensor& kv_layer, const Tensor& k, const Tensor& v, const Tensor& slots,
                   const Tensor& rows) {
  check_table(kv_layer, k, "k");
  check_table(kv_layer, v, "v");
  check_index("slots", slots, kv_layer.device());
  check_index("rows", rows, kv_layer.device());
  TORCH_CHECK_VALUE(slots.numel() == rows.numel(), "slots has ", slots.numel(), " entries, rows has ",
                    rows.numel());
  TORCH_CHECK_VALUE(k.size(0) == v.size(0), "k has ", k.size(0), " rows, v has ", v.size(0));
  const int64_t n = slots.numel(), page_size = kv_layer.size(2), num_slots = kv_layer.size(0) * page_size;
  const Tensor s_t = slots.contiguous(), r_t = rows.contiguous();
  const int64_t *s = s_t.const_data_ptr<int64_t>(), *r = r_t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // NOTE: every index is checked before the first write
    TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < num_slots, "slots[", i, "] = ", s[i], " is outside [0, ", num_slots,
                      ") (num_pages * page_size)");
    TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < k.size(0), "rows[", i, "] = ", r[i], " is outside [0, ", k.size(0),
                      ") (rows of k/v)");
  }
  {  // NOTE: two writes to one slot would race across parallel chunks: the result would depend on timing
    std::vector<int64_t> sorted(s, s + n);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK_VALUE(dup == sorted.end(), "slots has slot ", dup == sorted.end() ? 0 : *dup,
                      " more than once (each new token needs its own slot)");
  }
  const int64_t heads = kv_layer.size(3), dim = kv_layer.size(4);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_layer.scalar_type(), "gr_kv::append_kv", [&] {
    scalar_t* out = kv_layer.data_ptr<scalar_t>();
    const Rows<scalar_t> kr(k), vr(v);
    const int64_t p0 = kv_layer.stride(0), p1 = kv_layer.stride(1), p2 = kv_layer.stride(2),
                  p3 = kv_layer.stride(3), p4 = kv_layer.stride(4);
    at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        scalar_t* dst = out + (s[i] / page_size) * p0 + (s[i] % page_size) * p2;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* ks = kr.at(r[i], h);
          const scalar_t* vs = vr.at(r[i], h);
          for (int64_t d = 0; d < dim; ++d) {
            dst[h * p3 + d * p4] = ks[d * kr.s2];
            dst[p1 + h * p3 + d * p4] = vs[d * vr.s2];
          }
        }
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------
// paged_hstu_attention: queries of user b are its new history tokens, then its candidates.

Tensor paged_hstu_attention_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_layer,
                                const Tensor& kv_indices, const Tensor& kv_indptr,
                                const Tensor& history_lengths, const Tensor& q_offsets,
                                const Tensor& new_lengths, double alpha, double n_norm) {
  check_table(kv_layer, k, "k");
  TORCH_CHECK_VALUE(q.sizes() == k.sizes() && v.sizes() == k.sizes(), "q, k, v must share a shape, got ",
                    shape_str(q), ", ", shape_str(k), ", ", shape_str(v));
  check_qkv_types(q, k, v);
  const std::pair<const char*, const Tensor*> index_args[] = {
      {"kv_indices", &kv_indices}, {"kv_indptr", &kv_indptr}, {"history_lengths", &history_lengths},
      {"q_offsets", &q_offsets}, {"new_lengths", &new_lengths}};
  for (const auto& [name, t] : index_args) check_index(name, *t, q.device());
  TORCH_CHECK_VALUE(n_norm > 0, "n_norm must be > 0, got ", n_norm);
  const int64_t nq = q.size(0), bsz = q_offsets.size(0) - 1;
  check_offsets("q_offsets", q_offsets, nq, "q");
  check_size("kv_indptr", kv_indptr, bsz + 1, "B+1, from q_offsets");
  check_size("history_lengths", history_lengths, bsz, "B, from q_offsets");
  check_size("new_lengths", new_lengths, bsz, "B, from q_offsets");
  check_offsets("kv_indptr", kv_indptr, kv_indices.size(0), "kv_indices");
  const Tensor qo_t = q_offsets.contiguous(), ptr_t = kv_indptr.contiguous(), idx_t = kv_indices.contiguous(),
               hist_t = history_lengths.contiguous(), new_t = new_lengths.contiguous();
  const int64_t *qo = qo_t.const_data_ptr<int64_t>(), *ptr = ptr_t.const_data_ptr<int64_t>(),
                *idx = idx_t.const_data_ptr<int64_t>(), *hist = hist_t.const_data_ptr<int64_t>(),
                *newl = new_t.const_data_ptr<int64_t>();
  const int64_t page_size = kv_layer.size(2), num_pages = kv_layer.size(0);
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(hist[b] >= 0, "history_lengths[", b, "] = ", hist[b], " is negative");
    TORCH_CHECK_VALUE(newl[b] >= 0 && newl[b] <= hist[b], "new_lengths[", b, "] = ", newl[b],
                      " is outside [0, history_lengths[", b, "] = ", hist[b], "]");
    TORCH_CHECK_VALUE(qo[b + 1] - qo[b] >= newl[b], "user ", b, " has ", qo[b + 1] - qo[b],
                      " query tokens (q_offsets) but new_lengths[", b, "] = ", newl[b]);
    // NOTE: no hist + P - 1: a huge length would wrap negative and pass the checks below.
    const int64_t pages = hist[b] / page_size + (hist[b] % page_size != 0);
    TORCH_CHECK_VALUE(ptr[b + 1] - ptr[b] >= pages, "user ", b, " has ", ptr[b + 1] - ptr[b],
                      " pages (kv_indptr) for history_lengths[", b, "] = ", hist[b], " (", pages, " pages of ",
                      page_size, ")");
    for (int64_t p = ptr[b]; p < ptr[b] + pages; ++p) {
      TORCH_CHECK_VALUE(idx[p] >= 0 && idx[p] < num_pages, "kv_indices[", p, "] = ", idx[p], " is outside [0, ",
                        num_pages, ")");
    }
  }
  Tensor out = at::empty_like(q);
  const int64_t heads = q.size(1), dim = q.size(2);
  if (nq == 0) return out;
  const Tensor k_table = kv_layer.select(1, 0), v_table = kv_layer.select(1, 1);  // [num_pages, P, H, D]
  const auto cost = [&](int64_t b) { return static_cast<double>(qo[b + 1] - qo[b]) * (hist[b] + 1); };
  for_each_piece(bsz, heads, cost, [&](const Piece& w) {
    const int64_t b = w.b, n = qo[b + 1] - qo[b], n_hist = hist[b], n_new = newl[b];
    const auto rows = [&](const Tensor& t) { return head_range(t.narrow(0, qo[b], n), w, heads, 1); };
    // the user's history K/V of these heads, gathered from its pages: [L, nh, D]
    const int64_t num_user_pages = n_hist / page_size + (n_hist % page_size != 0);
    const Tensor pages = idx_t.narrow(0, ptr[b], num_user_pages);
    const auto gather = [&](const Tensor& table) {
      return head_range(table, w, heads, 2).index_select(0, pages)
          .reshape({num_user_pages * page_size, w.nh, dim}).narrow(0, 0, n_hist);
    };
    attend_user(rows(q), rows(k), rows(v), gather(k_table), gather(v_table), n_new, n_hist - n_new, alpha,
                n_norm, rows(out));
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// hstu_attention_jagged: sequence b is seq_offsets[b]..seq_offsets[b+1], its last num_candidates[b]
// tokens are candidates.

// The checks of the jagged form's inputs; the sequences' offsets and candidate counts as host arrays.
struct JaggedInputs {
  Tensor so_t, nc_t;
  const int64_t *so, *nc;
  int64_t total, bsz;
};

JaggedInputs check_jagged(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                          const Tensor& num_candidates, double n_norm) {
  TORCH_CHECK_VALUE(q.sizes() == k.sizes() && v.sizes() == k.sizes() && q.dim() == 3,
                    "q, k, v must share a [T, H, D] shape, got ", shape_str(q), ", ", shape_str(k), ", ",
                    shape_str(v));
  check_qkv_types(q, k, v);
  check_index("seq_offsets", seq_offsets, q.device());
  check_index("num_candidates", num_candidates, q.device());
  TORCH_CHECK_VALUE(n_norm > 0, "n_norm must be > 0, got ", n_norm);
  const int64_t total = q.size(0), bsz = seq_offsets.size(0) - 1;
  check_offsets("seq_offsets", seq_offsets, total, "q");
  check_size("num_candidates", num_candidates, bsz, "B, from seq_offsets");
  JaggedInputs in{seq_offsets.contiguous(), num_candidates.contiguous(), nullptr, nullptr, total, bsz};
  in.so = in.so_t.const_data_ptr<int64_t>();
  in.nc = in.nc_t.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < bsz; ++b) {
    TORCH_CHECK_VALUE(in.nc[b] >= 0 && in.nc[b] <= in.so[b + 1] - in.so[b], "num_candidates[", b, "] = ", in.nc[b],
                      " is outside [0, ", in.so[b + 1] - in.so[b], "] (the sequence length)");
  }
  return in;
}

// Runs body(piece, start, n, n_hist) over the pieces of a jagged batch (`for_each_piece`, cost n^2 a user).
template <typename Body>
void for_each_jagged_piece(const JaggedInputs& in, int64_t heads, const Body& body) {
  const auto cost = [&](int64_t b) {
    return static_cast<double>(in.so[b + 1] - in.so[b]) * (in.so[b + 1] - in.so[b]);
  };
  for_each_piece(in.bsz, heads, cost, [&](const Piece& w) {
    const int64_t start = in.so[w.b], n = in.so[w.b + 1] - start;
    body(w, start, n, n - in.nc[w.b]);
  });
}

Tensor hstu_attention_jagged_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                                 const Tensor& num_candidates, double alpha, double n_norm) {
  const JaggedInputs in = check_jagged(q, k, v, seq_offsets, num_candidates, n_norm);
  Tensor out = at::empty_like(q);
  if (in.total == 0) return out;
  const int64_t heads = q.size(1);
  for_each_jagged_piece(in, heads, [&](const Piece& w, int64_t start, int64_t n, int64_t n_hist) {
    const auto rows = [&](const Tensor& t) { return head_range(t.narrow(0, start, n), w, heads, 1); };
    const Tensor qu = rows(q), ku = rows(k), vu = rows(v);
    attend_user(qu, ku, vu, ku.narrow(0, 0, n_hist), vu.narrow(0, 0, n_hist), n_hist, 0, alpha, n_norm, rows(out));
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// hstu_attention_jagged_backward: (dq, dk, dv) of hstu_attention_jagged given grad_out, per user and head
// range, in the op-math dtype. With s = alpha q_i.k_j and the mask m (j <= i, and j in the history or
// j == i): dv = (m SiLU(s))^T do / n_norm; dp = m (do v^T) SiLU'(s); dq = dp k alpha / n_norm,
// dk = dp^T q alpha / n_norm; SiLU'(s) = sig(s) (1 + s (1 - sig(s))). One user's [H, n, n] scores at a time.

// Zeroes the pairs the mask drops from x [H, n, n] (rows i, keys j), in place: j > i, and a candidate's key
// (j >= n_hist) on any row but its own.
void mask_pairs_(const Tensor& x, int64_t n_hist) {
  const int64_t n = x.size(1);
  x.tril_();
  // (candidate key j = n_hist + c, column c of the view: after tril_ c <= i - n_hist; keep c == i - n_hist)
  if (n_hist < n) x.narrow(2, n_hist, n - n_hist).triu_(-n_hist);
}

void attend_user_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, int64_t n_hist,
                          double alpha, double n_norm, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const at::ScalarType acc = at::toOpMathType(q.scalar_type());
  const Tensor qh = q.to(acc).transpose(0, 1), kh = k.to(acc).transpose(0, 1);  // [H, n, D]
  const Tensor vh = v.to(acc).transpose(0, 1), doh = dout.to(acc).transpose(0, 1);
  // NOTE: three [H, n, n] buffers at once: s (then SiLU'(s)), sig, and w (then dp).
  const Tensor s = at::bmm(qh, kh.transpose(1, 2)).mul_(alpha);
  const Tensor sig = at::sigmoid(s);
  Tensor w = s * sig;
  mask_pairs_(w, n_hist);
  dv.copy_(at::bmm(w.transpose(1, 2), doh).div_(n_norm).transpose(0, 1));
  const Tensor dp = at::bmm_out(w, doh, vh.transpose(1, 2));  // do v^T, into w's buffer
  s.addcmul_(s, sig, -1).add_(1).mul_(sig);  // SiLU'(s) = sig (1 + s (1 - sig)), in place
  mask_pairs_(dp.mul_(s), n_hist);
  dq.copy_(at::bmm(dp, kh).mul_(alpha / n_norm).transpose(0, 1));
  dk.copy_(at::bmm(dp.transpose(1, 2), qh).mul_(alpha / n_norm).transpose(0, 1));
}

std::tuple<Tensor, Tensor, Tensor> hstu_attention_jagged_backward_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
    const Tensor& num_candidates, double alpha, double n_norm) {
  const JaggedInputs in = check_jagged(q, k, v, seq_offsets, num_candidates, n_norm);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == q.scalar_type() &&
                        grad_out.device() == q.device(),
                    "grad_out must be q's shape, dtype and device, got ", shape_str(grad_out), " ",
                    dtype_name(grad_out.scalar_type()), " on ", grad_out.device(), " for ", shape_str(q), " ",
                    dtype_name(q.scalar_type()), " on ", q.device());
  // (every row of every sequence is written: the offsets end at q's row count)
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous), dk = at::empty_like(dq), dv = at::empty_like(dq);
  if (in.total == 0) return {dq, dk, dv};
  const int64_t heads = q.size(1);
  for_each_jagged_piece(in, heads, [&](const Piece& w, int64_t start, int64_t n, int64_t n_hist) {
    const auto rows = [&](const Tensor& t) { return head_range(t.narrow(0, start, n), w, heads, 1); };
    attend_user_backward(rows(q), rows(k), rows(v), rows(grad_out), n_hist, alpha, n_norm, rows(dq), rows(dk),
                         rows(dv));
  });
  return {dq, dk, dv};
}

// ---------------------------------------------------------------------------------------------------
// append_kv_layer / paged_hstu_attention_layer: the same on layer `layer` of the whole table
// kv_table [L, num_pages, 2, P, H, D]. A compiled graph then passes the table itself (storage offset
// 0) instead of a view per layer: AOTInductor drops a mutable view's storage offset under dynamic
// shapes (pytorch/pytorch#198068), which a dynamic page dimension makes every layer's view have.

Tensor table_layer(const Tensor& kv_table, int64_t layer) {
  TORCH_CHECK_VALUE(kv_table.dim() == 6, "kv_table must be [L, num_pages, 2, P, H, D], got ", shape_str(kv_table));
  TORCH_CHECK_VALUE(layer >= 0 && layer < kv_table.size(0), "layer ", layer, " is outside [0, ", kv_table.size(0),
                    ") (layers of kv_table)");
  return kv_table.select(0, layer);
}

void append_kv_layer_cpu(const Tensor& kv_table, int64_t layer, const Tensor& k, const Tensor& v,
                         const Tensor& slots, const Tensor& rows) {
  append_kv_cpu(table_layer(kv_table, layer), k, v, slots, rows);
}

Tensor paged_hstu_attention_layer_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_table,
                                      int64_t layer, const Tensor& kv_indices, const Tensor& kv_indptr,
                                      const Tensor& history_lengths, const Tensor& q_offsets,
                                      const Tensor& new_lengths, double alpha, double n_norm) {
  return paged_hstu_attention_cpu(q, k, v, table_layer(kv_table, layer), kv_indices, kv_indptr, history_lengths,
                                  q_offsets, new_lengths, alpha, n_norm);
}

// ---------------------------------------------------------------------------------------------------
// gather_pages / scatter_pages: whole pages of every layer between the table and a contiguous staging
// tensor [L, M, 2, P, H, D] (what offload reads and onboard writes), one call for all layers.

// kv_table [L, num_pages, 2, P, H, D]; pages [M] int64 on its device (values checked on the CPU only:
// reading CUDA values would sync the device).
void check_pages(const Tensor& kv_table, const Tensor& pages) {
  TORCH_CHECK_VALUE(kv_table.dim() == 6 && kv_table.size(2) == 2 && kv_table.size(3) > 0,
                    "kv_table must be [L, num_pages, 2, P, H, D] with P > 0, got ", shape_str(kv_table));
  check_index("pages", pages, kv_table.device());
  if (pages.device().is_cpu()) {
    const auto p = pages.accessor<int64_t, 1>();
    const int64_t n = kv_table.size(1);
    for (int64_t i = 0; i < pages.size(0); ++i) {
      TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < n, "pages[", i, "] = ", p[i], " is outside [0, ", n, ") (num_pages)");
    }
  }
}

Tensor gather_pages(const Tensor& kv_table, const Tensor& pages) {
  check_pages(kv_table, pages);
  return kv_table.index_select(1, pages);
}

void scatter_pages(const Tensor& kv_table, const Tensor& staging, const Tensor& pages) {
  check_pages(kv_table, pages);
  std::vector<int64_t> want(kv_table.sizes().begin(), kv_table.sizes().end());
  want[1] = pages.size(0);
  TORCH_CHECK_VALUE(staging.sizes() == at::IntArrayRef(want), "staging must be [", want[0], ", ", want[1], ", ",
                    want[2], ", ", want[3], ", ", want[4], ", ", want[5], "] (one block per page), got ",
                    shape_str(staging));
  TORCH_CHECK_VALUE(staging.scalar_type() == kv_table.scalar_type() && staging.device() == kv_table.device(),
                    "staging is ", dtype_name(staging.scalar_type()), " on ", staging.device(), ", kv_table is ",
                    dtype_name(kv_table.scalar_type()), " on ", kv_table.device());
  if (pages.device().is_cpu()) {  // NOTE: two blocks for one page: which lands would depend on timing
    const Tensor dense = pages.contiguous();  // NOTE: a strided or expanded `pages` reads right too
    const int64_t* p = dense.const_data_ptr<int64_t>();
    std::vector<int64_t> sorted(p, p + dense.numel());
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK_VALUE(dup == sorted.end(), "pages has page ", dup == sorted.end() ? 0 : *dup, " more than once");
  }
  kv_table.index_copy_(1, pages, staging);
}

}  // namespace

// NOTE: a FRAGMENT, not TORCH_LIBRARY: other C++ sources (the cache core) may add ops to gr_kv, and two
// TORCH_LIBRARY blocks for one namespace abort the process when both libraries load.
TORCH_LIBRARY_FRAGMENT(gr_kv, m) {
  // The fake kernels and the CUDA kernels are registered from this Python module (imported on demand).
  m.set_python_module("gr_plugin.ops.library");
  m.def("append_kv(Tensor(a!) kv_layer, Tensor k, Tensor v, Tensor slots, Tensor rows) -> ()");
  m.def(
      "paged_hstu_attention(Tensor q, Tensor k, Tensor v, Tensor kv_layer, Tensor kv_indices, Tensor kv_indptr, "
      "Tensor history_lengths, Tensor q_offsets, Tensor new_lengths, float alpha, float n_norm) -> Tensor");
  m.def(
      "hstu_attention_jagged(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor num_candidates, "
      "float alpha, float n_norm) -> Tensor");
  m.def(
      "hstu_attention_jagged_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, "
      "Tensor num_candidates, float alpha, float n_norm) -> (Tensor, Tensor, Tensor)");
  m.def("append_kv_layer(Tensor(a!) kv_table, int layer, Tensor k, Tensor v, Tensor slots, Tensor rows) -> ()");
  m.def(
      "paged_hstu_attention_layer(Tensor q, Tensor k, Tensor v, Tensor kv_table, int layer, Tensor kv_indices, "
      "Tensor kv_indptr, Tensor history_lengths, Tensor q_offsets, Tensor new_lengths, float alpha, float n_norm) "
      "-> Tensor");
  m.def("gather_pages(Tensor kv_table, Tensor pages) -> Tensor");
  m.def("scatter_pages(Tensor(a!) kv_table, Tensor staging, Tensor pages) -> ()");
}

TORCH_LIBRARY_IMPL(gr_kv, CPU, m) {
  m.impl("append_kv", &append_kv_cpu);
  m.impl("paged_hstu_attention", &paged_hstu_attention_cpu);
  m.impl("hstu_attention_jagged", &hstu_attention_jagged_cpu);
  m.impl("hstu_attention_jagged_backward", &hstu_attention_jagged_backward_cpu);
  m.impl("append_kv_layer", &append_kv_layer_cpu);
  m.impl("paged_hstu_attention_layer", &paged_hstu_attention_layer_cpu);
}

// Page gather/scatter are ATen index ops on any device: one C++ kernel (a compiled package on a GPU
// runs it without Python too).
TORCH_LIBRARY_IMPL(gr_kv, CompositeExplicitAutograd, m) {
  m.impl("gather_pages", &gather_pages);
  m.impl("scatter_pages", &scatter_pages);
}

}  // namespace gr_kv
