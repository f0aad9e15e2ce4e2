// The cache policy core of gr_plugin, in plain C++17 (no torch, no Python).
//
// Owns the device page pool (free runs, reader counts, zombie pages), the device user
// directory (per user: pages, cached token count, 128-bit prefix hashes; LRU order over users;
// in-plan / in-offload pins), longest-matching-prefix lookup, eviction to make room for a batch,
// in-flight plans, commit / abort, and the CSR metadata of a batch. It does not own K/V bytes,
// copies, lower tiers or counters: the caller (gr_plugin/cache/manager.py, or a C++ runner) does.
//
// The semantics are those documented in docs/ARCHITECTURE.md ("The cache core"); the Python
// tests in tests/cache run against this code through the torch binding (binding.cpp).
// Errors: bad input throws std::invalid_argument naming the value, before any state changes.
// Not thread-safe: the caller serialises access (the manager holds one lock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace gr_kv_core {

// ------------------------------------------------------------------------------------ identity
// A 128-bit prefix hash: XXH3-128 of the raw int64 token rows of a prefix, seeded by
// xxh3_64(namespace). Python's xxhash `intdigest()` is (high << 64) | low.
struct Digest {
  uint64_t low = 0;
  uint64_t high = 0;
};
inline bool operator==(Digest a, Digest b) { return a.low == b.low && a.high == b.high; }
inline bool operator!=(Digest a, Digest b) { return !(a == b); }

// True when the core was built against the system's libxxhash (GR_KV_HAVE_XXHASH). Without it,
// every hash must be computed by the caller and passed in (HistoryRef's digests).
bool hashing_available() noexcept;
uint64_t namespace_seed(const std::string& name);                  // XXH3_64bits(name bytes)
Digest hash_bytes(const void* data, size_t size, uint64_t seed);   // XXH3_128bits_withSeed

// Streaming XXH3-128 positioned after `num_tokens` rows; digest() equals hash_bytes of them.
class StreamHasher {
 public:
  explicit StreamHasher(uint64_t seed);
  StreamHasher(const StreamHasher& other);
  StreamHasher& operator=(const StreamHasher&) = delete;
  ~StreamHasher();
  void update(const void* data, size_t size, int64_t rows);
  Digest digest() const;
  Digest digest_with(const void* data, size_t size) const;  // as if appended; this stays put
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void* state_ = nullptr;  // XXH3_state_t*
  int64_t num_tokens_ = 0;
};

// ---------------------------------------------------------------------------------- free runs
// Free slots (device pages, host slots) as sorted runs; an allocation takes one run of
// consecutive slots whenever one of the first 64 runs fits (so a user's pages copy as one transfer
// per layer), else pieces of the lowest runs. Freed slots merge with their free neighbours.
class ExtentAllocator {
 public:
  explicit ExtentAllocator(int64_t num_slots);
  int64_t num_slots() const { return num_slots_; }
  int64_t num_free() const { return num_free_; }
  bool alloc(int64_t n, std::vector<int64_t>* out);  // false (nothing taken) if fewer are free
  // Throws std::logic_error (nothing freed) on a double free or a slot out of range.
  void free(std::vector<int64_t> slots);
  std::vector<int64_t> free_slots() const;            // ascending

 private:
  void take(std::map<int64_t, int64_t>::iterator it, int64_t n);
  void check_free(int64_t start, int64_t n) const;
  void insert(int64_t start, int64_t n);
  std::map<int64_t, int64_t> runs_;  // first slot -> length
  int64_t num_slots_, num_free_;
};

// ----------------------------------------------------------------------------------- page pool
// Which device pages are free, owned, or zombies (freed while a copy still reads them; free again
// when the last reader is done). Free pages are runs (`ExtentAllocator`): a batch's new pages are
// consecutive whenever a free run fits them, so a user's pages onboard and offload as one copy per
// layer, and page ids are deterministic. Ownership by users is the directory's business.
class PagePool {
 public:
  explicit PagePool(int64_t num_pages);
  int64_t num_pages() const { return static_cast<int64_t>(state_.size()); }
  int64_t num_free() const { return free_.num_free(); }
  int64_t num_zombies() const { return num_zombies_; }
  // Appends `n` free pages to `out` (one run when a free run fits, `ExtentAllocator`); false
  // (nothing taken) if fewer are free.
  bool allocate(int64_t n, std::vector<int64_t>* out);
  // Each page must be in use (allocated, not yet freed) and appear once.
  void free(const int64_t* pages, size_t n);
  void add_readers(const int64_t* pages, size_t n);     // pages in use; repeats count twice
  void remove_readers(const int64_t* pages, size_t n);  // each removal needs a reader
  bool is_read(int64_t page) const;
  std::vector<int64_t> free_pages() const;  // ascending
  // "" when every page is exactly one of free / zombie / in `owned` (which lists the pages in
  // use), else what is wrong.
  std::string check(const std::vector<int64_t>& owned) const;

