// Tensor-only request-level cache ops in the gr_kv namespace: torch.ops.gr_kv.cache_{create, lookup,
// allocate, commit, abort, destroy} over a process-wide registry of CacheCore instances, and the
// pinned host tier's ops cache_{attach_host, allocate_tiered, offload_launch, offload_reap} (a
// HostCore next to the cache's CacheCore; the caller moves the bytes, e.g. with gr_kv::gather_pages /
// scatter_pages).
//
// Owns the registry (handle -> cores, one lock per cache) and the tensor boundary: dtype, device, shape
// and value checks, all before the cores are touched, raising ValueError naming the value. The policy
// is kv_core.h's; no caller digests (the core must hash with libxxhash). Schemas are frozen once
// released: docs/EXPORT.md.
//
// A cache is addressed by a `state` tensor, int64 CPU [2] = (handle, epoch): ops that change the
// cache take it as `Tensor(a!)` and write the cache's new epoch into it, so traced graphs keep them
// (a mutated input is never dead code) and order them after the ops that read the state before.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kv_core.h"
#include "torch_glue.h"

namespace gr_kv_core {
namespace {

constexpr int64_t kPlanFields = 6;  // status, plan id, batch index, demand, evicted users, evicted pages

constexpr int32_t kHostNamespace = 0;  // a cache has one namespace; its host tier keys users by it

struct Slot {
  std::mutex mu;
  CacheCore core;
  uint64_t seed = 0;  // the namespace's
  int64_t epoch = 0;
  std::unique_ptr<HostCore> host;                                  // cache_attach_host
  std::unordered_map<int64_t, std::vector<int64_t>> host_readers;  // plan id -> users whose host pages it pinned
  struct Offload {
    int64_t ticket;
    std::vector<HostCore::WriteThrough> items;
    std::vector<int64_t> src;  // device pages read (pool readers until the reap)
  };
  std::deque<Offload> offloads;  // in launch order: reaped in that order (host publishes are ordered)
  int64_t next_ticket = 1;
  Slot(int64_t num_pages, int64_t page_size) : core(num_pages, page_size) {}
};

struct Registry {
  std::mutex mu;
  std::unordered_map<int64_t, std::shared_ptr<Slot>> slots;
  int64_t next = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // NOTE: never destroyed: ops may run during static teardown
  return *r;
}

void check_int64_cpu(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
}

std::shared_ptr<Slot> slot_of(const at::Tensor& state) {
  check_int64_cpu(state, "state", 1);
  TORCH_CHECK_VALUE(state.size(0) == 2, "state must have shape [2] (handle, epoch), got ", state.sizes());
  const int64_t handle = state[0].item<int64_t>();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.slots.find(handle);
  TORCH_CHECK_VALUE(it != r.slots.end(), "state names no live cache (handle ", handle, ")");
  return it->second;
}

std::vector<int64_t> as_vector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// A request's histories: user_ids [B], history_lengths [B] (>= 0), tokens int64 CPU [sum(L)] or
// [sum(L), F], contiguous. Returns the lengths; `refs` point into tokens.
std::vector<int64_t> request_histories(const at::Tensor& history_lengths, const at::Tensor& tokens, int64_t batch,
                                       std::vector<HistoryRef>* refs) {
  check_int64_cpu(history_lengths, "history_lengths", 1);
  TORCH_CHECK_VALUE(history_lengths.size(0) == batch, "history_lengths has ", history_lengths.size(0),
                    " entries for ", batch, " users");
  std::vector<int64_t> lengths = as_vector(history_lengths);
  int64_t rows = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    TORCH_CHECK_VALUE(lengths[b] >= 0, "negative history length ", lengths[b], " at index ", b);
    TORCH_CHECK_VALUE(lengths[b] <= INT64_MAX - rows, "history lengths overflow int64");
    rows += lengths[b];
  }
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kLong, "tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.device().is_cpu(), "tokens must be on the CPU, got ", tokens.device());
  TORCH_CHECK_VALUE(tokens.dim() == 1 || tokens.dim() == 2, "tokens must be [sum(L)] or [sum(L), F], got shape ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(tokens.is_contiguous(), "tokens must be contiguous");
  TORCH_CHECK_VALUE(tokens.size(0) == rows, "tokens has ", tokens.size(0), " rows but history_lengths sum to ",
                    rows);
  const int64_t row_bytes = tokens.element_size() * (tokens.dim() == 2 ? tokens.size(1) : 1);
  TORCH_CHECK_VALUE(row_bytes > 0, "tokens rows are empty (shape ", tokens.sizes(), ")");
  const auto* base = static_cast<const uint8_t*>(tokens.data_ptr());
  refs->assign(lengths.size(), HistoryRef{});
  int64_t at = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    HistoryRef& h = (*refs)[b];
    h.rows = base + at * row_bytes;
    h.row_bytes = row_bytes;
    h.length = lengths[b];
    at += lengths[b];
  }
  return lengths;
}

std::vector<int64_t> request_users(const at::Tensor& user_ids) {
  check_int64_cpu(user_ids, "user_ids", 1);
  TORCH_CHECK_VALUE(user_ids.size(0) > 0, "empty batch: user_ids has no entries");
  std::vector<int64_t> users = as_vector(user_ids);
  std::unordered_set<int64_t> seen;
  for (int64_t u : users) TORCH_CHECK_VALUE(seen.insert(u).second, "user ", u, " appears more than once in one batch");
  return users;
}

void publish_epoch(Slot& s, at::Tensor& state) { state[1].fill_(++s.epoch); }

// ----------------------------------------------------------------------------------------- ops
at::Tensor cache_create(int64_t num_pages, int64_t page_size, std::string name) {
  TORCH_CHECK_VALUE(hashing_available(),
                    "gr_kv::cache_create: the core was built without libxxhash; these ops hash token rows in C++");
  TORCH_CHECK_VALUE(num_pages > 0, "num_pages must be > 0, got ", num_pages);
  TORCH_CHECK_VALUE(page_size > 0, "page_size must be > 0, got ", page_size);
  TORCH_CHECK_VALUE(!name.empty(), "namespace must be a non-empty string");
  auto slot = guarded([&] { return std::make_shared<Slot>(num_pages, page_size); });
  slot->seed = namespace_seed(name);
  guarded([&] { return slot->core.set_namespace(name, slot->seed); });
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const int64_t handle = r.next++;
  r.slots.emplace(handle, std::move(slot));
  return to_tensor({handle, 0});
}

at::Tensor cache_lookup(const at::Tensor& state, const at::Tensor& user_ids, const at::Tensor& history_lengths,
                        const at::Tensor& tokens) {
  auto slot = slot_of(state);
  const std::vector<int64_t> users = request_users(user_ids);
  std::vector<HistoryRef> refs;
  request_histories(history_lengths, tokens, static_cast<int64_t>(users.size()), &refs);
  std::lock_guard<std::mutex> lock(slot->mu);
  return guarded([&] {
    std::vector<int64_t> dev(users.size());
    int64_t version = 0;
    for (size_t b = 0; b < users.size(); ++b) dev[b] = slot->core.match(users[b], refs[b], &version);
    return to_tensor(dev);
  });
}

// An allocate's kv_indptr [B+1] and kv_indices [M] in its packed metadata buffer (kMetadataFields
// order: kv_indptr [B+1], kv_last_page_len [B], cached_lengths [B], new_lengths [B], total_lengths
// [B], new_offsets [B+1], total_offsets [B+1], kv_indices [M], ...).
const int64_t* kv_indptr_of(const AllocResult& r) { return r.metadata.buffer.data(); }
const int64_t* kv_indices_of(const AllocResult& r) {
  const int64_t B = r.metadata.batch_size;
  return r.metadata.buffer.data() + 3 * (B + 1) + 4 * B;
}

using PlanTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (plan [6], kv_indices [M], kv_indptr [B+1], cached_lengths [B], new_token_slots [N]) of an allocate.
PlanTensors plan_tensors(const AllocResult& r, const std::vector<int64_t>& lengths, int64_t page_size) {
  const int64_t B = static_cast<int64_t>(lengths.size());
  const bool ok = r.status == AllocStatus::kOk;
  at::Tensor plan = to_tensor({static_cast<int64_t>(r.status), ok ? r.plan_id : -1,
                               r.status == AllocStatus::kInFlight ? r.index : -1, r.demand, r.evicted.users,
                               r.evicted.pages});
  if (!ok) {
    at::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    at::Tensor zeros_b1 = at::zeros({B + 1}, at::TensorOptions().dtype(at::kLong));
    at::Tensor zeros_b = at::zeros({B}, at::TensorOptions().dtype(at::kLong));
    return std::make_tuple(plan, none, zeros_b1, zeros_b, none.clone());
  }
  const int64_t M = r.metadata.num_batch_pages, N = r.metadata.num_new_tokens, P = page_size;
  const int64_t* indptr = kv_indptr_of(r);
  const int64_t* indices = kv_indices_of(r);
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t pos = r.cached_lengths[b]; pos < lengths[b]; ++pos) {
      slots.push_back(indices[indptr[b] + pos / P] * P + pos % P);
    }
  }
  return std::make_tuple(plan, to_tensor(std::vector<int64_t>(indices, indices + M)),
                         to_tensor(std::vector<int64_t>(indptr, indptr + B + 1)), to_tensor(r.cached_lengths),
                         to_tensor(slots));
}

