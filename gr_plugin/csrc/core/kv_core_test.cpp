// A tiny test of the plain C++ core, linked without torch or Python (what a C++ runner does):
// Page ids (free runs), zombies, a miss then a hit, LRU eviction order, bad input, the host tier's slots and
// reservations, and (with libxxhash) digests equal to python-xxhash's. The thorough tests are tests/cache/test_core.py.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "kv_core.h"

using namespace gr_kv_core;

#define EXPECT(cond)                                                 \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "%s:%d: FAILED %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)

namespace {

// One user's history with caller digests (works with and without libxxhash): pages[i] stands
// for the prefix hash at page i, as the caller would compute it.
struct History {
  std::vector<int64_t> rows;
  std::vector<Digest> pages;
  Digest tail;
  HistoryRef ref(int64_t page_size, int64_t tail_tokens) const {
    HistoryRef h;
    h.rows = reinterpret_cast<const uint8_t*>(rows.data());
    h.row_bytes = sizeof(int64_t);
    h.length = static_cast<int64_t>(rows.size());
    h.page_digests = pages.data();
    h.tail_digest = &tail;
    h.tail_tokens = tail_tokens < 0 ? h.length : tail_tokens;
    (void)page_size;
    return h;
  }
};

History history(int64_t user, int64_t n, int64_t page_size) {
  History h;
  for (int64_t i = 0; i < n; ++i) h.rows.push_back(user * 1000 + i);
  for (int64_t i = 0; i < n / page_size; ++i) h.pages.push_back(Digest{static_cast<uint64_t>(user), static_cast<uint64_t>(i)});
  h.tail = Digest{static_cast<uint64_t>(user), static_cast<uint64_t>(1000 + n)};
  return h;
}

int64_t step(CacheCore& core, int64_t user, const History& h, int64_t page_size) {
  int64_t version = -1;
  const int64_t dev = core.match(user, h.ref(page_size, -1), &version);
  AllocResult r = core.allocate({user}, {static_cast<int64_t>(h.rows.size())}, {dev}, {version}, {0});
  EXPECT(r.status == AllocStatus::kOk);
  core.commit(r.plan_id, {h.ref(page_size, -1)});
  EXPECT(core.check().empty());
  return dev;
}

void test_pool() {
  PagePool pool(4);
  std::vector<int64_t> got;
  EXPECT(pool.allocate(3, &got) && got == (std::vector<int64_t>{0, 1, 2}));
  const int64_t read[] = {1};
  pool.add_readers(read, 1);
  const int64_t freed[] = {1, 0};
  pool.free(freed, 2);
  EXPECT(pool.num_zombies() == 1 && pool.free_pages() == (std::vector<int64_t>{0, 3}));
  bool threw = false;
  try {
    pool.free(freed, 1);  // page 1 is a zombie already
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw && pool.num_zombies() == 1);
  pool.remove_readers(read, 1);
  EXPECT(pool.num_zombies() == 0 && pool.free_pages() == (std::vector<int64_t>{0, 1, 3}));
  EXPECT(pool.check({2}).empty() && !pool.check({}).empty());
  got.clear();  // a run that fits whole (0..1) before pieces
  EXPECT(pool.allocate(2, &got) && got == (std::vector<int64_t>{0, 1}));
}

void test_directory() {
  const int64_t P = 4;
  CacheCore core(8, P);
  core.set_namespace("test", 7);
  for (int64_t u : {1, 2, 3}) EXPECT(step(core, u, history(u, 8, P), P) == 0);
  EXPECT(core.entry(0, 2).pages->at(0) == 2);
  EXPECT(step(core, 1, history(1, 8, P), P) == 8);  // full hit; 1 becomes most recent
  EXPECT(core.lru_order(0) == (std::vector<int64_t>{2, 3, 1}));
  step(core, 4, history(4, 16, P), P);  // needs 4 pages, 2 free: evicts user 2 only
  EXPECT(core.lru_order(0) == (std::vector<int64_t>{3, 1, 4}));
  EXPECT(*core.entry(0, 4).pages == (std::vector<int64_t>{2, 3, 6, 7}));  // no free run of 4: the lowest runs
  AllocResult r = core.allocate({5}, {40}, {0}, {-1}, {0});
  EXPECT(r.status == AllocStatus::kTooBig && core.check().empty());
  bool threw = false;
  try {
    core.allocate({5, 5}, {4, 4}, {0, 0}, {-1, -1}, {0, 0});
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw && core.lru_order(0) == (std::vector<int64_t>{3, 1, 4}));
}

void test_host_tier() {
  // Slot runs: a reservation takes one run; freed runs merge; a double free changes nothing.
  ExtentAllocator ex(8);
  std::vector<int64_t> a, b;
  EXPECT(ex.alloc(3, &a) && ex.alloc(3, &b) && a == (std::vector<int64_t>{0, 1, 2}) && b[0] == 3);
  ex.free(a);
  bool threw = false;
  try {
    ex.free({0});
  } catch (const std::logic_error&) {
    threw = true;
  }
  EXPECT(threw && ex.num_free() == 5);
  // HostCore: reserve, publish, match by caller digests, pins block eviction, LRU frees slots.
  HostCore host(4, 2);
  const Digest h[] = {{1, 0}, {2, 0}, {3, 0}};
  std::vector<int64_t> slots;
  std::vector<HostCore::Dropped> dropped;
  EXPECT(host.reserve(0, 7, 0, h, 2, &slots, &dropped) && slots == (std::vector<int64_t>{0, 1}));
  std::vector<Digest> published;
  EXPECT(host.publish(0, 7, slots, 2, &published) == 0 && published.size() == 2);
  History hist{{1, 2, 3, 4, 5}, {h[0], h[1]}, {}};
  EXPECT(host.match(0, 7, hist.ref(2, -1), 0, 0) == 2 && host.match(0, 7, hist.ref(2, -1), 0, 2) == 0);
  EXPECT(host.acquire(0, 7, 1, 1, &slots) && slots == (std::vector<int64_t>{1}));
  threw = false;
  try {
    host.evict(0, 7);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw);
  host.release(0, 7);
  EXPECT(host.reserve(0, 8, 0, h, 3, &slots, &dropped) && slots.size() == 3);  // evicts user 7
  EXPECT(dropped.size() == 1 && dropped[0].user == 7 && dropped[0].slots.size() == 2);
  EXPECT(host.publish(0, 8, slots, 1, &published) == 0 && host.slots_of(0, 8).size() == 1);
  EXPECT(host.check().empty() && host.num_free() == 3);
  // Write-through from a device entry: its full pages the host lacks, then nothing more to write.
  const int64_t P = 2;
  CacheCore core(8, P);
  const int32_t ns = core.set_namespace("test", 7);
  step(core, 9, history(9, 5, P), P);  // 2 full pages + a partial one
  HostCore tier(4, P);
  auto items = tier.reserve_write_through(0, core, ns, {9, 10}, &dropped, nullptr);  // user 10: no entry
  EXPECT(items.size() == 1 && items[0].user == 9 && items[0].first == 0 &&
         items[0].pages == std::vector<int64_t>(core.entry(ns, 9).pages->begin(), core.entry(ns, 9).pages->begin() + 2));
  tier.publish(0, 9, items[0].slots, 2, &published);
  EXPECT(tier.reserve_write_through(0, core, ns, {9}, &dropped, nullptr).empty() && tier.check().empty());
  // Completions in any order, applied in reservation order: the later one waits for the older one.
  HostCore order(6, P);
  std::vector<int64_t> older, newer;
  EXPECT(order.reserve(0, 3, 0, h, 2, &older, &dropped) && order.reserve(0, 3, 2, h + 2, 1, &newer, &dropped));
  std::vector<HostCore::Published> out;
  order.complete(0, 3, newer, 1, 5, &out);
  EXPECT(out.empty() && order.slots_of(0, 3).empty());
  order.complete(0, 3, older, 2, 4, &out);
  EXPECT(out.size() == 2 && out[0].first == 0 && out[0].tag == 4 && out[0].slots == older && out[1].first == 2 &&
         out[1].tag == 5 && out[1].slots == newer && order.slots_of(0, 3).size() == 3 && order.check().empty());
  // A short older completion dooms a newer one that already completed: its slots go back.
  EXPECT(order.reserve(0, 4, 0, h, 2, &older, &dropped) && order.reserve(0, 4, 2, h + 2, 1, &newer, &dropped));
  out.clear();
  order.complete(0, 4, newer, 1, 0, &out);
  order.complete(0, 4, older, 1, 0, &out);
  EXPECT(out.size() == 1 && out[0].slots.size() == 1 && order.slots_of(0, 4).size() == 1 && order.check().empty() &&
         order.num_free() == 2);
  threw = false;
  try {
    order.complete(0, 4, newer, 1, 0, &out);  // (nothing reserved any more)
  } catch (const std::logic_error&) {
    threw = true;
  }
  EXPECT(threw);
}

void test_hashing() {
  if (!hashing_available()) {
    std::printf("kv_core_test: built without libxxhash; digests come from the caller\n");
    return;
  }
  // Reference values from python-xxhash (xxh3_128_intdigest / xxh3_64_intdigest).
  const Digest empty = hash_bytes("", 0, 0);
  EXPECT(empty.high == 0x99aa06d3014798d8ULL && empty.low == 0x6001c324468d497fULL);
  EXPECT(namespace_seed("test") == 0x9ec9f7918d7dfc40ULL);
  const int64_t rows[] = {1, 2, 3, 4};
  const Digest d = hash_bytes(rows, sizeof(rows), 7);
  EXPECT(d.high == 0x6bf149b30cf12950ULL && d.low == 0x7ec6f1e37cbaa00cULL);
  StreamHasher s(7);
  s.update(rows, 2 * sizeof(int64_t), 2);
  EXPECT(s.digest_with(rows + 2, 2 * sizeof(int64_t)) == d && s.num_tokens() == 2);
}

}  // namespace

int main() {
  test_pool();
  test_directory();
  test_host_tier();
  test_hashing();
  std::printf("kv_core_test: ok\n");
  return 0;
}