 private:
  enum State : uint8_t { kFree = 0, kUsed = 1, kZombie = 2 };
  void check_page(int64_t page, const char* what) const;
  ExtentAllocator free_;
  std::vector<uint8_t> state_;
  std::vector<int32_t> readers_;
  int64_t num_zombies_ = 0;
};

// ------------------------------------------------------------------------------------ requests
// One user's history in a request: token rows (hashed here), or the caller's digests.
struct HistoryRef {
  const uint8_t* rows = nullptr;  // first row of this user's history
  int64_t row_bytes = 0;
  int64_t length = 0;             // rows in the history
  // Caller digests (used when set, required when hashing is unavailable): the prefix hash at
  // each full page (length / page_size of them), and the hash of the first `tail_tokens` rows.
  const Digest* page_digests = nullptr;
  const Digest* tail_digest = nullptr;
  int64_t tail_tokens = -1;
  bool has_caller_digests() const { return page_digests != nullptr || tail_digest != nullptr; }
};

// The prefix hash of a history's first `num_tokens` rows (the caller's digest when it has one)
// and how many leading pages of `stored` (prefix hashes) the history matches (bisection).
Digest history_prefix_digest(const HistoryRef& h, int64_t num_tokens, int64_t page_size, uint64_t seed);
int64_t longest_matching_pages(const Digest* stored, int64_t num_stored, const HistoryRef& h, int64_t page_size,
                               uint64_t seed);

struct Evicted {
  int64_t users = 0;
  int64_t pages = 0;
};

// One batch's CSR metadata: int64 fields packed in one buffer, in kMetadataFields order
// (lengths in terms of B users, M pages, N new tokens).
struct BatchMetadata {
  std::vector<int64_t> buffer;
  int64_t batch_size = 0, num_new_tokens = 0, num_total_tokens = 0, num_batch_pages = 0;
  int64_t max_new_len = 0, max_total_len = 0;
};
constexpr int kNumMetadataFields = 10;
extern const char* const kMetadataFields[kNumMetadataFields];  // "kv_indptr", ...
// `kv_indices` holds the pages of every user (num_pages[b] each, ceil(total[b] / page_size)).
BatchMetadata build_metadata(const int64_t* kv_indices, const std::vector<int64_t>& num_pages,
                             const std::vector<int64_t>& cached_lengths,
                             const std::vector<int64_t>& total_lengths, int64_t page_size);

enum class AllocStatus : int64_t {
  kOk = 0,        // plan created; `plan_id` names it
  kInFlight = 1,  // user `index` is already in an in-flight plan; nothing changed
  kChanged = 2,   // a user's entry changed since the lookup (versions differ): look up again
  kNoFit = 3,     // even evicting every evictable user leaves too few pages; nothing changed
  kTooBig = 4,    // the batch needs more pages than the cache has; nothing changed
};

struct AllocResult {
  AllocStatus status = AllocStatus::kOk;
  int64_t index = -1;    // kInFlight: the batch index of the user
  int64_t plan_id = -1;  // kOk
  int64_t demand = 0;    // fresh pages the batch needs
  Evicted evicted;
  // per user (kOk): whole pages kept from the device entry, pages to onboard from the host
  // tier after them, tokens reused in total and from the device alone
  std::vector<int64_t> keep_pages, onboard_pages, cached_lengths, device_tokens;
  BatchMetadata metadata;
};

// A user in a namespace: the key of the device directory and of the host tier.
struct UserKey {
  int32_t ns;
  int64_t user;
  bool operator==(const UserKey& o) const { return ns == o.ns && user == o.user; }
};
struct UserKeyHash {
  size_t operator()(const UserKey& k) const noexcept {
    return std::hash<int64_t>()(k.user) * 31u + static_cast<size_t>(k.ns);
  }
};