// A request's users, lengths and history views, checked (ValueError) before any cache is touched.
struct Request {
  std::vector<int64_t> users, lengths;
  std::vector<HistoryRef> refs;
  int64_t size() const { return static_cast<int64_t>(users.size()); }
};

Request request_of(const at::Tensor& user_ids, const at::Tensor& history_lengths, const at::Tensor& tokens) {
  Request q;
  q.users = request_users(user_ids);
  q.lengths = request_histories(history_lengths, tokens, q.size(), &q.refs);
  return q;
}

// Match (device, and the host tier when there is one) and allocate; the caller holds the lock. NOTE: under
// one lock, so the versions cannot change in between (no kChanged).
AllocResult match_and_allocate(Slot& slot, const Request& q, const HostCore* host) {
  CacheCore& core = slot.core;
  const int64_t B = q.size();
  return guarded([&] {
    std::vector<int64_t> dev(B), versions(B), host_pages(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      dev[b] = core.match(q.users[b], q.refs[b], &versions[b]);
      if (host != nullptr) {
        host_pages[b] = host->match_beyond(kHostNamespace, q.users[b], q.refs[b], slot.seed, dev[b], nullptr);
      }
    }
    return core.allocate(q.users, q.lengths, dev, versions, host_pages);
  });
}

PlanTensors cache_allocate(at::Tensor& state, const at::Tensor& user_ids, const at::Tensor& history_lengths,
                           const at::Tensor& tokens) {
  auto slot = slot_of(state);
  const Request q = request_of(user_ids, history_lengths, tokens);
  std::lock_guard<std::mutex> lock(slot->mu);
  const AllocResult r = match_and_allocate(*slot, q, nullptr);
  if (r.status == AllocStatus::kOk) publish_epoch(*slot, state);
  return plan_tensors(r, q.lengths, slot->core.page_size());
}

