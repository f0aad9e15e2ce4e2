// HostTier of host_tier.h.
#include "host_tier.h"

#include <stdexcept>
#include <string>

#include "layout.h"

namespace gr_runner {
namespace {

constexpr int32_t kNamespace = 0;  // the runner serves one namespace

at::Tensor longs(const std::vector<int64_t>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

HostTier::HostTier(int64_t num_slots, const at::Tensor& kv_table, int64_t page_size, uint64_t seed)
    : host_(num_slots, page_size), page_size_(page_size), seed_(seed) {
  std::vector<int64_t> shape(kv_table.sizes().begin(), kv_table.sizes().end());
  shape[1] = num_slots;
  table_ = at::empty(shape, at::TensorOptions().dtype(kv_table.scalar_type()).pinned_memory(kv_table.is_cuda()));
}

int64_t HostTier::match(int64_t user, const gr_kv_core::HistoryRef& history, int64_t device_tokens) const {
  return host_.match_beyond(kNamespace, user, history, seed_, device_tokens, nullptr);
}

int64_t HostTier::onboard(const gr_kv_core::AllocResult& plan, const std::vector<int64_t>& users,
                          at::Tensor& kv_table) {
  const Field indptr = metadata_field(plan.metadata, "kv_indptr");
  const Field indices = metadata_field(plan.metadata, "kv_indices");
  std::vector<int64_t> src, dst;
  for (size_t b = 0; b < users.size(); ++b) {
    const int64_t keep = plan.keep_pages[b], n = plan.onboard_pages[b];
    if (n == 0) continue;
    std::vector<int64_t> slots;
    if (!host_.acquire(kNamespace, users[b], keep, n, &slots)) {
      throw std::logic_error("the host pages of user " + std::to_string(users[b]) + " vanished since the lookup");
    }
    src.insert(src.end(), slots.begin(), slots.end());
    const int64_t* pages = indices.data + indptr.data[b] + keep;
    dst.insert(dst.end(), pages, pages + n);
  }
  if (!src.empty()) {
    const at::Tensor staged = table_.index_select(1, longs(src)).to(kv_table.device());
    kv_table.index_copy_(1, longs(dst).to(kv_table.device()), staged);
    for (size_t b = 0; b < users.size(); ++b) {
      if (plan.onboard_pages[b] > 0) host_.release(kNamespace, users[b]);
    }
  }
  pages_onboarded_ += static_cast<int64_t>(src.size());
  return static_cast<int64_t>(src.size()) * page_size_;
}

void HostTier::write_through(const gr_kv_core::CacheCore& core, const std::vector<int64_t>& users,
                             const at::Tensor& kv_table) {
  // The reservations (HostCore::reserve_write_through, the policy the Python manager's offload runs
  // too), one copy, then the publishes in order.
  std::vector<gr_kv_core::HostCore::Dropped> dropped;
  const auto items = host_.reserve_write_through(kNamespace, core, core.current_namespace(), users, &dropped, nullptr);
  if (items.empty()) return;
  std::vector<int64_t> src, dst;
  for (const auto& w : items) {
    src.insert(src.end(), w.pages.begin(), w.pages.end());
    dst.insert(dst.end(), w.slots.begin(), w.slots.end());
  }
  table_.index_copy_(1, longs(dst), kv_table.index_select(1, longs(src).to(kv_table.device())).cpu());
  for (const auto& w : items) {
    std::vector<gr_kv_core::Digest> published;
    host_.publish(kNamespace, w.user, w.slots, static_cast<int64_t>(w.slots.size()), &published);
    pages_written_ += static_cast<int64_t>(w.slots.size());
  }
}

}  // namespace gr_runner
