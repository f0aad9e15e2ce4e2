// Torch binding of the cache policy core: torch.classes.gr_kv_core.{PagePool, CacheCore} and the
// request-level ops torch.ops.gr_kv_core.{lookup, allocate, commit, abort, build_metadata, ...}.
//
// Owns only type conversion and input checks of tensors (dtype, device, shape); the policy lives
// in kv_core.h. std::invalid_argument from the core becomes Python's ValueError (TORCH_CHECK_VALUE),
// anything else a RuntimeError. Digests cross the boundary as int64 [n, 2] tensors (low, high).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kv_core.h"
#include "torch_glue.h"

namespace gr_kv_core {
namespace {

at::Tensor digests_to_tensor(const std::vector<Digest>& d) {
  at::Tensor t = at::empty({static_cast<int64_t>(d.size()), 2}, at::TensorOptions().dtype(at::kLong));
  static_assert(sizeof(Digest) == 2 * sizeof(int64_t), "Digest is two uint64");
  if (!d.empty()) std::memcpy(t.data_ptr<int64_t>(), d.data(), d.size() * sizeof(Digest));
  return t;
}

const Digest* digest_ptr(const at::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), name,
                    " must be a contiguous int64 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == 2 && t.size(0) == rows, name, " must have shape [", rows,
                    ", 2], got ", t.sizes());
  return reinterpret_cast<const Digest*>(t.data_ptr<int64_t>());
}

// Token rows of a request: int64 CPU [sum(L)] or [sum(L), F], contiguous; offsets [B+1].
int64_t check_tokens(const at::Tensor& tokens, const std::vector<int64_t>& offsets, size_t batch) {
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kLong, "tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.device().is_cpu(), "tokens must be on the CPU, got ", tokens.device());
  TORCH_CHECK_VALUE(tokens.dim() == 1 || tokens.dim() == 2, "tokens must be [sum(L)] or [sum(L), F], got shape ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(tokens.is_contiguous(), "tokens must be contiguous");
  TORCH_CHECK_VALUE(offsets.size() == batch + 1, "history_offsets has ", offsets.size(), " entries for ", batch,
                    " users (want B+1)");
  TORCH_CHECK_VALUE(offsets[0] == 0, "history_offsets must start at 0, got ", offsets[0]);
  for (size_t b = 1; b < offsets.size(); ++b) {
    TORCH_CHECK_VALUE(offsets[b] >= offsets[b - 1], "history_offsets decrease at index ", b, ": ", offsets[b - 1],
                      " -> ", offsets[b]);
  }
  TORCH_CHECK_VALUE(offsets.back() == tokens.size(0), "tokens has ", tokens.size(0), " rows but history_offsets end at ",
                    offsets.back());
  return tokens.element_size() * (tokens.dim() == 2 ? tokens.size(1) : 1);
}

// HistoryRefs of a request, with optional caller digests: page_digests [sum(L_b // P), 2] in
// batch order; tail_digests [B, 2] covering tail_tokens[b] rows each.
std::vector<HistoryRef> histories(const at::Tensor& tokens, const std::vector<int64_t>& offsets, size_t batch,
                                  int64_t page_size, const std::optional<at::Tensor>& page_digests,
                                  const std::optional<at::Tensor>& tail_digests,
                                  const std::optional<std::vector<int64_t>>& tail_tokens) {
  const int64_t row_bytes = check_tokens(tokens, offsets, batch);
  const auto* base = static_cast<const uint8_t*>(tokens.data_ptr());
  std::vector<HistoryRef> out(batch);
  TORCH_CHECK_VALUE(tail_digests.has_value() == tail_tokens.has_value(),
                    "tail_digests and tail_tokens go together");
  TORCH_CHECK_VALUE(!page_digests.has_value() || tail_digests.has_value(),
                    "caller digests need tail_digests too (the hash of each user's first tail_tokens rows)");
  const Digest* pages = nullptr;
  const Digest* tails = nullptr;
  if (tail_digests.has_value()) {
    int64_t num_full = 0;
    for (size_t b = 0; b < batch; ++b) num_full += (offsets[b + 1] - offsets[b]) / page_size;
    pages = page_digests.has_value() ? digest_ptr(*page_digests, num_full, "page_digests") : nullptr;
    tails = digest_ptr(*tail_digests, static_cast<int64_t>(batch), "tail_digests");
    TORCH_CHECK_VALUE(tail_tokens->size() == batch, "tail_tokens has ", tail_tokens->size(), " entries for ", batch,
                      " users");
  }
  int64_t page_at = 0;
  for (size_t b = 0; b < batch; ++b) {
    HistoryRef& h = out[b];
    h.rows = base + offsets[b] * row_bytes;
    h.row_bytes = row_bytes;
    h.length = offsets[b + 1] - offsets[b];
    if (tails != nullptr) {
      h.page_digests = pages == nullptr ? nullptr : pages + page_at;
      h.tail_digest = tails + b;
      h.tail_tokens = (*tail_tokens)[b];
      page_at += h.length / page_size;
    }
  }
  return out;
}

struct PoolHolder : torch::CustomClassHolder {
  std::shared_ptr<PagePool> pool;
  // NOTE: a core's pool is shared with its directory: through this handle only readers may be added
  // and removed (copies in flight); allocating or freeing would hand out pages users still own.
  bool core_owned = false;
  explicit PoolHolder(std::shared_ptr<PagePool> p, bool owned = false) : pool(std::move(p)), core_owned(owned) {}
  void check_free_hand(const char* verb) const {
    TORCH_CHECK_VALUE(!core_owned, "PagePool.", verb, ": this pool belongs to a CacheCore, which alone allocates "
                      "and frees its pages");
  }
};

struct CoreHolder : torch::CustomClassHolder {
  CacheCore core;
  CoreHolder(int64_t num_pages, int64_t page_size) : core(num_pages, page_size) {}
};

struct HostHolder : torch::CustomClassHolder {
  HostCore core;
  HostHolder(int64_t num_slots, int64_t page_size) : core(num_slots, page_size) {}
};

struct ExtentsHolder : torch::CustomClassHolder {
  ExtentAllocator extents;
  explicit ExtentsHolder(int64_t num_slots) : extents(num_slots) {}
};

using Core = c10::intrusive_ptr<CoreHolder>;
using Host = c10::intrusive_ptr<HostHolder>;
using Pool = c10::intrusive_ptr<PoolHolder>;

// A namespace id from Python, range-checked (the core keys namespaces by int32: 2**32 must not alias 0).
int32_t ns_id(int64_t ns) {
  TORCH_CHECK_VALUE(ns >= 0 && ns <= std::numeric_limits<int32_t>::max(), "namespace id ", ns, " is out of range");
  return static_cast<int32_t>(ns);
}

uint64_t as_seed(int64_t s) { return static_cast<uint64_t>(s); }

// -------------------------------------------------------------------------- request-level ops
// lookup -> (device_tokens [B], entry versions [B]); changes nothing.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> op_lookup(
    const Core& self, std::vector<int64_t> users, std::vector<int64_t> offsets, const at::Tensor& tokens,
    const std::optional<at::Tensor>& page_digests, const std::optional<at::Tensor>& tail_digests,
    const std::optional<std::vector<int64_t>>& tail_tokens) {
  return guarded([&] {
    auto hs = histories(tokens, offsets, users.size(), self->core.page_size(), page_digests, tail_digests, tail_tokens);
    std::vector<int64_t> dev(users.size()), ver(users.size());
    for (size_t b = 0; b < users.size(); ++b) dev[b] = self->core.match(users[b], hs[b], &ver[b]);
    return std::make_tuple(std::move(dev), std::move(ver));
  });
}

// allocate -> (status, index or plan id, metadata buffer, info) where info is
// [demand, evicted users, evicted pages, num_new_tokens, num_total_tokens, num_batch_pages,
//  max_new_len, max_total_len] + keep_pages[B] + onboard_pages[B] + cached_lengths[B] + device_tokens[B].
std::tuple<int64_t, int64_t, at::Tensor, std::vector<int64_t>> op_allocate(
    const Core& self, std::vector<int64_t> users, std::vector<int64_t> lengths, std::vector<int64_t> device_tokens,
    std::vector<int64_t> versions, std::vector<int64_t> host_pages) {
  return guarded([&] {
    AllocResult r = self->core.allocate(users, lengths, device_tokens, versions, host_pages);
    const BatchMetadata& m = r.metadata;
    std::vector<int64_t> info{r.demand, r.evicted.users, r.evicted.pages, m.num_new_tokens, m.num_total_tokens,
                              m.num_batch_pages, m.max_new_len, m.max_total_len};
    for (const auto* v : {&r.keep_pages, &r.onboard_pages, &r.cached_lengths, &r.device_tokens}) {
      info.insert(info.end(), v->begin(), v->end());
    }
    const int64_t value = r.status == AllocStatus::kOk ? r.plan_id : r.index;
    return std::make_tuple(static_cast<int64_t>(r.status), value, to_tensor(m.buffer), std::move(info));
  });
}

void op_commit(const Core& self, int64_t plan_id, std::vector<int64_t> offsets, const at::Tensor& tokens,
               const std::optional<at::Tensor>& page_digests, const std::optional<at::Tensor>& tail_digests,
               const std::optional<std::vector<int64_t>>& tail_tokens) {
  guarded([&] {
    const size_t batch = self->core.plan_users(plan_id).size();
    self->core.commit(plan_id, histories(tokens, offsets, batch, self->core.page_size(), page_digests, tail_digests,
                                         tail_tokens));
    return 0;
  });
}

void op_abort(const Core& self, int64_t plan_id) {
  guarded([&] {
    self->core.abort(plan_id);
    return 0;
  });
}

at::Tensor op_build_metadata(const at::Tensor& kv_indices, std::vector<int64_t> num_pages,
                             std::vector<int64_t> cached_lengths, std::vector<int64_t> total_lengths,
                             int64_t page_size) {
  return guarded([&] {
    TORCH_CHECK_VALUE(kv_indices.device().is_cpu() && kv_indices.scalar_type() == at::kLong &&
                          kv_indices.dim() == 1 && kv_indices.is_contiguous(),
                      "kv_indices must be a contiguous 1-D int64 CPU tensor");
    int64_t total_pages = 0;
    for (int64_t n : num_pages) total_pages += n;
    TORCH_CHECK_VALUE(kv_indices.numel() == total_pages, "kv_indices has ", kv_indices.numel(),
                      " pages but the page counts sum to ", total_pages);
    return to_tensor(
        build_metadata(kv_indices.data_ptr<int64_t>(), num_pages, cached_lengths, total_lengths, page_size).buffer);
  });
}

// Hash of rows [start, start + num_rows) of tokens, as [2] (low, high).
at::Tensor op_hash_rows(const at::Tensor& tokens, int64_t start, int64_t num_rows, int64_t seed) {
  return guarded([&] {
    const int64_t rb = check_tokens(tokens, {0, tokens.dim() ? tokens.size(0) : 0}, 1);
    // NOTE: no start + num_rows: it can wrap past int64 and pass.
    TORCH_CHECK_VALUE(start >= 0 && num_rows >= 0 && start <= tokens.size(0) && num_rows <= tokens.size(0) - start,
                      "rows [", start, ", +", num_rows, ") out of range for ", tokens.size(0), " rows");
    const auto* base = static_cast<const uint8_t*>(tokens.data_ptr()) + start * rb;
    return digests_to_tensor({hash_bytes(base, static_cast<size_t>(num_rows * rb), as_seed(seed))});
  });
}

// ------------------------------------------------------------------------------ host tier
// match -> leading published pages of the history tokens[start : start + length] held for the user.
int64_t host_match(const Host& self, int64_t ns, int64_t user, const at::Tensor& tokens, int64_t start,
                   int64_t length, int64_t seed, int64_t min_pages, const std::optional<at::Tensor>& page_digests) {
  return guarded([&] {
    const int64_t rb = check_tokens(tokens, {0, tokens.dim() ? tokens.size(0) : 0}, 1);
    TORCH_CHECK_VALUE(start >= 0 && length >= 0 && start <= tokens.size(0) && length <= tokens.size(0) - start,
                      "history rows [", start, ", +", length, ") out of range for ", tokens.size(0), " rows");
    HistoryRef h;
    h.rows = static_cast<const uint8_t*>(tokens.data_ptr()) + start * rb;
    h.row_bytes = rb;
    h.length = length;
    if (page_digests.has_value()) {
      h.page_digests = digest_ptr(*page_digests, length / self->core.page_size(), "page_digests");
    }
    return self->core.match(ns_id(ns), user, h, as_seed(seed), min_pages);
  });
}

// match_many -> (pages, versions) per user: HostCore::match_beyond over a request's histories
// (tokens [sum(L)(, F)] split by offsets [B+1]); pages -1 where the tier was not asked;
// page_digests [sum(L_b // P), 2] when the core cannot hash.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> host_match_many(
    const Host& self, int64_t ns, std::vector<int64_t> users, std::vector<int64_t> offsets, const at::Tensor& tokens,
    int64_t seed, std::vector<int64_t> device_tokens, const std::optional<at::Tensor>& page_digests) {
  return guarded([&] {
    const int64_t rb = check_tokens(tokens, offsets, users.size());
    TORCH_CHECK_VALUE(device_tokens.size() == users.size(), "device_tokens has ", device_tokens.size(),
                      " entries for ", users.size(), " users");
    const int64_t P = self->core.page_size();
    const Digest* digests = nullptr;
    if (page_digests.has_value()) {
      int64_t num_full = 0;
      for (size_t b = 0; b < users.size(); ++b) num_full += (offsets[b + 1] - offsets[b]) / P;
      digests = digest_ptr(*page_digests, num_full, "page_digests");
    }
    const auto* base = static_cast<const uint8_t*>(tokens.data_ptr());
    std::vector<int64_t> pages(users.size()), versions(users.size());
    int64_t digest_at = 0;
    for (size_t b = 0; b < users.size(); ++b) {
      HistoryRef h;
      h.rows = base + offsets[b] * rb;
      h.row_bytes = rb;
      h.length = offsets[b + 1] - offsets[b];
      if (digests != nullptr) {
        h.page_digests = digests + digest_at;
        digest_at += h.length / P;
      }
      bool asked = false;
      pages[b] = self->core.match_beyond(ns_id(ns), users[b], h, as_seed(seed), device_tokens[b], &versions[b], &asked);
      if (!asked) pages[b] = -1;
    }
    return std::make_tuple(pages, versions);
  });
}