// ------------------------------------------------------------------------------ the host tier
void cache_attach_host(at::Tensor& state, int64_t num_slots) {
  auto slot = slot_of(state);
  TORCH_CHECK_VALUE(num_slots > 0, "num_slots must be > 0, got ", num_slots);
  std::lock_guard<std::mutex> lock(slot->mu);
  TORCH_CHECK_VALUE(slot->host == nullptr, "the cache already has a host tier");
  TORCH_CHECK_VALUE(slot->core.num_plans() == 0, slot->core.num_plans(),
                    " steps are in flight; commit or abort them before attaching a host tier");
  slot->host = guarded([&] { return std::make_unique<HostCore>(num_slots, slot->core.page_size()); });
  publish_epoch(*slot, state);
}

HostCore& host_of(Slot& slot, const char* op) {
  TORCH_CHECK_VALUE(slot.host != nullptr, "gr_kv::", op, ": the cache has no host tier (cache_attach_host first)");
  return *slot.host;
}

// allocate with the host tier: a user's host pages beyond its device pages are onboarded into the
// plan's pages (pinned until the plan is committed or aborted). Adds onboard_slots [K] (host slots)
// and onboard_pages [K] (their device pages): the caller copies host_table[:, slots] ->
// kv_table[:, pages] before the step reads them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cache_allocate_tiered(
    at::Tensor& state, const at::Tensor& user_ids, const at::Tensor& history_lengths, const at::Tensor& tokens) {
  auto slot = slot_of(state);
  const Request q = request_of(user_ids, history_lengths, tokens);
  const std::vector<int64_t>& users = q.users;
  const int64_t B = q.size();
  std::lock_guard<std::mutex> lock(slot->mu);
  CacheCore& core = slot->core;
  HostCore& host = host_of(*slot, "cache_allocate_tiered");
  const AllocResult r = match_and_allocate(*slot, q, &host);
  std::vector<int64_t> onboard_slots, onboard_pages;
  if (r.status == AllocStatus::kOk) {
    const int64_t* indptr = kv_indptr_of(r);
    const int64_t* indices = kv_indices_of(r);
    std::vector<int64_t>& readers = slot->host_readers[r.plan_id];
    for (int64_t b = 0; b < B; ++b) {
      const int64_t keep = r.keep_pages[b], n = r.onboard_pages[b];
      if (n == 0) continue;
      std::vector<int64_t> got;
      if (!host.acquire(kHostNamespace, users[b], keep, n, &got)) {  // (an invariant broken: roll back)
        for (int64_t u : readers) host.release(kHostNamespace, u);
        slot->host_readers.erase(r.plan_id);
        core.abort(r.plan_id);
        throw std::logic_error("host pages of user " + std::to_string(users[b]) + " vanished under the lock");
      }
      readers.push_back(users[b]);
      onboard_slots.insert(onboard_slots.end(), got.begin(), got.end());
      onboard_pages.insert(onboard_pages.end(), indices + indptr[b] + keep, indices + indptr[b] + keep + n);
    }
    publish_epoch(*slot, state);
  }
  auto [plan, kv_indices, kv_indptr, cached, new_slots] = plan_tensors(r, q.lengths, core.page_size());
  return std::make_tuple(plan, kv_indices, kv_indptr, cached, new_slots, to_tensor(onboard_slots),
                         to_tensor(onboard_pages));
}

