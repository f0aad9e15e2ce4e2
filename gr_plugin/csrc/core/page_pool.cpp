// ExtentAllocator (free runs) and PagePool (free runs, per-page reader counts, zombie pages) of kv_core.h.
#include <algorithm>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kv_core.h"

namespace gr_kv_core {
namespace {

constexpr int kScanRuns = 64;  // runs looked at for one that fits whole

std::string str(int64_t v) { return std::to_string(v); }

int64_t checked_pages(int64_t num_pages) {
  if (num_pages < 0) throw std::invalid_argument("num_pages must be >= 0, got " + str(num_pages));
  return num_pages;
}

}  // namespace

// ------------------------------------------------------------------------------ ExtentAllocator
ExtentAllocator::ExtentAllocator(int64_t num_slots) : num_slots_(num_slots), num_free_(num_slots) {
  if (num_slots < 0) throw std::invalid_argument("negative slot count " + str(num_slots));
  if (num_slots > 0) runs_.emplace(0, num_slots);
}

void ExtentAllocator::take(std::map<int64_t, int64_t>::iterator it, int64_t n) {
  const int64_t start = it->first, length = it->second;
  runs_.erase(it);
  if (length > n) runs_.emplace(start + n, length - n);
  num_free_ -= n;
}

bool ExtentAllocator::alloc(int64_t n, std::vector<int64_t>* out) {
  if (n < 0) throw std::invalid_argument("negative slot count " + str(n));
  if (n > num_free_) return false;
  if (n == 0) return true;
  int scanned = 0;
  for (auto it = runs_.begin(); it != runs_.end() && scanned < kScanRuns; ++it, ++scanned) {
    if (it->second >= n) {
      const int64_t start = it->first;
      take(it, n);
      for (int64_t s = start; s < start + n; ++s) out->push_back(s);
      return true;
    }
  }
  int64_t got = 0;
  while (got < n) {
    auto it = runs_.begin();
    const int64_t start = it->first, k = std::min(it->second, n - got);
    take(it, k);
    for (int64_t s = start; s < start + k; ++s) out->push_back(s);
    got += k;
  }
  return true;
}

void ExtentAllocator::check_free(int64_t start, int64_t n) const {
  if (start < 0 || n < 0 || start > num_slots_ - n) {  // NOTE: not start + n: it can overflow
    throw std::logic_error("slots " + str(start) + ".." + str(start + n) + " out of range");
  }
  auto next = runs_.lower_bound(start);
  const bool overlaps_next = next != runs_.end() && next->first < start + n;
  const bool overlaps_prev = next != runs_.begin() && std::prev(next)->first + std::prev(next)->second > start;
  if (overlaps_next || overlaps_prev) {
    throw std::logic_error("slots " + str(start) + ".." + str(start + n) + " freed twice");
  }
}

void ExtentAllocator::insert(int64_t start, int64_t n) {
  auto next = runs_.lower_bound(start);
  num_free_ += n;
  if (next != runs_.end() && next->first == start + n) {  // merge with the next run
    n += next->second;
    next = runs_.erase(next);
  }
  if (next != runs_.begin()) {  // merge with the previous run
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += n;
      return;
    }
  }
  runs_.emplace(start, n);
}

void ExtentAllocator::free(std::vector<int64_t> slots) {
  std::sort(slots.begin(), slots.end());
  std::vector<std::pair<int64_t, int64_t>> runs;  // (start, length)
  for (int64_t s : slots) {
    if (!runs.empty() && s == runs.back().first + runs.back().second) {
      runs.back().second += 1;
    } else if (!runs.empty() && s < runs.back().first + runs.back().second) {
      throw std::logic_error("slot " + str(s) + " freed twice in one call");
    } else {
      runs.emplace_back(s, 1);
    }
  }
  for (const auto& [start, n] : runs) check_free(start, n);  // all checks first: a bad free changes nothing
  for (const auto& [start, n] : runs) insert(start, n);
}

std::vector<int64_t> ExtentAllocator::free_slots() const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_free_));
  for (const auto& [start, length] : runs_) {
    for (int64_t s = start; s < start + length; ++s) out.push_back(s);
  }
  return out;
}

// -------------------------------------------------------------------------------------- PagePool
PagePool::PagePool(int64_t num_pages) : free_(checked_pages(num_pages)) {
  state_.assign(static_cast<size_t>(num_pages), kFree);
  readers_.assign(static_cast<size_t>(num_pages), 0);
}

void PagePool::check_page(int64_t page, const char* what) const {
  if (page < 0 || page >= num_pages()) {
    throw std::invalid_argument(std::string(what) + ": page " + std::to_string(page) + " out of range [0, " +
                                std::to_string(num_pages()) + ")");
  }
}

