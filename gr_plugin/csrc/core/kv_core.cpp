// CacheCore of kv_core.h (device user directory, LRU, plans) and the batch metadata builder.
#include "kv_core.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace gr_kv_core {

namespace {
// NOTE: not (a + b - 1) / b, which wraps for lengths near 2^63 (a >= 0, b > 0).
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

// ------------------------------------------------------------------------------------ metadata
const char* const kMetadataFields[kNumMetadataFields] = {
    "kv_indptr",   "kv_last_page_len", "cached_lengths", "new_lengths",     "total_lengths",
    "new_offsets", "total_offsets",    "kv_indices",     "new_token_batch", "new_token_positions"};

BatchMetadata build_metadata(const int64_t* kv_indices, const std::vector<int64_t>& num_pages,
                             const std::vector<int64_t>& cached_lengths,
                             const std::vector<int64_t>& total_lengths, int64_t page_size) {
  const size_t B = total_lengths.size();
  if (B == 0) throw std::invalid_argument("build_metadata: empty batch");
  if (page_size <= 0) throw std::invalid_argument("build_metadata: page_size must be > 0, got " + str(page_size));
  if (num_pages.size() != B || cached_lengths.size() != B) {
    throw std::invalid_argument("build_metadata: " + str(num_pages.size()) + " page counts and " +
                                str(cached_lengths.size()) + " cached lengths for " + str(B) + " users");
  }
  BatchMetadata m;
  m.batch_size = static_cast<int64_t>(B);
  for (size_t b = 0; b < B; ++b) {
    const int64_t c = cached_lengths[b], t = total_lengths[b];
    if (c < 0 || c > t) {
      throw std::invalid_argument("build_metadata: user " + str(b) + " has cached length " + str(c) +
                                  " outside [0, " + str(t) + "]");
    }
    if (num_pages[b] != ceil_div(t, page_size)) {
      throw std::invalid_argument("build_metadata: user " + str(b) + " has " + str(num_pages[b]) + " pages for " +
                                  str(t) + " tokens of page size " + str(page_size));
    }
    m.num_new_tokens += t - c;
    m.num_total_tokens += t;
    m.num_batch_pages += num_pages[b];
    m.max_new_len = b ? std::max(m.max_new_len, t - c) : t - c;
    m.max_total_len = b ? std::max(m.max_total_len, t) : t;
  }
  const int64_t Bi = m.batch_size;
  std::vector<int64_t>& buf = m.buffer;
  buf.reserve(static_cast<size_t>(3 * (Bi + 1) + 4 * Bi + m.num_batch_pages + 2 * m.num_new_tokens));
  auto prefix_sums = [&](auto value) {
    int64_t acc = 0;
    buf.push_back(0);
    for (size_t b = 0; b < B; ++b) buf.push_back(acc += value(b));
  };
  prefix_sums([&](size_t b) { return num_pages[b]; });                           // kv_indptr
  for (size_t b = 0; b < B; ++b) {                                               // kv_last_page_len
    buf.push_back(num_pages[b] ? total_lengths[b] - (num_pages[b] - 1) * page_size : 0);
  }
  buf.insert(buf.end(), cached_lengths.begin(), cached_lengths.end());          // cached_lengths
  for (size_t b = 0; b < B; ++b) buf.push_back(total_lengths[b] - cached_lengths[b]);  // new_lengths
  buf.insert(buf.end(), total_lengths.begin(), total_lengths.end());            // total_lengths
  prefix_sums([&](size_t b) { return total_lengths[b] - cached_lengths[b]; });  // new_offsets
  prefix_sums([&](size_t b) { return total_lengths[b]; });                      // total_offsets
  buf.insert(buf.end(), kv_indices, kv_indices + m.num_batch_pages);            // kv_indices
  for (size_t b = 0; b < B; ++b) {                                               // new_token_batch
    buf.insert(buf.end(), static_cast<size_t>(total_lengths[b] - cached_lengths[b]), static_cast<int64_t>(b));
  }
  for (size_t b = 0; b < B; ++b) {                                               // new_token_positions
    for (int64_t pos = cached_lengths[b]; pos < total_lengths[b]; ++pos) buf.push_back(pos);
  }
  return m;
}

// ---------------------------------------------------------------------------------- directory
CacheCore::CacheCore(int64_t num_pages, int64_t page_size)
    : page_size_(page_size), pool_(std::make_shared<PagePool>(num_pages)) {
  if (page_size <= 0) throw std::invalid_argument("page_size must be > 0, got " + str(page_size));
}

CacheCore::~CacheCore() = default;

int32_t CacheCore::set_namespace(const std::string& name, uint64_t seed) {
  if (name.empty()) throw std::invalid_argument("namespace must be a non-empty string");
  auto it = std::find(ns_names_.begin(), ns_names_.end(), name);
  if (it == ns_names_.end()) {
    ns_names_.push_back(name);
    ns_seeds_.push_back(seed);
    ns_ = static_cast<int32_t>(ns_names_.size() - 1);
  } else {
    ns_ = static_cast<int32_t>(it - ns_names_.begin());
    ns_seeds_[ns_] = seed;
  }
  return ns_;
}

CacheCore::Entry* CacheCore::find(Key key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &*it->second;
}

const CacheCore::Entry* CacheCore::find(Key key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &*it->second;
}

Digest history_prefix_digest(const HistoryRef& h, int64_t num_tokens, int64_t page_size, uint64_t seed) {
  if (h.has_caller_digests()) {
    if (h.tail_digest != nullptr && num_tokens == h.tail_tokens) return *h.tail_digest;
    if (h.page_digests != nullptr && num_tokens > 0 && num_tokens % page_size == 0 && num_tokens <= h.length) {
      return h.page_digests[num_tokens / page_size - 1];
    }
    throw std::invalid_argument("no caller digest for the first " + str(num_tokens) + " tokens (page size " +
                                str(page_size) + ", tail digest covers " + str(h.tail_tokens) + ")");
  }
  if (h.rows == nullptr && num_tokens > 0) throw std::invalid_argument("history has neither token rows nor digests");
  return hash_bytes(h.rows, static_cast<size_t>(num_tokens * h.row_bytes), seed);
}

int64_t longest_matching_pages(const Digest* stored, int64_t num_stored, const HistoryRef& h, int64_t page_size,
                               uint64_t seed) {
  const int64_t P = page_size;
  int64_t hi = std::min<int64_t>(num_stored, h.length / P);
  if (hi == 0) return 0;
  if (history_prefix_digest(h, hi * P, P, seed) == stored[hi - 1]) return hi;
  // NOTE: "matches at k" is monotone in k (a prefix hash commits to every earlier token), so
  // bisect. Invariant: pages [0, lo) match, page hi does not.
  int64_t lo = 0;
  hi -= 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (history_prefix_digest(h, mid * P, P, seed) == stored[mid - 1]) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

Digest CacheCore::prefix_digest(const HistoryRef& h, int64_t num_tokens, uint64_t seed) const {
  return history_prefix_digest(h, num_tokens, page_size_, seed);
}

int64_t CacheCore::longest_matching_pages(const std::vector<Digest>& stored, const HistoryRef& h,
                                          uint64_t seed) const {
  return gr_kv_core::longest_matching_pages(stored.data(), static_cast<int64_t>(stored.size()), h, page_size_, seed);
}

int64_t CacheCore::match(int64_t user, const HistoryRef& h, int64_t* version) const {
  if (ns_ < 0) throw std::invalid_argument("no namespace set");
  if (h.length < 0) throw std::invalid_argument("negative history length " + str(h.length) + " for user " + str(user));
  const Entry* e = find(Key{ns_, user});
  if (version != nullptr) *version = e == nullptr ? -1 : e->version;
  if (e == nullptr || e->num_tokens == 0) return 0;
  const uint64_t seed = ns_seeds_[ns_];
  const int64_t n = e->num_tokens;
  // NOTE: only the entry's own partial tail may be reused mid-page; a shorter or edited history
  // reuses whole pages, so a page that may be in flight to a lower tier is never appended to.
  if (h.length >= n && prefix_digest(h, n, seed) == e->digest) return n;
  return longest_matching_pages(e->page_hashes, h, seed) * page_size_;
}

void CacheCore::check_user_ids(const std::vector<int64_t>& users, const char* what) const {
  if (users.empty()) throw std::invalid_argument(std::string(what) + ": empty batch");
  std::unordered_set<int64_t> seen;
  for (int64_t u : users) {
    if (!seen.insert(u).second) {
      throw std::invalid_argument(std::string(what) + ": user " + str(u) + " appears more than once in one batch");
    }
  }
}

int64_t CacheCore::evictable_pages(const std::vector<int64_t>& exclude) const {
  const std::unordered_set<int64_t> ex(exclude.begin(), exclude.end());
  int64_t n = 0;
  for (const Entry& e : lru_) {
    if (e.evictable() && !(e.key.ns == ns_ && ex.count(e.key.user))) n += static_cast<int64_t>(e.pages.size());
  }
  return n;
}

bool CacheCore::fits(int64_t demand, const std::vector<int64_t>& exclude) const {
  return pool_->num_free() >= demand || pool_->num_free() + evictable_pages(exclude) >= demand;
}

void CacheCore::drop(LruList::iterator it, Evicted* evicted) {
  if (evicted != nullptr) {
    evicted->users += 1;
    evicted->pages += static_cast<int64_t>(it->pages.size());
  }
  pool_->free(it->pages.data(), it->pages.size());
  index_.erase(it->key);
  lru_.erase(it);
}

bool CacheCore::make_room(int64_t demand, const std::vector<int64_t>& exclude, Evicted* evicted) {
  if (pool_->num_free() >= demand) return true;
  if (!fits(demand, exclude)) return false;
  const std::unordered_set<int64_t> ex(exclude.begin(), exclude.end());
  // NOTE: least recently used first; users of the batch and pinned users are skipped.
  for (auto it = lru_.begin(); it != lru_.end() && pool_->num_free() < demand;) {
    auto next = std::next(it);
    if (it->evictable() && !(it->key.ns == ns_ && ex.count(it->key.user))) drop(it, evicted);
    it = next;
  }
  return true;
}

AllocResult CacheCore::allocate(const std::vector<int64_t>& users, const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& device_tokens, const std::vector<int64_t>& versions,
                                const std::vector<int64_t>& host_pages) {
  if (ns_ < 0) throw std::invalid_argument("no namespace set");
  check_user_ids(users, "allocate");
  const size_t B = users.size();
  for (const auto* v : {&lengths, &device_tokens, &versions, &host_pages}) {
    if (v->size() != B) {
      throw std::invalid_argument("allocate: per-user list has " + str(v->size()) + " entries for " + str(B) + " users");
    }
  }
  const int64_t P = page_size_;
  AllocResult r;
  // Pass 1 decides, changing nothing (so a refusal leaves the cache as it was).
  std::vector<Entry*> entries(B);
  bool changed = false;
  for (size_t b = 0; b < B; ++b) {
    Entry* e = entries[b] = find(Key{ns_, users[b]});
    if (e != nullptr && e->in_plan) {
      r.status = AllocStatus::kInFlight;
      r.index = static_cast<int64_t>(b);
      return r;
    }
    changed |= (e == nullptr ? -1 : e->version) != versions[b];
  }
  if (changed) {
    r.status = AllocStatus::kChanged;
    return r;
  }
  std::vector<int64_t> fresh_counts(B);
  for (size_t b = 0; b < B; ++b) {
    const Entry* e = entries[b];
    const int64_t L = lengths[b], d = device_tokens[b], hp = host_pages[b];
    const int64_t have = e == nullptr ? 0 : e->num_tokens;
    if (L < 0) throw std::invalid_argument("negative history length " + str(L) + " for user " + str(users[b]));
    if (d < 0 || d > std::min(L, have) || (d != have && d % P != 0)) {
      throw std::invalid_argument("user " + str(users[b]) + ": device tokens " + str(d) + " are not a reusable prefix (" +
                                  str(have) + " cached, history of " + str(L) + ", page size " + str(P) + ")");
    }
    if (hp < 0 || hp > L / P) {  // NOTE: not hp * P > L, which can wrap
      throw std::invalid_argument("user " + str(users[b]) + ": host pages " + str(hp) + " do not fit a history of " +
                                  str(L) + " tokens");
    }
    int64_t k, o, c, dv;
    if (hp * P > d) {  // onboard host pages [d / P, hp); a device partial tail is dropped
      k = d / P, o = hp - d / P, c = hp * P, dv = (d / P) * P;
    } else {
      k = ceil_div(d, P), o = 0, c = d, dv = d;
    }
    r.keep_pages.push_back(k);
    r.onboard_pages.push_back(o);
    r.cached_lengths.push_back(c);
    r.device_tokens.push_back(dv);
    fresh_counts[b] = ceil_div(L, P) - k;
    if (fresh_counts[b] > pool_->num_pages()) {  // NOTE: before summing, so the demand cannot wrap
      r.status = AllocStatus::kTooBig;
      return r;
    }
    r.demand += fresh_counts[b];
  }
  if (r.demand > pool_->num_pages()) {
    r.status = AllocStatus::kTooBig;
    return r;
  }
  if (!make_room(r.demand, users, &r.evicted)) {
    r.status = AllocStatus::kNoFit;
    return r;
  }

  // Pass 2 commits to the decisions.
  Plan plan;
  plan.ns = ns_;
  plan.seed = ns_seeds_[ns_];
  const bool ok = pool_->allocate(r.demand, &plan.fresh);
  if (!ok) throw std::logic_error("allocate: make_room succeeded but the pool is short");
  plan.users = users;
  plan.totals = lengths;
  plan.keep = r.keep_pages;
  plan.device_tokens = r.device_tokens;
  plan.kv_indptr.push_back(0);
  plan.fresh_indptr.push_back(0);
  std::vector<int64_t> num_pages(B);
  int64_t pos = 0;
  for (size_t b = 0; b < B; ++b) {
    const Key key{ns_, users[b]};
    auto it = index_.find(key);
    Entry* e;
    if (it == index_.end()) {
      lru_.emplace_back();
      e = &lru_.back();
      e->key = key;
      e->version = tick();
      index_.emplace(key, std::prev(lru_.end()));
    } else {
      lru_.splice(lru_.end(), lru_, it->second);
      e = &*it->second;
    }
    e->in_plan = true;
    plan.kv_indices.insert(plan.kv_indices.end(), e->pages.begin(), e->pages.begin() + r.keep_pages[b]);
    plan.kv_indices.insert(plan.kv_indices.end(), plan.fresh.begin() + pos, plan.fresh.begin() + pos + fresh_counts[b]);
    pos += fresh_counts[b];
    num_pages[b] = r.keep_pages[b] + fresh_counts[b];
    plan.kv_indptr.push_back(static_cast<int64_t>(plan.kv_indices.size()));
    plan.fresh_indptr.push_back(pos);
  }
  r.metadata = build_metadata(plan.kv_indices.data(), num_pages, r.cached_lengths, lengths, P);
  r.plan_id = next_plan_id_++;
  plans_.emplace(r.plan_id, std::move(plan));
  return r;
}

const CacheCore::Plan& CacheCore::plan(int64_t plan_id) const {
  auto it = plans_.find(plan_id);
  if (it == plans_.end()) throw std::invalid_argument("plan " + str(plan_id) + " is not in flight");
  return it->second;
}

std::vector<int64_t> CacheCore::plan_ids() const {
  std::vector<int64_t> ids;
  for (const auto& kv : plans_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

const std::vector<int64_t>& CacheCore::plan_users(int64_t plan_id) const { return plan(plan_id).users; }

void CacheCore::commit(int64_t plan_id, const std::vector<HistoryRef>& histories) {
  const Plan& p = plan(plan_id);
  const int64_t P = page_size_;
  const size_t B = p.users.size();
  if (histories.size() != B) {
    throw std::invalid_argument("commit: " + str(histories.size()) + " histories for a plan of " + str(B) + " users");
  }
  for (size_t b = 0; b < B; ++b) {
    const HistoryRef& h = histories[b];
    if (h.length != p.totals[b]) {
      throw std::invalid_argument("commit: user " + str(p.users[b]) + " has a history of " + str(h.length) +
                                  " tokens, the plan was made for " + str(p.totals[b]));
    }
    if (h.has_caller_digests()) {
      if (h.tail_digest == nullptr || h.tail_tokens != h.length || (h.length >= P && h.page_digests == nullptr)) {
        throw std::invalid_argument("commit: user " + str(p.users[b]) +
                                    " needs caller digests of every full page and of all " + str(h.length) + " tokens");
      }
    } else if (!hashing_available() || (h.rows == nullptr && h.length > 0)) {
      throw std::invalid_argument("commit: user " + str(p.users[b]) + " has no token rows to hash and no digests");
    }
  }
  for (size_t b = 0; b < B; ++b) {
    const HistoryRef& h = histories[b];
    Entry* e = find(Key{p.ns, p.users[b]});
    if (e == nullptr || !e->in_plan) throw std::logic_error("commit: entry of a plan's user vanished");
    const int64_t total = p.totals[b];
    // Stale pages (beyond what the plan kept) go back; as zombies if a copy still reads them.
    pool_->free(e->pages.data() + p.keep[b], e->pages.size() - static_cast<size_t>(p.keep[b]));
    // Hashes of the kept full pages stay valid; hash the rest once, incrementally.
    const int64_t valid = std::min<int64_t>(static_cast<int64_t>(e->page_hashes.size()), p.device_tokens[b] / P);
    e->page_hashes.resize(static_cast<size_t>(valid));
    const int64_t full = total / P;
    if (h.has_caller_digests()) {
      e->page_hashes.insert(e->page_hashes.end(), h.page_digests + valid, h.page_digests + full);
      e->digest = *h.tail_digest;
      e->hasher.reset();
    } else {
      const int64_t rb = h.row_bytes;
      if (!e->hasher || e->hasher->num_tokens() != valid * P) {
        e->hasher = std::make_unique<StreamHasher>(p.seed);
        e->hasher->update(h.rows, static_cast<size_t>(valid * P * rb), valid * P);
      }
      for (int64_t i = valid; i < full; ++i) {
        e->hasher->update(h.rows + i * P * rb, static_cast<size_t>(P * rb), P);
        e->page_hashes.push_back(e->hasher->digest());
      }
      e->digest = e->hasher->digest_with(h.rows + full * P * rb, static_cast<size_t>((total - full * P) * rb));
    }
    e->pages.assign(p.kv_indices.begin() + p.kv_indptr[b], p.kv_indices.begin() + p.kv_indptr[b + 1]);
    e->num_tokens = total;
    e->version = tick();
    e->in_plan = false;
    if (total == 0 && e->offloads == 0) {
      auto it = index_.find(e->key);
      lru_.erase(it->second);
      index_.erase(it);
    }
  }
  plans_.erase(plan_id);
}

void CacheCore::abort(int64_t plan_id) {
  const Plan& p = plan(plan_id);
  for (size_t b = 0; b < p.users.size(); ++b) {
    Entry* e = find(Key{p.ns, p.users[b]});
    if (e == nullptr || !e->in_plan) throw std::logic_error("abort: entry of a plan's user vanished");
    pool_->free(p.fresh.data() + p.fresh_indptr[b], static_cast<size_t>(p.fresh_indptr[b + 1] - p.fresh_indptr[b]));
    e->in_plan = false;
    if (e->num_tokens == 0 && e->pages.empty() && e->offloads == 0) {
      auto it = index_.find(e->key);
      lru_.erase(it->second);
      index_.erase(it);
    }
  }
  plans_.erase(plan_id);
}

bool CacheCore::evict_blockers(int32_t ns, const std::vector<int64_t>& users) const {
  bool offloads = false;
  for (int64_t u : users) {
    const Entry* e = find(Key{ns, u});
    if (e != nullptr && e->in_plan) {
      throw std::invalid_argument("user " + str(u) + " is in an in-flight step; commit or abort it first");
    }
    offloads |= e != nullptr && e->offloads > 0;
  }
  return offloads;
}

Evicted CacheCore::evict(int32_t ns, const std::vector<int64_t>& users) {
  evict_blockers(ns, users);
  Evicted ev;
  for (int64_t u : users) {
    auto it = index_.find(Key{ns, u});
    if (it != index_.end()) drop(it->second, &ev);
  }
  return ev;
}

Evicted CacheCore::evict_all() {
  if (!plans_.empty()) {
    throw std::invalid_argument(str(num_plans()) + " steps are in flight; commit or abort them first");
  }
  Evicted ev;
  while (!lru_.empty()) drop(lru_.begin(), &ev);
  return ev;
}

std::vector<int64_t> CacheCore::reserve_scratch(int64_t n) {
  std::vector<int64_t> pages;
  if (n <= 0) return pages;
  if (!pool_->allocate(n, &pages)) {
    throw std::invalid_argument("cannot reserve " + str(n) + " scratch pages: " + str(pool_->num_free()) + " are free");
  }
  scratch_.insert(scratch_.end(), pages.begin(), pages.end());
  return pages;
}

void CacheCore::add_offload(int32_t ns, int64_t user) {
  Entry* e = find(Key{ns, user});
  if (e == nullptr) throw std::invalid_argument("add_offload: user " + str(user) + " has no device entry");
  ++e->offloads;
}

void CacheCore::offload_done(int32_t ns, int64_t user) {
  Entry* e = find(Key{ns, user});
  if (e == nullptr) return;
  if (e->offloads <= 0) throw std::invalid_argument("offload_done: user " + str(user) + " has no offload in flight");
  --e->offloads;
}

CacheCore::EntryView CacheCore::entry(int32_t ns, int64_t user) const {
  EntryView v;
  const Entry* e = find(Key{ns, user});
  if (e == nullptr) return v;
  v.exists = true;
  v.num_tokens = e->num_tokens;
  v.in_plan = e->in_plan;
  v.offloads = e->offloads;
  v.version = e->version;
  v.pages = &e->pages;
  v.page_hashes = &e->page_hashes;
  return v;
}

std::vector<int64_t> CacheCore::lru_order(int32_t ns) const {
  std::vector<int64_t> out;
  for (const Entry& e : lru_) {
    if (e.key.ns == ns) out.push_back(e.key.user);
  }
  return out;
}

std::string CacheCore::check() const {
  const int64_t P = page_size_;
  std::vector<int64_t> owned;
  int64_t in_plan = 0;
  if (index_.size() != lru_.size()) return "index and LRU list disagree";
  for (const Entry& e : lru_) {
    const std::string who = "user (" + str(e.key.ns) + ", " + str(e.key.user) + ")";
    if (static_cast<int64_t>(e.pages.size()) != ceil_div(e.num_tokens, P) && !e.in_plan) {
      return who + ": " + str(e.pages.size()) + " pages for " + str(e.num_tokens) + " tokens";
    }
    if (static_cast<int64_t>(e.page_hashes.size()) != e.num_tokens / P) return who + ": hash count";
    if (e.offloads < 0) return who + ": negative offload count";
    in_plan += e.in_plan;
    owned.insert(owned.end(), e.pages.begin(), e.pages.end());
  }
  int64_t planned = 0;
  for (const auto& kv : plans_) {
    const Plan& p = kv.second;
    for (int64_t u : p.users) {
      const Entry* e = find(Key{p.ns, u});
      if (e == nullptr || !e->in_plan) return "user " + str(u) + " of plan " + str(kv.first) + " not marked";
    }
    planned += static_cast<int64_t>(p.users.size());
    owned.insert(owned.end(), p.fresh.begin(), p.fresh.end());
  }
  if (in_plan != planned) return "in_plan marks disagree with plans";
  owned.insert(owned.end(), scratch_.begin(), scratch_.end());
  return pool_->check(owned);
}

}  // namespace gr_kv_core