void release_host_readers(Slot& slot, int64_t plan_id) {
  auto it = slot.host_readers.find(plan_id);
  if (it == slot.host_readers.end()) return;
  for (int64_t user : it->second) slot.host->release(kHostNamespace, user);
  slot.host_readers.erase(it);
}

// The write-through of committed users: reservations (HostCore::reserve_write_through) returned as
// a ticket [2] = (id, users whose reservation could not be had; id 0: nothing to copy) and the copy
// to make, src_pages [K] (device pages) -> dst_slots [K] (host slots). Until cache_offload_reap the
// device pages are pinned: their users are not evicted and a freed page is not handed out again.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cache_offload_launch(at::Tensor& state, const at::Tensor& user_ids) {
  auto slot = slot_of(state);
  const std::vector<int64_t> users = request_users(user_ids);
  std::lock_guard<std::mutex> lock(slot->mu);
  HostCore& host = host_of(*slot, "cache_offload_launch");
  CacheCore& core = slot->core;
  std::vector<HostCore::Dropped> dropped;
  int64_t refused = 0;
  std::vector<HostCore::WriteThrough> items = guarded([&] {
    return host.reserve_write_through(kHostNamespace, core, core.current_namespace(), users, &dropped, &refused);
  });
  std::vector<int64_t> src, dst;
  for (const auto& w : items) {
    src.insert(src.end(), w.pages.begin(), w.pages.end());
    dst.insert(dst.end(), w.slots.begin(), w.slots.end());
    core.add_offload(core.current_namespace(), w.user);
  }
  int64_t ticket = 0;
  if (!items.empty()) {
    core.pool().add_readers(src.data(), src.size());
    ticket = slot->next_ticket++;
    slot->offloads.push_back(Slot::Offload{ticket, std::move(items), src});
  }
  publish_epoch(*slot, state);
  return std::make_tuple(to_tensor({ticket, refused}), to_tensor(src), to_tensor(dst));
}