// Users a reservation dropped from the host tier, as (ns, user) pairs flattened, their slots, their hashes [n, 2].
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>> dropped_tensors(
    const std::vector<HostCore::Dropped>& dropped) {
  std::vector<int64_t> keys;
  std::vector<at::Tensor> slots, hashes;
  for (const auto& x : dropped) {
    keys.push_back(x.ns);
    keys.push_back(x.user);
    slots.push_back(to_tensor(x.slots));
    hashes.push_back(digests_to_tensor(x.hashes));
  }
  return std::make_tuple(std::move(keys), std::move(slots), std::move(hashes));
}

// reserve -> (ok, slots, dropped (ns, user) pairs flattened, dropped users' slots, their hashes [n, 2])
std::tuple<bool, at::Tensor, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>> host_reserve(
    const Host& self, int64_t ns, int64_t user, int64_t first, const at::Tensor& hashes) {
  return guarded([&] {
    TORCH_CHECK_VALUE(hashes.dim() == 2, "hashes must have shape [n, 2], got ", hashes.sizes());
    const Digest* d = digest_ptr(hashes, hashes.size(0), "hashes");
    std::vector<int64_t> slots;
    std::vector<HostCore::Dropped> dropped;
    const bool ok = self->core.reserve(ns_id(ns), user, first, d, hashes.size(0), &slots, &dropped);
    auto [keys, dslots, dhashes] = dropped_tensors(dropped);
    return std::make_tuple(ok, to_tensor(slots), std::move(keys), std::move(dslots), std::move(dhashes));
  });
}