// ------------------------------------------------------------------------------------ the core
// Device user directory + page pool + in-flight plans. Users are keyed by (namespace id, user id);
// namespace ids come from set_namespace. Verbs without a namespace act on the current one.
class CacheCore {
 public:
  CacheCore(int64_t num_pages, int64_t page_size);
  ~CacheCore();
  CacheCore(const CacheCore&) = delete;
  CacheCore& operator=(const CacheCore&) = delete;

  int64_t page_size() const { return page_size_; }
  PagePool& pool() { return *pool_; }
  const std::shared_ptr<PagePool>& shared_pool() const { return pool_; }

  // Makes `name` current (seeded by `seed`, normally namespace_seed(name)); returns its id.
  int32_t set_namespace(const std::string& name, uint64_t seed);
  int32_t current_namespace() const { return ns_; }

  // Device tokens reusable for `user` (current namespace) and the entry's version (-1: none).
  // Reuses the entry's partial last page only when the whole entry matches; otherwise whole
  // pages, by bisection over prefix hashes. Changes nothing.
  int64_t match(int64_t user, const HistoryRef& history, int64_t* version) const;

  // Reserve pages for a batch (current namespace) from a lookup's per-user device tokens and
  // versions and the host tier's reusable whole pages; evicts LRU users (never the batch's,
  // never pinned ones) only once the batch is known to fit.
  AllocResult allocate(const std::vector<int64_t>& users, const std::vector<int64_t>& lengths,
                       const std::vector<int64_t>& device_tokens, const std::vector<int64_t>& versions,
                       const std::vector<int64_t>& host_pages);
  // Publish plan `plan_id`: each user's entry becomes its history (histories in plan order).
  void commit(int64_t plan_id, const std::vector<HistoryRef>& histories);
  // Roll plan `plan_id` back: its fresh pages are freed, entries are as before allocate.
  void abort(int64_t plan_id);
  std::vector<int64_t> plan_ids() const;
  const std::vector<int64_t>& plan_users(int64_t plan_id) const;

  // Room: whether `demand` free pages can be had without evicting `exclude` (current namespace),
  // and making that room (false, nothing changed, when it cannot).
  bool fits(int64_t demand, const std::vector<int64_t>& exclude) const;
  bool make_room(int64_t demand, const std::vector<int64_t>& exclude, Evicted* evicted);

  // Eviction. evict_blockers throws (nothing changed) if a user is in an in-flight plan and
  // returns whether one has pages being offloaded; evict drops the users' entries.
  bool evict_blockers(int32_t ns, const std::vector<int64_t>& users) const;
  Evicted evict(int32_t ns, const std::vector<int64_t>& users);
  Evicted evict_all();  // refused while a plan is in flight
  // Takes `n` free pages out of circulation for good (make_room first).
  std::vector<int64_t> reserve_scratch(int64_t n);

  // Pins of in-flight copies that read a user's pages (never evicted while > 0).
  void add_offload(int32_t ns, int64_t user);
  void offload_done(int32_t ns, int64_t user);  // no-op when the entry is gone

  // Introspection.
  struct EntryView {
    bool exists = false;
    int64_t num_tokens = 0;
    bool in_plan = false;
    int64_t offloads = 0;
    int64_t version = -1;
    const std::vector<int64_t>* pages = nullptr;
    const std::vector<Digest>* page_hashes = nullptr;
  };
  EntryView entry(int32_t ns, int64_t user) const;
  std::vector<int64_t> lru_order(int32_t ns) const;  // least recently used first
  int64_t num_entries() const { return static_cast<int64_t>(index_.size()); }
  int64_t num_plans() const { return static_cast<int64_t>(plans_.size()); }
  // "" when the accounting invariants hold (every page free, zombie, owned by one user, fresh in
  // one plan or scratch; in-plan marks agree with plans; hash counts match), else what is wrong.
  std::string check() const;