// Publish (ok) or give back (not ok) the oldest offload's reservations, in order; unpin its pages.
void cache_offload_reap(at::Tensor& state, const at::Tensor& ticket, bool ok) {
  auto slot = slot_of(state);
  check_int64_cpu(ticket, "ticket", 1);
  TORCH_CHECK_VALUE(ticket.size(0) == 2, "ticket must have shape [2] (id, refused), got ", ticket.sizes());
  const int64_t id = ticket[0].item<int64_t>();
  std::lock_guard<std::mutex> lock(slot->mu);
  HostCore& host = host_of(*slot, "cache_offload_reap");
  if (id == 0) return;  // an offload with nothing to copy
  auto it = std::find_if(slot->offloads.begin(), slot->offloads.end(),
                         [&](const Slot::Offload& o) { return o.ticket == id; });
  TORCH_CHECK_VALUE(it != slot->offloads.end(), "ticket ", id, " names no offload in flight");
  TORCH_CHECK_VALUE(it == slot->offloads.begin(), "offloads are reaped in launch order: reap ticket ",
                    slot->offloads.front().ticket, " before ticket ", id);
  CacheCore& core = slot->core;
  for (const auto& w : it->items) {
    std::vector<Digest> published;
    host.publish(kHostNamespace, w.user, w.slots, ok ? static_cast<int64_t>(w.slots.size()) : 0, &published);
    core.offload_done(core.current_namespace(), w.user);
  }
  core.pool().remove_readers(it->src.data(), it->src.size());
  slot->offloads.pop_front();
  publish_epoch(*slot, state);
}

int64_t plan_id_of(const at::Tensor& plan) {
  check_int64_cpu(plan, "plan", 1);
  TORCH_CHECK_VALUE(plan.size(0) == kPlanFields, "plan must have shape [", kPlanFields, "], got ", plan.sizes());
  const int64_t status = plan[0].item<int64_t>();
  TORCH_CHECK_VALUE(status == static_cast<int64_t>(AllocStatus::kOk), "plan has status ", status,
                    " (allocate refused it): there is nothing to commit or abort");
  return plan[1].item<int64_t>();
}

void cache_commit(at::Tensor& state, const at::Tensor& plan, const at::Tensor& history_lengths,
                  const at::Tensor& tokens) {
  auto slot = slot_of(state);
  const int64_t plan_id = plan_id_of(plan);
  std::lock_guard<std::mutex> lock(slot->mu);
  const int64_t B = guarded([&] { return static_cast<int64_t>(slot->core.plan_users(plan_id).size()); });
  std::vector<HistoryRef> refs;
  request_histories(history_lengths, tokens, B, &refs);
  guarded([&] { return slot->core.commit(plan_id, refs), 0; });
  release_host_readers(*slot, plan_id);
  publish_epoch(*slot, state);
}

