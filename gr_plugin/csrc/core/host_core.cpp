// The host tier's bookkeeping: per-user published prefixes (in ExtentAllocator's free runs),
// reservations, pins and LRU (HostCore). Semantics in kv_core.h and docs/ARCHITECTURE.md.
#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kv_core.h"

namespace gr_kv_core {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

// ------------------------------------------------------------------------------------- HostCore
int64_t HostCore::Entry::held() const {
  int64_t n = static_cast<int64_t>(hashes.size());
  for (const Reservation& r : pending) n += static_cast<int64_t>(r.hashes.size());
  return n;
}

HostCore::HostCore(int64_t num_slots, int64_t page_size) : page_size_(page_size), free_(num_slots) {
  if (num_slots <= 0) throw std::invalid_argument("host tier needs at least one slot, got " + str(num_slots));
  if (page_size <= 0) throw std::invalid_argument("page_size must be positive, got " + str(page_size));
}

HostCore::Entry* HostCore::find(Key key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &*it->second;
}

const HostCore::Entry* HostCore::find(Key key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &*it->second;
}

void HostCore::touch(LruList::iterator it) { lru_.splice(lru_.end(), lru_, it); }

int64_t HostCore::match(int32_t ns, int64_t user, const HistoryRef& history, uint64_t seed, int64_t min_pages) const {
  if (history.length < 0) {
    throw std::invalid_argument("negative history length " + str(history.length) + " for user " + str(user));
  }
  const Entry* e = find(Key{ns, user});
  if (e == nullptr || static_cast<int64_t>(e->hashes.size()) <= min_pages) return 0;
  return longest_matching_pages(e->hashes.data(), static_cast<int64_t>(e->hashes.size()), history, page_size_, seed);
}

int64_t HostCore::match_beyond(int32_t ns, int64_t user, const HistoryRef& history, uint64_t seed,
                               int64_t device_tokens, int64_t* version, bool* asked) const {
  const int64_t v = this->version(ns, user);
  if (version != nullptr) *version = v;
  const bool ask = v != -1 && history.length / page_size_ > device_tokens / page_size_;
  if (asked != nullptr) *asked = ask;
  return ask ? match(ns, user, history, seed, device_tokens / page_size_) : 0;
}

int64_t HostCore::version(int32_t ns, int64_t user) const {
  const Entry* e = find(Key{ns, user});
  return e == nullptr ? -1 : e->version;
}

bool HostCore::acquire(int32_t ns, int64_t user, int64_t first, int64_t n, std::vector<int64_t>* slots) {
  if (first < 0 || n < 0) {
    throw std::invalid_argument("acquire of pages [" + str(first) + ", " + str(first + n) + ") for user " + str(user));
  }
  auto it = index_.find(Key{ns, user});
  if (it == index_.end()) return false;
  const int64_t held = static_cast<int64_t>(it->second->slots.size());
  if (first > held || n > held - first) return false;  // NOTE: not first + n: it can overflow
  Entry& e = *it->second;
  e.pins += 1;
  touch(it->second);
  pages_read_ += n;
  slots->assign(e.slots.begin() + first, e.slots.begin() + first + n);
  return true;
}

void HostCore::release(int32_t ns, int64_t user) {
  Entry* e = find(Key{ns, user});
  if (e == nullptr || e->pins <= 0) throw std::logic_error("release of unpinned host entry of user " + str(user));
  e->pins -= 1;
}

int64_t HostCore::stored_pages(int32_t ns, int64_t user, const Digest* hashes, int64_t n) const {
  const Entry* e = find(Key{ns, user});
  if (e == nullptr) return 0;
  int64_t k = 0;
  for (const Digest& h : e->hashes) {
    if (k >= n || h != hashes[k]) return k;
    ++k;
  }
  for (const Reservation& r : e->pending) {
    for (const Digest& h : r.hashes) {
      if (k >= n || h != hashes[k]) return k;
      ++k;
    }
  }
  return k;
}

void HostCore::drop(LruList::iterator it, std::vector<Dropped>* dropped) {
  Entry& e = *it;
  evicted_users_ += 1;
  evicted_pages_ += static_cast<int64_t>(e.slots.size());
  if (dropped != nullptr && !e.slots.empty()) dropped->push_back(Dropped{e.key.ns, e.key.user, e.slots, e.hashes});
  free_.free(e.slots);
  index_.erase(e.key);
  lru_.erase(it);
}

bool HostCore::reserve(int32_t ns, int64_t user, int64_t first, const Digest* hashes, int64_t n,
                       std::vector<int64_t>* slots, std::vector<Dropped>* dropped) {
  if (first < 0 || n < 0) {
    throw std::invalid_argument("reserve of pages [" + str(first) + ", " + str(first + n) + ") for user " + str(user));
  }
  const Key key{ns, user};
  auto found = index_.find(key);
  Entry* entry = found == index_.end() ? nullptr : &*found->second;
  const int64_t held = entry == nullptr ? 0 : entry->held();
  // A stored prefix longer than `first` diverges from the caller's (the history was edited): its
  // stale tail is dropped, unless someone is reading or writing it.
  const int64_t stale = held - first;
  // Feasibility first, so a failed reserve changes nothing.
  int64_t evictable = 0;
  if (free_.num_free() + std::max<int64_t>(stale, 0) < n) {
    for (const Entry& e : lru_) {
      if (!(e.key == key) && !e.busy()) evictable += static_cast<int64_t>(e.slots.size());
    }
  }
  if (stale < 0 || (stale > 0 && entry->busy()) || n > free_.num_slots() ||
      free_.num_free() + stale + evictable < n) {
    reserve_failed_ += 1;
    return false;
  }
  if (stale > 0) {  // not busy: nothing pending, so `held` is the published prefix
    free_.free(std::vector<int64_t>(entry->slots.begin() + first, entry->slots.end()));
    entry->slots.resize(static_cast<size_t>(first));
    entry->hashes.resize(static_cast<size_t>(first));
    entry->version = ++clock_;
  }
  for (auto it = lru_.begin(); it != lru_.end() && free_.num_free() < n;) {
    auto next = std::next(it);
    if (!(it->key == key) && !it->busy()) drop(it, dropped);
    it = next;
  }
  if (entry == nullptr) {
    lru_.push_back(Entry{});
    auto it = std::prev(lru_.end());
    it->key = key;
    it->version = ++clock_;
    index_.emplace(key, it);
    entry = &*it;
    found = index_.find(key);
  }
  Reservation r;
  if (!free_.alloc(n, &r.slots)) throw std::logic_error("host tier: a feasible reserve found too few slots");
  r.hashes.assign(hashes, hashes + n);
  *slots = r.slots;
  entry->pending.push_back(std::move(r));
  touch(found->second);
  return true;
}

void HostCore::complete(int32_t ns, int64_t user, const std::vector<int64_t>& slots, int64_t num_ok, int64_t tag,
                        std::vector<Published>* out) {
  auto it = index_.find(Key{ns, user});
  if (it == index_.end() || it->second->pending.empty()) {
    throw std::logic_error("publish of user " + str(user) + " with nothing reserved");
  }
  Entry& e = *it->second;
  auto mine = std::find_if(e.pending.begin(), e.pending.end(),
                           [&](const Reservation& r) { return !r.done && r.slots == slots; });
  if (mine == e.pending.end()) {
    throw std::logic_error("publish of user " + str(user) + " with slots it has not reserved");
  }
  mine->done = true;
  mine->num_ok = num_ok;
  mine->tag = tag;
  bool short_one = false;
  while (!e.pending.empty() && e.pending.front().done) {
    Reservation res = std::move(e.pending.front());
    e.pending.pop_front();
    const int64_t n = static_cast<int64_t>(res.hashes.size());
    const int64_t good = res.doomed ? 0 : std::max<int64_t>(0, std::min(res.num_ok, n));
    if (good > 0) {
      Published p;
      p.first = static_cast<int64_t>(e.hashes.size());
      p.slots.assign(res.slots.begin(), res.slots.begin() + good);
      p.hashes.assign(res.hashes.begin(), res.hashes.begin() + good);
      p.tag = res.tag;
      e.slots.insert(e.slots.end(), p.slots.begin(), p.slots.end());
      e.hashes.insert(e.hashes.end(), p.hashes.begin(), p.hashes.end());
      pages_written_ += good;
      e.version = ++clock_;
      out->push_back(std::move(p));
    }
    if (good == n) continue;
    // NOTE: later reservations of this user would leave a hole in the prefix: they fail too.
    short_one = true;
    for (Reservation& later : e.pending) later.doomed = true;
    free_.free(std::vector<int64_t>(res.slots.begin() + good, res.slots.end()));
  }
  if (short_one && e.slots.empty() && e.pending.empty() && e.pins == 0) {
    auto lit = it->second;
    index_.erase(it);
    lru_.erase(lit);
  }
}

int64_t HostCore::publish(int32_t ns, int64_t user, const std::vector<int64_t>& slots, int64_t num_ok,
                          std::vector<Digest>* published) {
  const Entry* e = find(Key{ns, user});
  const int64_t held = e == nullptr ? 0 : static_cast<int64_t>(e->hashes.size());
  std::vector<Published> out;
  complete(ns, user, slots, num_ok, 0, &out);
  published->clear();
  for (const Published& p : out) published->insert(published->end(), p.hashes.begin(), p.hashes.end());
  return out.empty() ? held : out.front().first;
}

std::vector<HostCore::WriteThrough> HostCore::reserve_write_through(int32_t ns, const CacheCore& core,
                                                                   int32_t core_ns, const std::vector<int64_t>& users,
                                                                   std::vector<Dropped>* dropped, int64_t* failed) {
  for (int64_t user : users) {  // NOTE: every check before the first reservation: a throw changes nothing
    const CacheCore::EntryView entry = core.entry(core_ns, user);
    const int64_t full = entry.num_tokens / page_size_;
    if (entry.exists &&
        (static_cast<int64_t>(entry.page_hashes->size()) < full || static_cast<int64_t>(entry.pages->size()) < full)) {
      throw std::logic_error("device entry of user " + str(user) + " has fewer page hashes than full pages");
    }
  }
  std::vector<WriteThrough> out;
  for (int64_t user : users) {
    const CacheCore::EntryView entry = core.entry(core_ns, user);
    if (!entry.exists) continue;
    const int64_t full = entry.num_tokens / page_size_;
    const Digest* hashes = entry.page_hashes->data();
    const int64_t have = stored_pages(ns, user, hashes, full);
    if (have >= full) continue;
    WriteThrough w;
    if (!reserve(ns, user, have, hashes + have, full - have, &w.slots, dropped)) {
      if (failed != nullptr) *failed += 1;
      continue;
    }
    w.user = user;
    w.first = have;
    w.pages.assign(entry.pages->begin() + have, entry.pages->begin() + full);
    out.push_back(std::move(w));
  }
  return out;
}

void HostCore::evict(int32_t ns, int64_t user) {
  auto it = index_.find(Key{ns, user});
  if (it == index_.end()) return;
  if (it->second->busy()) {
    throw std::invalid_argument("user " + str(user) + " is being read or written in the host tier; cannot evict now");
  }
  drop(it->second, nullptr);
}

void HostCore::clear() {
  std::string busy;
  for (const Entry& e : lru_) {
    if (e.busy()) busy += (busy.empty() ? "" : ", ") + str(e.key.user);
  }
  if (!busy.empty()) throw std::invalid_argument("host tier has in-flight users [" + busy + "]; flush first");
  while (!lru_.empty()) drop(lru_.begin(), nullptr);
}

std::vector<std::pair<int32_t, int64_t>> HostCore::lru_order() const {
  std::vector<std::pair<int32_t, int64_t>> out;
  out.reserve(lru_.size());
  for (const Entry& e : lru_) out.emplace_back(e.key.ns, e.key.user);
  return out;
}

std::vector<int64_t> HostCore::slots_of(int32_t ns, int64_t user) const {
  const Entry* e = find(Key{ns, user});
  return e == nullptr ? std::vector<int64_t>{} : e->slots;
}

std::vector<Digest> HostCore::hashes_of(int32_t ns, int64_t user) const {
  const Entry* e = find(Key{ns, user});
  return e == nullptr ? std::vector<Digest>{} : e->hashes;
}

std::vector<int64_t> HostCore::counters() const {
  return {evicted_users_, evicted_pages_, reserve_failed_, pages_written_, pages_read_};
}

std::string HostCore::check() const {
  const int64_t num = free_.num_slots();
  std::vector<uint8_t> owned(static_cast<size_t>(num), 0);
  int64_t num_owned = 0;
  auto own = [&](int64_t s, int64_t user) -> std::string {
    if (s < 0 || s >= num) return "host slot " + str(s) + " of user " + str(user) + " out of range";
    if (owned[static_cast<size_t>(s)]) return "host slot " + str(s) + " owned twice";
    owned[static_cast<size_t>(s)] = 1;
    ++num_owned;
    return "";
  };
  for (const Entry& e : lru_) {
    if (e.slots.size() != e.hashes.size()) return "host entry of user " + str(e.key.user) + ": slots/hashes differ";
    if (e.pins < 0) return "host entry of user " + str(e.key.user) + ": negative pins";
    for (int64_t s : e.slots) {
      std::string err = own(s, e.key.user);
      if (!err.empty()) return err;
    }
    for (const Reservation& r : e.pending) {
      if (r.slots.size() != r.hashes.size()) return "a reservation of user " + str(e.key.user) + ": slots/hashes differ";
      for (int64_t s : r.slots) {
        std::string err = own(s, e.key.user);
        if (!err.empty()) return err;
      }
    }
    auto it = index_.find(e.key);
    if (it == index_.end() || &*it->second != &e) return "host LRU and index disagree on user " + str(e.key.user);
  }
  if (index_.size() != lru_.size()) return "host LRU and index sizes differ";
  const std::vector<int64_t> free = free_.free_slots();
  if (static_cast<int64_t>(free.size()) != free_.num_free()) return "host free count disagrees with its runs";
  for (int64_t s : free) {
    if (s < 0 || s >= num) return "free host slot " + str(s) + " out of range";
    if (owned[static_cast<size_t>(s)]) return "host slot " + str(s) + " both free and owned";
  }
  if (num_owned + static_cast<int64_t>(free.size()) != num) {
    return "host slots leaked: " + str(num - num_owned - static_cast<int64_t>(free.size()));
  }
  return "";
}

}  // namespace gr_kv_core