 private:
  using Key = UserKey;
  using KeyHash = UserKeyHash;
  struct Entry {
    Key key;
    std::vector<int64_t> pages;
    int64_t num_tokens = 0;
    std::vector<Digest> page_hashes;  // prefix hash at each full page
    Digest digest;                    // hash of all num_tokens rows
    std::unique_ptr<StreamHasher> hasher;  // positioned at the last full page (may be null)
    bool in_plan = false;
    int64_t offloads = 0;
    int64_t version = 0;
    bool evictable() const { return !in_plan && offloads == 0; }
  };
  struct Plan {
    int32_t ns;
    uint64_t seed;
    std::vector<int64_t> users, totals, keep, device_tokens;
    std::vector<int64_t> kv_indices, kv_indptr;  // each user's pages after the step
    std::vector<int64_t> fresh, fresh_indptr;    // pages allocated by this plan
  };
  using LruList = std::list<Entry>;

  Entry* find(Key key);
  const Entry* find(Key key) const;
  void drop(LruList::iterator it, Evicted* evicted);
  int64_t evictable_pages(const std::vector<int64_t>& exclude) const;
  Digest prefix_digest(const HistoryRef& h, int64_t num_tokens, uint64_t seed) const;
  int64_t longest_matching_pages(const std::vector<Digest>& stored, const HistoryRef& h, uint64_t seed) const;
  void check_user_ids(const std::vector<int64_t>& users, const char* what) const;
  const Plan& plan(int64_t plan_id) const;
  int64_t tick() { return ++clock_; }

  int64_t page_size_;
  std::shared_ptr<PagePool> pool_;
  LruList lru_;  // least recently used first
  std::unordered_map<Key, LruList::iterator, KeyHash> index_;
  std::unordered_map<int64_t, Plan> plans_;
  std::vector<int64_t> scratch_;
  std::vector<std::string> ns_names_;
  std::vector<uint64_t> ns_seeds_;
  int32_t ns_ = -1;
  int64_t clock_ = 0;
  int64_t next_plan_id_ = 0;
};

// ----------------------------------------------------------------------------------- host tier
// The pinned host tier's bookkeeping (the `native` backend's policy; gr_plugin/cache/host_tier.py
// is a thin layer over it): per user a contiguous prefix of full pages in host slots, each with its
// prefix hash; writes are reserved, copied by the caller, then published in reservation order (a
// failed one dooms the later ones: the prefix may not have holes); readers pin a user against
// eviction; LRU over users frees slots for a reservation. Owns no bytes and no device pages.
// Users are keyed by (namespace id, user id); the caller names namespaces.
class HostCore {
 public:
  explicit HostCore(int64_t num_slots, int64_t page_size);
  int64_t num_slots() const { return free_.num_slots(); }
  int64_t num_free() const { return free_.num_free(); }
  int64_t page_size() const { return page_size_; }

  // Leading published pages of `history` held for the user (0 without hashing when the user holds
  // at most `min_pages`). Changes nothing.
  int64_t match(int32_t ns, int64_t user, const HistoryRef& history, uint64_t seed, int64_t min_pages) const;
  int64_t version(int32_t ns, int64_t user) const;  // -1: nothing held
  // A lookup's question (the Python manager's, the C++ runner's and the cache ops' rule): the pages
  // of `history` held beyond the device's `device_tokens`, asked only when the tier holds the user
  // and the history has more whole pages than the device tokens cover (else 0; `*asked` says which).
  // `*version` gets version(ns, user).
  int64_t match_beyond(int32_t ns, int64_t user, const HistoryRef& history, uint64_t seed, int64_t device_tokens,
                       int64_t* version, bool* asked = nullptr) const;
  // Slots of published pages [first, first + n), pinned until release; false if not all held.
  bool acquire(int32_t ns, int64_t user, int64_t first, int64_t n, std::vector<int64_t>* slots);
  void release(int32_t ns, int64_t user);  // throws if the user is not pinned
  // Length of the common prefix of `hashes` and what is stored or being stored for the user.
  int64_t stored_pages(int32_t ns, int64_t user, const Digest* hashes, int64_t n) const;

