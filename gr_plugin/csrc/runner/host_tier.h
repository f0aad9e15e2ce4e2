// The runner's pinned-host tier: the C++ host-tier policy (gr_kv_core::HostCore, the same code the
// Python host tier runs on) with its K/V table, and the steps the Python manager takes around it
// (gr_plugin/cache/manager.py): host matching for a lookup, onboarding a plan's host pages into its
// device pages, and the write-through of newly completed full pages after a commit. Copies are
// synchronous here (the Python manager's are asynchronous and published when done; a stream is
// recorded with every copy flushed, so both sides see the same host tier at each batch).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kv_core.h"

namespace gr_runner {

class HostTier {
 public:
  // `kv_table` is the device table [L, num_pages, 2, P, H, D]; the host table gets its page shape.
  HostTier(int64_t num_slots, const at::Tensor& kv_table, int64_t page_size, uint64_t seed);

  // Full pages of `history`'s prefix the host tier holds beyond the device's `device_tokens`
  // (0 when it cannot hold more), as the manager's lookup asks.
  int64_t match(int64_t user, const gr_kv_core::HistoryRef& history, int64_t device_tokens) const;
  // Copy each user's host pages of `plan` (its onboard_pages after keep_pages) into the plan's
  // device pages of `kv_table`; returns the tokens onboarded.
  int64_t onboard(const gr_kv_core::AllocResult& plan, const std::vector<int64_t>& users, at::Tensor& kv_table);
  // After a commit: each user's full pages the host tier does not hold yet, copied and published.
  void write_through(const gr_kv_core::CacheCore& core, const std::vector<int64_t>& users,
                     const at::Tensor& kv_table);

  const gr_kv_core::HostCore& core() const { return host_; }
  int64_t pages_onboarded() const { return pages_onboarded_; }
  int64_t pages_written() const { return pages_written_; }

 private:
  gr_kv_core::HostCore host_;
  at::Tensor table_;  // [L, num_slots, 2, P, H, D] on the CPU (pinned when kv_table is on a GPU)
  int64_t page_size_;
  uint64_t seed_;
  int64_t pages_onboarded_ = 0, pages_written_ = 0;
};

}  // namespace gr_runner
