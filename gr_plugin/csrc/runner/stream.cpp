// Stream of stream.h: header parsing, array files, validation, per-batch views.
#include "stream.h"

#include <fstream>
#include <sstream>

namespace gr_runner {

namespace {
constexpr const char* kFormat = "gr_plugin_stream";
constexpr int kVersion = 1;
constexpr int kNumInputs = 9;
const char* const kIntKeys[] = {"page_size", "num_pages",  "max_positions", "num_layers",       "num_heads",
                                "head_dim",  "num_tasks",  "num_items",     "num_actions",      "num_time_buckets",
                                "num_batches"};

std::string str(int64_t v) { return std::to_string(v); }

int64_t parse_int(const std::string& text, const std::string& what) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw StreamError(what + " is not an integer: '" + text + "'");
  return v;
}
}  // namespace

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // NOTE: cannot wrap: Stream::load bounds the product by the file size
  return n;
}

const std::string& Stream::get(const std::string& key) const {
  auto it = header_.find(key);
  if (it == header_.end()) throw StreamError(dir_ + "/header.txt has no '" + key + "'");
  return it->second;
}

int64_t Stream::get_int(const std::string& key) const { return parse_int(get(key), dir_ + "/header.txt: " + key); }

int64_t Stream::get_int(const std::string& key, int64_t fallback) const {
  return header_.count(key) ? get_int(key) : fallback;
}

const Array& Stream::array(const std::string& name, const char* dtype, size_t ndim) const {
  auto it = arrays_.find(name);
  if (it == arrays_.end()) throw StreamError(dir_ + "/header.txt declares no array '" + name + "'");
  const Array& a = it->second;
  if (a.dtype != dtype || a.shape.size() != ndim) {
    throw StreamError("array '" + name + "' must be " + dtype + " with " + str(static_cast<int64_t>(ndim)) +
                      " dims, got " + a.dtype + " with " + str(static_cast<int64_t>(a.shape.size())));
  }
  return a;
}

Stream Stream::load(const std::string& dir) {
  Stream s;
  s.dir_ = dir;
  const std::string head = dir + "/header.txt";
  std::ifstream in(head);
  if (!in) throw StreamError("cannot open " + head + " (not a stream directory?)");
  std::string line;
  if (!std::getline(in, line) || line != std::string(kFormat) + " " + str(kVersion)) {
    throw StreamError(head + ": first line must be '" + kFormat + " " + str(kVersion) + "', got '" + line + "'");
  }
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::vector<std::string> parts;
    for (std::string w; words >> w;) parts.push_back(w);
    if (parts.empty()) continue;
    if (parts[0] != "array") {
      if (parts.size() != 2) throw StreamError(head + ": bad line '" + line + "'");
      s.header_[parts[0]] = parts[1];
      continue;
    }
    if (parts.size() < 4 || (parts[2] != "int64" && parts[2] != "float32")) {
      throw StreamError(head + ": bad array line '" + line + "'");
    }
    Array a;
    a.dtype = parts[2];
    // NOTE: names are plain (no path separators): the header cannot point outside the stream.
    if (parts[1].find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") !=
        std::string::npos) {
      throw StreamError(head + ": array name '" + parts[1] + "' must be letters, digits and '_'");
    }
    const std::string file = dir + "/" + parts[1] + ".bin";
    std::ifstream bin(file, std::ios::binary | std::ios::ate);
    if (!bin) throw StreamError("cannot open " + file);
    const int64_t size = static_cast<int64_t>(bin.tellg());
    // NOTE: the byte count is built dim by dim and bounded by the file size, so it cannot wrap.
    int64_t want = a.dtype == "int64" ? 8 : 4;
    for (size_t i = 3; i < parts.size(); ++i) {
      const int64_t d = parse_int(parts[i], head + ": array " + parts[1] + " dim");
      if (d < 0) throw StreamError(head + ": array " + parts[1] + " has negative dim " + str(d));
      if (d != 0 && want > size / d) {
        throw StreamError(file + " has " + str(size) + " bytes, the header says more (dim " + str(d) + " of array " +
                          parts[1] + ")");
      }
      want *= d;
      a.shape.push_back(d);
    }
    if (size != want) {
      throw StreamError(file + " has " + str(size) + " bytes, the header says " + str(want));
    }
    a.bytes.resize(static_cast<size_t>(size));
    bin.seekg(0);
    if (size > 0 && !bin.read(reinterpret_cast<char*>(a.bytes.data()), size)) throw StreamError("cannot read " + file);
    s.arrays_[parts[1]] = std::move(a);
  }
  s.validate();
  return s;
}

