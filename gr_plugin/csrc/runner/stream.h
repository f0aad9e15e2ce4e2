// Reading a request stream (format version 1, written by gr_plugin/export/stream.py; the format is
// documented there and in docs/EXPORT.md): header.txt plus one raw little-endian file per array.
//
// Owns parsing and validating the stream, and per-batch views of it. Everything is checked on load
// (header keys, array dtypes / shapes / byte sizes, offsets, lengths, id ranges), so a corrupt or
// inconsistent stream is a StreamError naming the file and the value before anything runs.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace gr_runner {

struct StreamError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Array {
  std::string dtype;            // "int64" or "float32"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;   // row-major, little-endian
  int64_t numel() const;
  const int64_t* i64() const { return reinterpret_cast<const int64_t*>(bytes.data()); }
  const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
};

// One batch of the stream: B users, their full histories (events [E, 3]: item, action, time),
// candidates, and what the Python path produced for it.
struct BatchView {
  int64_t index = 0;
  int64_t batch_size = 0;
  const int64_t* user_ids = nullptr;           // [B]
  const int64_t* history_lengths = nullptr;    // [B]
  const int64_t* candidate_lengths = nullptr;  // [B]
  const int64_t* events = nullptr;             // [E, 3], users one after another
  int64_t num_events = 0;
  const int64_t* candidate_items = nullptr;    // [C]
  int64_t num_candidates = 0;
  const float* scores = nullptr;               // [C, num_tasks], Python's eager cached scores
  const int64_t* cached_lengths = nullptr;     // [B], Python's
  // Python's nine int64 package inputs (docs/EXPORT.md, 0-8), when the stream has them.
  std::vector<std::pair<const int64_t*, int64_t>> inputs;
};

class Stream {
 public:
  // Reads and validates the stream directory `dir`; throws StreamError.
  static Stream load(const std::string& dir);

  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;  // `fallback` when the key is absent
  const std::string& get(const std::string& key) const;
  int64_t num_batches() const { return num_batches_; }
  bool has_inputs() const { return has_inputs_; }
  BatchView batch(int64_t t) const;

 private:
  const Array& array(const std::string& name, const char* dtype, size_t ndim) const;
  void validate();

  std::string dir_;
  std::map<std::string, std::string> header_;
  std::map<std::string, Array> arrays_;
  int64_t num_batches_ = 0;
  bool has_inputs_ = false;
  std::vector<int64_t> hist_off_, cand_off_, input_off_;  // per user visit / per batch
};

}  // namespace gr_runner