std::vector<std::string> op_metadata_fields() {
  return std::vector<std::string>(kMetadataFields, kMetadataFields + kNumMetadataFields);
}

}  // namespace
}  // namespace gr_kv_core

TORCH_LIBRARY(gr_kv_core, m) {
  using namespace gr_kv_core;
  m.class_<PoolHolder>("PagePool")
      .def(torch::init([](int64_t num_pages) {
        return guarded([&] { return c10::make_intrusive<PoolHolder>(std::make_shared<PagePool>(num_pages)); });
      }))
      .def("num_pages", [](const Pool& s) { return s->pool->num_pages(); })
      .def("num_free", [](const Pool& s) { return s->pool->num_free(); })
      .def("num_zombies", [](const Pool& s) { return s->pool->num_zombies(); })
      .def("allocate",
           [](const Pool& s, int64_t n) -> std::optional<std::vector<int64_t>> {
             return guarded([&]() -> std::optional<std::vector<int64_t>> {
               s->check_free_hand("allocate");
               std::vector<int64_t> out;
               if (!s->pool->allocate(n, &out)) return std::nullopt;
               return out;
             });
           })
      .def("free",
           [](const Pool& s, std::vector<int64_t> pages) {
             guarded([&] { return s->check_free_hand("free"), s->pool->free(pages.data(), pages.size()), 0; });
           })
      .def("add_readers",
           [](const Pool& s, std::vector<int64_t> pages) {
             guarded([&] { return s->pool->add_readers(pages.data(), pages.size()), 0; });
           })
      .def("remove_readers",
           [](const Pool& s, std::vector<int64_t> pages) {
             guarded([&] { return s->pool->remove_readers(pages.data(), pages.size()), 0; });
           })
      .def("is_read", [](const Pool& s, int64_t page) { return guarded([&] { return s->pool->is_read(page); }); })
      .def("free_pages", [](const Pool& s) { return s->pool->free_pages(); })
      .def("check", [](const Pool& s, std::vector<int64_t> owned) { return s->pool->check(owned); });

  m.class_<CoreHolder>("CacheCore")
      .def(torch::init([](int64_t num_pages, int64_t page_size) {
        return guarded([&] { return c10::make_intrusive<CoreHolder>(num_pages, page_size); });
      }))
      .def("pool", [](const Core& s) { return c10::make_intrusive<PoolHolder>(s->core.shared_pool(), true); })
      .def("page_size", [](const Core& s) { return s->core.page_size(); })
      .def("num_free", [](const Core& s) { return s->core.pool().num_free(); })
      .def("set_namespace",
           [](const Core& s, std::string name, std::optional<int64_t> seed) {
             return guarded([&] {
               const uint64_t sd = seed.has_value() ? as_seed(*seed) : namespace_seed(name);
               return static_cast<int64_t>(s->core.set_namespace(name, sd));
             });
           })
      .def("fits", [](const Core& s, int64_t demand,
                      std::vector<int64_t> exclude) { return s->core.fits(demand, exclude); })
      .def("make_room",
           [](const Core& s, int64_t demand, std::vector<int64_t> exclude) {
             Evicted ev;
             const bool ok = s->core.make_room(demand, exclude, &ev);
             return std::vector<int64_t>{ok, ev.users, ev.pages};
           })
      .def("evict_blockers",
           [](const Core& s, int64_t ns, std::vector<int64_t> users) {
             return guarded([&] { return s->core.evict_blockers(ns_id(ns), users); });
           })
      .def("evict",
           [](const Core& s, int64_t ns, std::vector<int64_t> users) {
             return guarded([&] {
               Evicted ev = s->core.evict(ns_id(ns), users);
               return std::vector<int64_t>{ev.users, ev.pages};
             });
           })
      .def("evict_all",
           [](const Core& s) {
             return guarded([&] {
               Evicted ev = s->core.evict_all();
               return std::vector<int64_t>{ev.users, ev.pages};
             });
           })
      .def("reserve_scratch",
           [](const Core& s, int64_t n) { return guarded([&] { return s->core.reserve_scratch(n); }); })
      .def("add_offload",
           [](const Core& s, int64_t ns, int64_t user) {
             guarded([&] { return s->core.add_offload(ns_id(ns), user), 0; });
           })
      .def("offload_done",
           [](const Core& s, int64_t ns, int64_t user) {
             guarded([&] { return s->core.offload_done(ns_id(ns), user), 0; });
           })
      // entry -> ([num_tokens, in_plan, offloads, version], pages, page hashes [n, 2]); num_tokens -1: none
      .def("entry",
           [](const Core& s, int64_t ns, int64_t user) {
             auto v = s->core.entry(ns_id(ns), user);
             if (!v.exists) {
               return std::make_tuple(std::vector<int64_t>{-1, 0, 0, -1}, to_tensor({}), digests_to_tensor({}));
             }
             return std::make_tuple(std::vector<int64_t>{v.num_tokens, v.in_plan, v.offloads, v.version},
                                    to_tensor(*v.pages), digests_to_tensor(*v.page_hashes));
           })
      .def("cached_tokens",
           [](const Core& s, int64_t ns, std::vector<int64_t> users) {
             std::vector<int64_t> out;
             for (int64_t u : users) out.push_back(s->core.entry(ns_id(ns), u).num_tokens);
             return out;
           })
      .def("lru_order", [](const Core& s, int64_t ns) { return s->core.lru_order(ns_id(ns)); })
      .def("num_entries", [](const Core& s) { return s->core.num_entries(); })
      .def("plan_ids", [](const Core& s) { return s->core.plan_ids(); })
      .def("check", [](const Core& s) { return s->core.check(); })
      // NOTE: the request-level ops again as methods: from Python a method call costs about a third
      // of a dispatcher call (the manager's request path uses these); the *_rows variants skip the
      // caller-digest arguments, whose conversion is measurable at batch 1.
      .def("lookup", op_lookup)
      .def("lookup_rows",
           [](const Core& s, std::vector<int64_t> users, std::vector<int64_t> offsets, const at::Tensor& tokens) {
             return op_lookup(s, std::move(users), std::move(offsets), tokens, std::nullopt, std::nullopt,
                              std::nullopt);
           })
      .def("allocate", op_allocate)
      .def("commit", op_commit)
      .def("commit_rows",
           [](const Core& s, int64_t plan_id, std::vector<int64_t> offsets, const at::Tensor& tokens) {
             op_commit(s, plan_id, std::move(offsets), tokens, std::nullopt, std::nullopt, std::nullopt);
           })
      .def("abort", op_abort);

  // The host tier's free-slot runs on their own (tests; HostCore owns one).
  m.class_<ExtentsHolder>("ExtentAllocator")
      .def(torch::init([](int64_t num_slots) {
        return guarded([&] { return c10::make_intrusive<ExtentsHolder>(num_slots); });
      }))
      .def("num_free", [](const c10::intrusive_ptr<ExtentsHolder>& s) { return s->extents.num_free(); })
      .def("alloc",
           [](const c10::intrusive_ptr<ExtentsHolder>& s, int64_t n) -> std::optional<std::vector<int64_t>> {
             return guarded([&]() -> std::optional<std::vector<int64_t>> {
               std::vector<int64_t> out;
               if (!s->extents.alloc(n, &out)) return std::nullopt;
               return out;
             });
           })
      .def("free", [](const c10::intrusive_ptr<ExtentsHolder>& s,
                      std::vector<int64_t> slots) { s->extents.free(std::move(slots)); })
      .def("free_slots", [](const c10::intrusive_ptr<ExtentsHolder>& s) { return s->extents.free_slots(); });

  m.class_<HostHolder>("HostCore")
      .def(torch::init([](int64_t num_slots, int64_t page_size) {
        return guarded([&] { return c10::make_intrusive<HostHolder>(num_slots, page_size); });
      }))
      .def("num_slots", [](const Host& s) { return s->core.num_slots(); })
      .def("num_free", [](const Host& s) { return s->core.num_free(); })
      .def("num_users", [](const Host& s) { return s->core.num_users(); })
      .def("match", host_match)
      .def("version", [](const Host& s, int64_t ns, int64_t user) { return s->core.version(ns_id(ns), user); })
      .def("match_many", host_match_many)
      .def("versions",
           [](const Host& s, int64_t ns, std::vector<int64_t> users) {
             std::vector<int64_t> out;
             out.reserve(users.size());
             for (int64_t u : users) out.push_back(s->core.version(ns_id(ns), u));
             return out;
           })
      // acquire -> (ok, slots); pins the user until release
      .def("acquire",
           [](const Host& s, int64_t ns, int64_t user, int64_t first, int64_t n) {
             return guarded([&] {
               std::vector<int64_t> slots;
               const bool ok = s->core.acquire(ns_id(ns), user, first, n, &slots);
               return std::make_tuple(ok, to_tensor(slots));
             });
           })
      .def("release",
           [](const Host& s, int64_t ns, int64_t user) { guarded([&] { return s->core.release(ns_id(ns), user), 0; }); })
      .def("stored_pages",
           [](const Host& s, int64_t ns, int64_t user, const at::Tensor& hashes) {
             return guarded([&] {
               TORCH_CHECK_VALUE(hashes.dim() == 2, "hashes must have shape [n, 2], got ", hashes.sizes());
               return s->core.stored_pages(ns_id(ns), user, digest_ptr(hashes, hashes.size(0), "hashes"),
                                           hashes.size(0));
             });
           })
      .def("reserve", host_reserve)
      // reserve_write_through -> (users, first pages, device pages per user, slots per user,
      //                           dropped (ns, user) pairs flattened, their slots, their hashes [n, 2], failed)
      .def("reserve_write_through",
           [](const Host& s, int64_t ns, const Core& core, int64_t core_ns, std::vector<int64_t> users) {
             return guarded([&] {
               std::vector<HostCore::Dropped> dropped;
               int64_t failed = 0;
               auto items = s->core.reserve_write_through(ns_id(ns), core->core, ns_id(core_ns), users, &dropped,
                                                          &failed);
               std::vector<int64_t> who, first;
               std::vector<at::Tensor> pages, slots;
               for (const auto& w : items) {
                 who.push_back(w.user);
                 first.push_back(w.first);
                 pages.push_back(to_tensor(w.pages));
                 slots.push_back(to_tensor(w.slots));
               }
               auto [keys, dslots, dhashes] = dropped_tensors(dropped);
               return std::make_tuple(who, first, pages, slots, keys, dslots, dhashes, failed);
             });
           })
      // publish -> (first page published, published hashes [good, 2])
      .def("publish",
           [](const Host& s, int64_t ns, int64_t user, std::vector<int64_t> slots, int64_t num_ok) {
             return guarded([&] {
               std::vector<Digest> published;
               const int64_t first = s->core.publish(ns_id(ns), user, slots, num_ok, &published);
               return std::make_tuple(first, digests_to_tensor(published));
             });
           })
      // complete -> [(first page, slots, hashes [n, 2], tag)] per reservation applied now (any order in,
      // reservation order out: HostCore::complete)
      .def("complete",
           [](const Host& s, int64_t ns, int64_t user, std::vector<int64_t> slots, int64_t num_ok, int64_t tag) {
             return guarded([&] {
               std::vector<HostCore::Published> out;
               s->core.complete(ns_id(ns), user, slots, num_ok, tag, &out);
               std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, int64_t>> groups;
               for (const auto& p : out) {
                 groups.emplace_back(p.first, to_tensor(p.slots), digests_to_tensor(p.hashes), p.tag);
               }
               return groups;
             });
           })
      .def("evict",
           [](const Host& s, int64_t ns, int64_t user) { guarded([&] { return s->core.evict(ns_id(ns), user), 0; }); })
      .def("clear", [](const Host& s) { guarded([&] { return s->core.clear(), 0; }); })
      // lru_order -> (namespace ids, users), least recently used first
      .def("lru_order",
           [](const Host& s) {
             std::vector<int64_t> ns, users;
             for (const auto& [n, u] : s->core.lru_order()) {
               ns.push_back(n);
               users.push_back(u);
             }
             return std::make_tuple(ns, users);
           })
      .def("slots_of", [](const Host& s, int64_t ns, int64_t user) { return s->core.slots_of(ns_id(ns), user); })
      .def("hashes_of",
           [](const Host& s, int64_t ns, int64_t user) { return digests_to_tensor(s->core.hashes_of(ns_id(ns), user)); })
      .def("counters", [](const Host& s) { return s->core.counters(); })
      .def("check", [](const Host& s) { return s->core.check(); });

  m.def("lookup(__torch__.torch.classes.gr_kv_core.CacheCore core, int[] users, int[] offsets, Tensor tokens, "
        "Tensor? page_digests=None, Tensor? tail_digests=None, int[]? tail_tokens=None) -> (int[], int[])",
        op_lookup);
  m.def("allocate(__torch__.torch.classes.gr_kv_core.CacheCore core, int[] users, int[] lengths, "
        "int[] device_tokens, int[] versions, int[] host_pages) -> (int, int, Tensor, int[])",
        op_allocate);
  m.def("commit(__torch__.torch.classes.gr_kv_core.CacheCore core, int plan_id, int[] offsets, Tensor tokens, "
        "Tensor? page_digests=None, Tensor? tail_digests=None, int[]? tail_tokens=None) -> ()",
        op_commit);
  m.def("abort(__torch__.torch.classes.gr_kv_core.CacheCore core, int plan_id) -> ()", op_abort);
  m.def("build_metadata(Tensor kv_indices, int[] num_pages, int[] cached_lengths, int[] total_lengths, "
        "int page_size) -> Tensor",
        op_build_metadata);
  m.def("hash_rows(Tensor tokens, int start, int num_rows, int seed) -> Tensor", op_hash_rows);
  m.def("namespace_seed(str name) -> int", [](std::string name) {
    return gr_kv_core::guarded([&] { return static_cast<int64_t>(gr_kv_core::namespace_seed(name)); });
  });
  m.def("hashing_available() -> bool", [] { return gr_kv_core::hashing_available(); });
  m.def("metadata_fields() -> str[]", gr_kv_core::op_metadata_fields);
}