void Stream::validate() {
  for (const char* key : kIntKeys) {
    if (get_int(key) <= 0) throw StreamError("header " + std::string(key) + " must be > 0, got " + get(key));
  }
  if (get_int("host_slots", 0) < 0) throw StreamError("header host_slots must be >= 0, got " + get("host_slots"));
  const int64_t has = get_int("has_inputs");
  if (has != 0 && has != 1) throw StreamError("header has_inputs must be 0 or 1, got " + str(has));
  has_inputs_ = has == 1;
  num_batches_ = get_int("num_batches");
  const Array& off = array("batch_offsets", "int64", 1);
  const Array& users = array("user_ids", "int64", 1);
  const Array& hist = array("history_lengths", "int64", 1);
  const Array& cand = array("candidate_lengths", "int64", 1);
  const Array& cached = array("cached_lengths", "int64", 1);
  const Array& events = array("history_events", "int64", 2);
  const Array& items = array("candidate_items", "int64", 1);
  const Array& scores = array("scores", "float32", 2);
  const int64_t U = users.numel();
  if (off.numel() != num_batches_ + 1) {
    throw StreamError("batch_offsets has " + str(off.numel()) + " entries for " + str(num_batches_) + " batches");
  }
  for (const Array* a : {&hist, &cand, &cached}) {
    if (a->numel() != U) throw StreamError("per-user arrays disagree: " + str(a->numel()) + " vs " + str(U) + " users");
  }
  const int64_t* o = off.i64();
  if (o[0] != 0 || o[num_batches_] != U) {
    throw StreamError("batch_offsets must run from 0 to " + str(U) + ", got " + str(o[0]) + " .. " +
                      str(o[num_batches_]));
  }
  for (int64_t t = 0; t < num_batches_; ++t) {
    if (o[t + 1] <= o[t]) {
      throw StreamError("batch_offsets must increase: batch " + str(t) + " has " + str(o[t + 1] - o[t]) + " users");
    }
  }
  hist_off_.assign(1, 0);
  cand_off_.assign(1, 0);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t L = hist.i64()[u], C = cand.i64()[u], c = cached.i64()[u];
    if (L < 1 || C < 1) {
      throw StreamError("user visit " + str(u) + " (user " + str(users.i64()[u]) + ") has " + str(L) +
                        " history events and " + str(C) + " candidates; at least 1 of each is required");
    }
    if (c < 0 || c > L) throw StreamError("user visit " + str(u) + " has cached length " + str(c) + " outside [0, " + str(L) + "]");
    // NOTE: each length is bounded by what is left of its array before it is summed: no wrap.
    if (L > events.shape[0] - hist_off_.back() || C > items.numel() - cand_off_.back()) {
      throw StreamError("user visit " + str(u) + ": " + str(L) + " history events / " + str(C) +
                        " candidates run past history_events / candidate_items");
    }
    hist_off_.push_back(hist_off_.back() + L);
    cand_off_.push_back(cand_off_.back() + C);
  }
  if (events.shape[0] != hist_off_.back() || events.shape[1] != 3) {
    throw StreamError("history_events must be [" + str(hist_off_.back()) + ", 3], got [" + str(events.shape[0]) + ", " +
                      str(events.shape[1]) + "]");
  }
  const int64_t C = cand_off_.back(), T = get_int("num_tasks");
  if (items.numel() != C) throw StreamError("candidate_items has " + str(items.numel()) + " entries, lengths sum to " + str(C));
  if (scores.shape[0] != C || scores.shape[1] != T) {
    throw StreamError("scores must be [" + str(C) + ", " + str(T) + "], got [" + str(scores.shape[0]) + ", " +
                      str(scores.shape[1]) + "]");
  }
  const int64_t num_items = get_int("num_items");
  const int64_t hi[3] = {num_items, get_int("num_actions") - 1, get_int("num_time_buckets") - 1};
  const int64_t lo[3] = {1, 0, 0};
  const char* names[3] = {"item", "action", "time bucket"};
  for (int64_t e = 0; e < events.shape[0]; ++e) {
    for (int f = 0; f < 3; ++f) {
      const int64_t v = events.i64()[e * 3 + f];
      if (v < lo[f] || v > hi[f]) {
        throw StreamError("history event " + str(e) + ": " + names[f] + " id " + str(v) + " is outside [" + str(lo[f]) +
                          ", " + str(hi[f]) + "]");
      }
    }
  }
  for (int64_t j = 0; j < C; ++j) {
    const int64_t v = items.i64()[j];
    if (v < 1 || v > num_items) {
      throw StreamError("candidate " + str(j) + ": item id " + str(v) + " is outside [1, " + str(num_items) + "]");
    }
  }
  if (has_inputs_) {
    const Array& sizes = array("input_sizes", "int64", 2);
    const Array& values = array("input_values", "int64", 1);
    if (sizes.shape[0] != num_batches_ || sizes.shape[1] != kNumInputs) {
      throw StreamError("input_sizes must be [" + str(num_batches_) + ", 9], got [" + str(sizes.shape[0]) + ", " +
                        str(sizes.shape[1]) + "]");
    }
    input_off_.assign(1, 0);
    for (int64_t i = 0; i < sizes.numel(); ++i) {
      if (sizes.i64()[i] < 0 || sizes.i64()[i] > values.numel() - input_off_.back()) {
        throw StreamError("input_sizes entry " + str(i) + " = " + str(sizes.i64()[i]) + " is negative or runs past "
                          "input_values (" + str(values.numel()) + " entries)");
      }
      input_off_.push_back(input_off_.back() + sizes.i64()[i]);
    }
    if (input_off_.back() != values.numel()) {
      throw StreamError("input_values has " + str(values.numel()) + " entries, input_sizes sum to " + str(input_off_.back()));
    }
  }
}