bool PagePool::allocate(int64_t n, std::vector<int64_t>* out) {
  if (n < 0) throw std::invalid_argument("allocate: negative page count " + std::to_string(n));
  if (n > num_free()) return false;
  const size_t first = out->size();
  out->reserve(first + static_cast<size_t>(n));
  free_.alloc(n, out);
  for (size_t i = first; i < out->size(); ++i) state_[(*out)[i]] = kUsed;
  return true;
}

void PagePool::free(const int64_t* pages, size_t n) {
  // Validate everything first (a page twice in one call is caught by the temporary mark).
  size_t i = 0;
  std::string error;
  for (; i < n; ++i) {
    const int64_t p = pages[i];
    check_page(p, "free");
    if (state_[p] != kUsed) {
      error = "free: page " + std::to_string(p) + (state_[p] == kFree ? " is already free" : " is already freed (zombie)");
      break;
    }
    state_[p] = kFree;  // temporary mark
  }
  if (!error.empty()) {
    for (size_t j = 0; j < i; ++j) state_[pages[j]] = kUsed;
    throw std::invalid_argument(error);
  }
  std::vector<int64_t> now;
  now.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    const int64_t p = pages[j];
    if (readers_[p] > 0) {
      state_[p] = kZombie;
      ++num_zombies_;
    } else {
      now.push_back(p);
    }
  }
  free_.free(std::move(now));
}

void PagePool::add_readers(const int64_t* pages, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    check_page(pages[i], "add_readers");
    if (state_[pages[i]] != kUsed) {
      throw std::invalid_argument("add_readers: page " + std::to_string(pages[i]) + " is not in use");
    }
  }
  for (size_t i = 0; i < n; ++i) ++readers_[pages[i]];
}

void PagePool::remove_readers(const int64_t* pages, size_t n) {
  for (size_t i = 0; i < n; ++i) check_page(pages[i], "remove_readers");
  size_t i = 0;
  for (; i < n; ++i) {
    if (readers_[pages[i]] == 0) break;
    --readers_[pages[i]];  // tentative, undone on error
  }
  if (i < n) {
    for (size_t j = 0; j < i; ++j) ++readers_[pages[j]];
    throw std::invalid_argument("remove_readers: page " + std::to_string(pages[i]) + " has no reader");
  }
  std::vector<int64_t> now;
  for (size_t j = 0; j < n; ++j) {
    const int64_t p = pages[j];
    if (readers_[p] == 0 && state_[p] == kZombie) {
      state_[p] = kFree;
      --num_zombies_;
      now.push_back(p);
    }
  }
  free_.free(std::move(now));
}

bool PagePool::is_read(int64_t page) const {
  check_page(page, "is_read");
  return readers_[page] > 0;
}

std::vector<int64_t> PagePool::free_pages() const { return free_.free_slots(); }

std::string PagePool::check(const std::vector<int64_t>& owned) const {
  const int64_t n = num_pages();
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);  // 1: in a free run, 2: owned
  for (int64_t p : free_.free_slots()) {
    if (p < 0 || p >= n) return "free runs hold out-of-range page " + std::to_string(p);
    if (seen[p]) return "free runs hold page " + std::to_string(p) + " twice";
    if (state_[p] != kFree) return "page " + std::to_string(p) + " is in a free run but not free";
    seen[p] = 1;
  }
  std::vector<int64_t> twice;
  for (int64_t p : owned) {
    if (p < 0 || p >= n) return "owned page " + std::to_string(p) + " out of range";
    if (seen[p] == 1) return "pages both free/owned: [" + std::to_string(p) + "]";
    if (seen[p] == 2) {
      twice.push_back(p);
      continue;
    }
    if (state_[p] == kZombie) return "pages both owned/zombie: [" + std::to_string(p) + "]";
    seen[p] = 2;
  }
  if (!twice.empty()) {
    std::sort(twice.begin(), twice.end());
    std::ostringstream out;
    out << "pages owned twice: [";
    for (size_t i = 0; i < twice.size() && i < 8; ++i) out << (i ? ", " : "") << twice[i];
    out << "]";
    return out.str();
  }
  int64_t zombies = 0, leaked = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (state_[p] == kZombie) {
      ++zombies;
      if (readers_[p] <= 0) return "zombie page " + std::to_string(p) + " has no reader";
    } else if (seen[p] == 0) {
      ++leaked;  // in use but owned by nobody, or marked free but in no free run
    }
  }
  if (zombies != num_zombies_) return "zombie count " + std::to_string(num_zombies_) + " != " + std::to_string(zombies);
  if (leaked) return std::to_string(leaked) + " pages leaked";
  return "";
}

}  // namespace gr_kv_core
