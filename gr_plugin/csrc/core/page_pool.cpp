// PagePool of kv_core.h: FIFO free queue, per-page reader counts, zombie pages.
#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "kv_core.h"

namespace gr_kv_core {

PagePool::PagePool(int64_t num_pages) {
  if (num_pages < 0) throw std::invalid_argument("num_pages must be >= 0, got " + std::to_string(num_pages));
  state_.assign(static_cast<size_t>(num_pages), kFree);
  readers_.assign(static_cast<size_t>(num_pages), 0);
  for (int64_t p = 0; p < num_pages; ++p) free_.push_back(p);
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
  out->reserve(out->size() + static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = free_.front();
    free_.pop_front();
    state_[p] = kUsed;
    out->push_back(p);
  }
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
  for (size_t j = 0; j < n; ++j) {
    const int64_t p = pages[j];
    if (readers_[p] > 0) {
      state_[p] = kZombie;
      ++num_zombies_;
    } else {
      free_.push_back(p);
    }
  }
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
  // NOTE: in call order, so zombies re-enter the queue in a deterministic order.
  for (size_t j = 0; j < n; ++j) {
    const int64_t p = pages[j];
    if (readers_[p] == 0 && state_[p] == kZombie) {
      state_[p] = kFree;
      --num_zombies_;
      free_.push_back(p);
    }
  }
}

bool PagePool::is_read(int64_t page) const {
  check_page(page, "is_read");
  return readers_[page] > 0;
}

std::vector<int64_t> PagePool::free_pages() const { return std::vector<int64_t>(free_.begin(), free_.end()); }

std::string PagePool::check(const std::vector<int64_t>& owned) const {
  const int64_t n = num_pages();
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);  // 1: in the free queue, 2: owned
  for (int64_t p : free_) {
    if (p < 0 || p >= n) return "free queue holds out-of-range page " + std::to_string(p);
    if (seen[p]) return "free queue holds page " + std::to_string(p) + " twice";
    if (state_[p] != kFree) return "page " + std::to_string(p) + " is queued but not free";
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
      ++leaked;  // in use but owned by nobody, or marked free but not queued
    }
  }
  if (zombies != num_zombies_) return "zombie count " + std::to_string(num_zombies_) + " != " + std::to_string(zombies);
  if (leaked) return std::to_string(leaked) + " pages leaked";
  return "";
}

}  // namespace gr_kv_core