BatchView Stream::batch(int64_t t) const {
  if (t < 0 || t >= num_batches_) throw StreamError("batch " + str(t) + " out of range [0, " + str(num_batches_) + ")");
  const int64_t lo = arrays_.at("batch_offsets").i64()[t], hi = arrays_.at("batch_offsets").i64()[t + 1];
  BatchView b;
  b.index = t;
  b.batch_size = hi - lo;
  b.user_ids = arrays_.at("user_ids").i64() + lo;
  b.history_lengths = arrays_.at("history_lengths").i64() + lo;
  b.candidate_lengths = arrays_.at("candidate_lengths").i64() + lo;
  b.cached_lengths = arrays_.at("cached_lengths").i64() + lo;
  b.events = arrays_.at("history_events").i64() + 3 * hist_off_[lo];
  b.num_events = hist_off_[hi] - hist_off_[lo];
  b.candidate_items = arrays_.at("candidate_items").i64() + cand_off_[lo];
  b.num_candidates = cand_off_[hi] - cand_off_[lo];
  b.scores = arrays_.at("scores").f32() + cand_off_[lo] * get_int("num_tasks");
  if (has_inputs_) {
    const int64_t* values = arrays_.at("input_values").i64();
    for (int i = 0; i < kNumInputs; ++i) {
      const int64_t k = t * kNumInputs + i;
      b.inputs.emplace_back(values + input_off_[k], input_off_[k + 1] - input_off_[k]);
    }
  }
  return b;
}

}  // namespace gr_runner