  struct Dropped {  // an LRU user whose slots a reservation took (for a spill to a tier below)
    int32_t ns;
    int64_t user;
    std::vector<int64_t> slots;
    std::vector<Digest> hashes;
  };
  // Reserve slots for pages first..first+n with these prefix hashes: false, nothing changed, when
  // they cannot be had (a busy user's diverging tail, a gap, too few slots even after evicting
  // every idle user). Drops the user's stale tail past `first`, then LRU users (`dropped`).
  bool reserve(int32_t ns, int64_t user, int64_t first, const Digest* hashes, int64_t n, std::vector<int64_t>* slots,
               std::vector<Dropped>* dropped);
  // Pages that became readable: `first` page on, in `slots`, with these hashes; `tag` as completed.
  struct Published {
    int64_t first;
    std::vector<int64_t> slots;
    std::vector<Digest> hashes;
    int64_t tag;
  };
  // Complete one of the user's reservations (its slots must equal `slots`) with its first `num_ok`
  // pages good (0: none). Reservations are applied in the order they were made, whatever the order
  // they complete in (a lower-tier fetch and a write-through of one user finish on different
  // threads): a completion behind an unfinished one waits for it. Applying makes the good pages
  // readable; a short one returns the rest and dooms the user's later reservations (a hole in the
  // prefix). `out` gets one entry per reservation applied now with good pages (`tag` as completed).
  void complete(int32_t ns, int64_t user, const std::vector<int64_t>& slots, int64_t num_ok, int64_t tag,
                std::vector<Published>* out);
  // `complete` for callers that complete in reservation order: returns the first page published;
  // `published` gets the published pages' hashes (of this and of any waiting completions after it).
  int64_t publish(int32_t ns, int64_t user, const std::vector<int64_t>& slots, int64_t num_ok,
                  std::vector<Digest>* published);
  // Write-through after a commit (the Python manager's offload and the C++ runner's): for each user
  // in order, the full pages of its device entry in `core` (namespace `core_ns`) that the host tier
  // does not hold yet get a reservation here (namespace `ns`). Every reservation comes before any
  // publish, so a pending one keeps its user from being dropped by the next user's. A user without
  // an entry or with nothing new is skipped; a reservation that cannot be had counts in `failed`.
  // The caller copies device `pages` into `slots`, then publishes each in order.
  struct WriteThrough {
    int64_t user = 0, first = 0;  // pages first .. first + pages.size() of the user's history
    std::vector<int64_t> pages, slots;
  };
  std::vector<WriteThrough> reserve_write_through(int32_t ns, const CacheCore& core, int32_t core_ns,
                                                  const std::vector<int64_t>& users, std::vector<Dropped>* dropped,
                                                  int64_t* failed);
  void evict(int32_t ns, int64_t user);  // throws (nothing changed) while pinned or reserved
  void clear();                          // throws (nothing changed) while any user is busy

  std::vector<std::pair<int32_t, int64_t>> lru_order() const;  // least recently used first
  std::vector<int64_t> slots_of(int32_t ns, int64_t user) const;
  std::vector<Digest> hashes_of(int32_t ns, int64_t user) const;
  int64_t num_users() const { return static_cast<int64_t>(index_.size()); }
  // evicted users, evicted pages, failed reserves, pages written (published), pages read (acquired)
  std::vector<int64_t> counters() const;
  std::string check() const;  // "" when every slot is free or owned once, else what is wrong

 private:
  using Key = UserKey;
  using KeyHash = UserKeyHash;
  struct Reservation {
    std::vector<int64_t> slots;
    std::vector<Digest> hashes;
    bool doomed = false;
    bool done = false;   // completed, waiting for an older reservation of the user
    int64_t num_ok = 0;  // (when done)
    int64_t tag = 0;     // (when done)
  };
  struct Entry {
    Key key;
    std::vector<int64_t> slots;
    std::vector<Digest> hashes;
    std::deque<Reservation> pending;  // in write order
    int64_t pins = 0;
    int64_t version = 0;
    bool busy() const { return pins > 0 || !pending.empty(); }
    int64_t held() const;  // published + pending pages
  };
  using LruList = std::list<Entry>;
  Entry* find(Key key);
  const Entry* find(Key key) const;
  void touch(LruList::iterator it);
  void drop(LruList::iterator it, std::vector<Dropped>* dropped);

  int64_t page_size_;
  ExtentAllocator free_;
  LruList lru_;
  std::unordered_map<Key, LruList::iterator, KeyHash> index_;
  int64_t clock_ = 0;
  int64_t evicted_users_ = 0, evicted_pages_ = 0, reserve_failed_ = 0, pages_written_ = 0, pages_read_ = 0;
};

}  // namespace gr_kv_core
