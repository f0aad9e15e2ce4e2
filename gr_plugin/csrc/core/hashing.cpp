// Identity hashing through the system's libxxhash (stable ABI, declared here: no header needed).
//
// Owns hashing_available / namespace_seed / hash_bytes / StreamHasher of kv_core.h. Built with
// GR_KV_HAVE_XXHASH when the library was found at build time; otherwise every entry point but
// hashing_available() throws and the caller passes digests it computed itself (Python's xxhash).
#include <stdexcept>

#include "kv_core.h"

#if GR_KV_HAVE_XXHASH
extern "C" {
// NOTE: the subset of xxhash.h (v0.8, stable ABI) this file uses. XXH128_hash_t is
// {low64, high64}; XXH_errorcode is an int-sized enum; the state is opaque (created by the library).
struct gr_xxh128 {
  unsigned long long low64;
  unsigned long long high64;
};
struct XXH3_state_s;
unsigned long long XXH3_64bits(const void* data, size_t len);
gr_xxh128 XXH3_128bits_withSeed(const void* data, size_t len, unsigned long long seed);
XXH3_state_s* XXH3_createState(void);
int XXH3_freeState(XXH3_state_s* state);
void XXH3_copyState(XXH3_state_s* dst, const XXH3_state_s* src);
int XXH3_128bits_reset_withSeed(XXH3_state_s* state, unsigned long long seed);
int XXH3_128bits_update(XXH3_state_s* state, const void* data, size_t len);
gr_xxh128 XXH3_128bits_digest(const XXH3_state_s* state);
// NOTE: x86 builds of the library also export runtime-dispatching (AVX2/AVX512) variants; weak,
// so they are used where present and the portable ones elsewhere.
__attribute__((weak)) gr_xxh128 XXH3_128bits_withSeed_dispatch(const void* data, size_t len, unsigned long long seed);
__attribute__((weak)) int XXH3_128bits_update_dispatch(XXH3_state_s* state, const void* data, size_t len);
}
#endif

namespace gr_kv_core {

#if GR_KV_HAVE_XXHASH
namespace {
XXH3_state_s* as_state(void* p) { return static_cast<XXH3_state_s*>(p); }
Digest to_digest(gr_xxh128 h) { return Digest{h.low64, h.high64}; }
XXH3_state_s* new_state() {
  XXH3_state_s* s = XXH3_createState();
  if (s == nullptr) throw std::bad_alloc();
  return s;
}
}  // namespace

bool hashing_available() noexcept { return true; }

uint64_t namespace_seed(const std::string& name) { return XXH3_64bits(name.data(), name.size()); }

Digest hash_bytes(const void* data, size_t size, uint64_t seed) {
  if (XXH3_128bits_withSeed_dispatch != nullptr) return to_digest(XXH3_128bits_withSeed_dispatch(data, size, seed));
  return to_digest(XXH3_128bits_withSeed(data, size, seed));
}

StreamHasher::StreamHasher(uint64_t seed) : state_(new_state()) {
  XXH3_128bits_reset_withSeed(as_state(state_), seed);
}

StreamHasher::StreamHasher(const StreamHasher& other) : state_(new_state()), num_tokens_(other.num_tokens_) {
  XXH3_copyState(as_state(state_), as_state(other.state_));
}

StreamHasher::~StreamHasher() { XXH3_freeState(as_state(state_)); }

void StreamHasher::update(const void* data, size_t size, int64_t rows) {
  if (XXH3_128bits_update_dispatch != nullptr) {
    XXH3_128bits_update_dispatch(as_state(state_), data, size);
  } else {
    XXH3_128bits_update(as_state(state_), data, size);
  }
  num_tokens_ += rows;
}

Digest StreamHasher::digest() const { return to_digest(XXH3_128bits_digest(as_state(state_))); }

Digest StreamHasher::digest_with(const void* data, size_t size) const {
  StreamHasher copy(*this);
  copy.update(data, size, 0);
  return copy.digest();
}

#else  // built without libxxhash: digests come from the caller

namespace {
[[noreturn]] void unavailable() {
  throw std::invalid_argument(
      "gr_kv_core was built without libxxhash: pass digests computed by the caller "
      "(rebuild with libxxhash.so.0 present to hash in C++)");
}
}  // namespace

bool hashing_available() noexcept { return false; }
uint64_t namespace_seed(const std::string&) { unavailable(); }
Digest hash_bytes(const void*, size_t, uint64_t) { unavailable(); }
StreamHasher::StreamHasher(uint64_t) { unavailable(); }
StreamHasher::StreamHasher(const StreamHasher&) { unavailable(); }
StreamHasher::~StreamHasher() = default;
void StreamHasher::update(const void*, size_t, int64_t) { unavailable(); }
Digest StreamHasher::digest() const { unavailable(); }
Digest StreamHasher::digest_with(const void*, size_t) const { unavailable(); }

#endif

}  // namespace gr_kv_core