void cache_abort(at::Tensor& state, const at::Tensor& plan) {
  auto slot = slot_of(state);
  const int64_t plan_id = plan_id_of(plan);
  std::lock_guard<std::mutex> lock(slot->mu);
  guarded([&] { return slot->core.abort(plan_id), 0; });
  release_host_readers(*slot, plan_id);
  publish_epoch(*slot, state);
}

void cache_destroy(at::Tensor& state) {
  auto slot = slot_of(state);
  std::lock_guard<std::mutex> lock(slot->mu);
  TORCH_CHECK_VALUE(slot->core.num_plans() == 0, slot->core.num_plans(),
                    " steps are in flight; commit or abort them before destroying the cache");
  TORCH_CHECK_VALUE(slot->offloads.empty(), slot->offloads.size(),
                    " offloads are in flight; reap them before destroying the cache");
  const int64_t handle = state[0].item<int64_t>();
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> rlock(r.mu);
    r.slots.erase(handle);
  }
  state[0].fill_(-1);
  publish_epoch(*slot, state);
}

}  // namespace
}  // namespace gr_kv_core

// NOTE: a FRAGMENT: gr_plugin/csrc/gr_kv_ops.cpp defines the kernels of the same namespace.
TORCH_LIBRARY_FRAGMENT(gr_kv, m) {
  m.def("cache_create(int num_pages, int page_size, str namespace) -> Tensor");
  m.def("cache_lookup(Tensor state, Tensor user_ids, Tensor history_lengths, Tensor tokens) -> Tensor");
  m.def("cache_allocate(Tensor(a!) state, Tensor user_ids, Tensor history_lengths, Tensor tokens) -> "
        "(Tensor plan, Tensor kv_indices, Tensor kv_indptr, Tensor cached_lengths, Tensor new_token_slots)");
  m.def("cache_commit(Tensor(a!) state, Tensor plan, Tensor history_lengths, Tensor tokens) -> ()");
  m.def("cache_abort(Tensor(a!) state, Tensor plan) -> ()");
  m.def("cache_destroy(Tensor(a!) state) -> ()");
  m.def("cache_attach_host(Tensor(a!) state, int num_slots) -> ()");
  m.def("cache_allocate_tiered(Tensor(a!) state, Tensor user_ids, Tensor history_lengths, Tensor tokens) -> "
        "(Tensor plan, Tensor kv_indices, Tensor kv_indptr, Tensor cached_lengths, Tensor new_token_slots, "
        "Tensor onboard_slots, Tensor onboard_pages)");
  m.def("cache_offload_launch(Tensor(a!) state, Tensor user_ids) -> (Tensor ticket, Tensor src_pages, "
        "Tensor dst_slots)");
  m.def("cache_offload_reap(Tensor(a!) state, Tensor ticket, bool ok) -> ()");
}

// NOTE: CompositeExplicitAutograd, not CPU: cache_create has no tensor argument, and the others check
// the device themselves (ValueError for a CUDA tensor, not a missing-kernel error).
TORCH_LIBRARY_IMPL(gr_kv, CompositeExplicitAutograd, m) {
  m.impl("cache_create", gr_kv_core::cache_create);
  m.impl("cache_lookup", gr_kv_core::cache_lookup);
  m.impl("cache_allocate", gr_kv_core::cache_allocate);
  m.impl("cache_commit", gr_kv_core::cache_commit);
  m.impl("cache_abort", gr_kv_core::cache_abort);
  m.impl("cache_destroy", gr_kv_core::cache_destroy);
  m.impl("cache_attach_host", gr_kv_core::cache_attach_host);
  m.impl("cache_allocate_tiered", gr_kv_core::cache_allocate_tiered);
  m.impl("cache_offload_launch", gr_kv_core::cache_offload_launch);
  m.impl("cache_offload_reap", gr_kv_core::cache_offload_reap);
}
