// gr_runner: replays a request stream through the whole-model AOTInductor package with the KV cache
// kept across requests, in a C++ process without a Python interpreter.
//
// Per batch: cache lookup + allocate through the C++ cache core (gr_plugin/csrc/core), the package's
// inputs built in C++ (layout.h), the package run (AOTIModelPackageLoader; the gr_kv ops come from
// the C++ ops library, dlopen'ed first), then commit (abort on error, or always in --mode miss). A
// batch that does not fit in the cache runs as a full pass through the same package: every event
// new, written into a scratch table of the batch's own pages (the package's table page count is
// dynamic), the cache untouched; as the Python engine falls back.
// Reports timing (p50/p99), the hit rate and the max abs diff of the scores against the Python
// path's (recorded in the stream). Exit status: 0 ok; 1 a score differs by more than the tolerance
// or the inputs (or, with hits, the cached lengths) differ from Python's; 2 bad usage, stream,
// package or a failed step.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "host_tier.h"
#include "kv_core.h"
#include "layout.h"
#include "stream.h"

namespace {

using gr_runner::BatchView;
using gr_runner::Stream;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string package, stream, ops, scores_out, report;
  std::string mode = "hit";
  std::string device = "cpu";
  double tolerance = 1e-5;
  int64_t warmup = 0;
  bool verbose = false;
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* kUsage =
    "usage: gr_runner --package MODEL.pt2 --stream DIR [--ops LIB.so] [--mode hit|miss] [--tolerance X]\n"
    "                 [--warmup N] [--scores-out FILE] [--report FILE.json] [--device cpu|cuda[:N]] [--verbose]\n"
    "  --ops: the gr_kv ops library (python -m gr_plugin.csrc.build prints it; default $GR_KV_OPS_LIB)\n"
    "  --mode miss: abort every step's plan (nothing is reused: every history is computed)\n"
    "  --device: where the KV table and the inputs live; the package's device (default cpu)\n";

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--package") o.package = value();
    else if (a == "--stream") o.stream = value();
    else if (a == "--ops") o.ops = value();
    else if (a == "--scores-out") o.scores_out = value();
    else if (a == "--report") o.report = value();
    else if (a == "--mode") o.mode = value();
    else if (a == "--device") o.device = value();
    else if (a == "--tolerance") o.tolerance = std::stod(value());
    else if (a == "--warmup") o.warmup = std::stoll(value());
    else if (a == "--verbose") o.verbose = true;
    else if (a == "--help" || a == "-h") throw UsageError("");
    else throw UsageError("unknown argument '" + a + "'");
  }
  if (o.package.empty() || o.stream.empty()) throw UsageError("--package and --stream are required");
  if (o.mode != "hit" && o.mode != "miss") throw UsageError("--mode must be hit or miss, got '" + o.mode + "'");
  if (!(o.tolerance >= 0)) throw UsageError("--tolerance must be >= 0");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0, got " + std::to_string(o.warmup));
  bool device_ok = false;
  try {
    const c10::Device d(o.device);
    device_ok = d.is_cpu() || d.is_cuda();
  } catch (const c10::Error&) {
  }
  if (!device_ok) throw UsageError("--device must be cpu or cuda[:N], got '" + o.device + "'");
  if (o.ops.empty()) {
    const char* env = std::getenv("GR_KV_OPS_LIB");
    if (env == nullptr || *env == '\0') {
      throw UsageError("no gr_kv ops library: pass --ops (python -m gr_plugin.csrc.build prints the path) or set "
                       "GR_KV_OPS_LIB");
    }
    o.ops = env;
  }
  return o;
}

// Registers the gr_kv ops' C++ kernels in this process's dispatcher, so the package's calls resolve.
void load_ops(const std::string& path) {
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    throw std::runtime_error("cannot load the gr_kv ops library " + path + ": " + dlerror());
  }
  for (const char* op : {"gr_kv::append_kv_layer", "gr_kv::paged_hstu_attention_layer"}) {
    if (!c10::Dispatcher::singleton().findSchema({op, ""}).has_value()) {
      throw std::runtime_error(path + " does not register " + op);
    }
  }
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(at)), hi = static_cast<size_t>(std::ceil(at));
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

at::Tensor as_tensor(std::vector<int64_t>& v, std::vector<int64_t> shape) {
  return at::from_blob(v.data(), shape, at::kLong);
}

// Index of the first differing input (and a description), or -1 when every input equals Python's.
int compare_inputs(const gr_runner::StepInputs& mine, const BatchView& batch, std::string* what) {
  for (int i = 0; i < gr_runner::kNumIntInputs; ++i) {
    const auto& v = mine.values[i];
    const auto [data, size] = batch.inputs[i];
    if (static_cast<int64_t>(v.size()) != size) {
      *what = std::to_string(v.size()) + " values, Python's has " + std::to_string(size);
      return i;
    }
    for (int64_t j = 0; j < size; ++j) {
      if (v[j] != data[j]) {
        *what = "value " + std::to_string(j) + " is " + std::to_string(v[j]) + ", Python's " + std::to_string(data[j]);
        return i;
      }
    }
  }
  return -1;
}

struct Totals {
  int64_t users = 0, history_tokens = 0, cached_tokens = 0, candidates = 0, fell_back = 0, host_tokens = 0;
  int64_t inputs_compared = 0, inputs_equal = 0, cached_equal = 0;
  double max_abs_diff = 0.0;
  std::vector<double> step_ms, run_ms;
};

int run(const Options& o) {
  const c10::Device device(o.device);
  if (device.is_cuda() && !at::hasCUDA()) throw std::runtime_error("--device " + o.device + ": this libtorch has no CUDA");
  const Stream stream = Stream::load(o.stream);
  const int64_t P = stream.get_int("page_size"), num_pages = stream.get_int("num_pages");
  const int64_t max_positions = stream.get_int("max_positions"), num_tasks = stream.get_int("num_tasks");
  // NOTE: cache keys pack item << 24 | action << 16 | time (gr_plugin.modules.tokens.cache_token_keys).
  if (stream.get_int("num_items") >= (int64_t{1} << 39) || stream.get_int("num_actions") > 256 ||
      stream.get_int("num_time_buckets") > (1 << 16)) {
    throw gr_runner::StreamError("id ranges too wide for cache keys (items < 2**39, actions <= 256, time buckets <= 2**16)");
  }
  load_ops(o.ops);
  c10::InferenceMode inference_mode;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(o.package);
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot load the package " + o.package + ": " + e.what_without_backtrace());
  }
  if (!gr_kv_core::hashing_available()) {
    throw std::runtime_error("the cache core was built without libxxhash; the runner hashes histories in C++");
  }
  gr_kv_core::CacheCore core(num_pages, P);
  const std::string ns = stream.get("namespace");
  core.set_namespace(ns, gr_kv_core::namespace_seed(ns));
  at::Tensor kv_table = at::zeros({stream.get_int("num_layers"), num_pages, 2, P, stream.get_int("num_heads"),
                                         stream.get_int("head_dim")}, at::TensorOptions().dtype(at::kFloat).device(device));
  const bool hit = o.mode == "hit";
  // The stream's cache had a pinned host tier of `host_slots` pages: the runner keeps one too.
  const int64_t host_slots = stream.get_int("host_slots", 0);
  std::unique_ptr<gr_runner::HostTier> host_tier;
  if (host_slots > 0) host_tier = std::make_unique<gr_runner::HostTier>(host_slots, kv_table, P, gr_kv_core::namespace_seed(ns));
  std::vector<float> scores_out;
  Totals tot;
  for (int64_t t = 0; t < stream.num_batches(); ++t) {
    const BatchView batch = stream.batch(t);
    const size_t B = static_cast<size_t>(batch.batch_size);
    const auto t0 = Clock::now();
    std::vector<int64_t> keys(static_cast<size_t>(batch.num_events));
    for (int64_t e = 0; e < batch.num_events; ++e) {
      const int64_t* ev = batch.events + 3 * e;
      keys[e] = (ev[0] << 24) | (ev[1] << 16) | ev[2];
    }
    std::vector<gr_kv_core::HistoryRef> refs(B);
    std::vector<int64_t> users(batch.user_ids, batch.user_ids + B), lengths(B), dev(B), versions(B), host(B, 0);
    int64_t at = 0;
    for (size_t b = 0; b < B; ++b) {
      refs[b].rows = reinterpret_cast<const uint8_t*>(keys.data() + at);
      refs[b].row_bytes = sizeof(int64_t);
      refs[b].length = lengths[b] = batch.history_lengths[b];
      dev[b] = core.match(users[b], refs[b], &versions[b]);
      if (host_tier) host[b] = host_tier->match(users[b], refs[b], dev[b]);
      at += lengths[b];
    }
    gr_kv_core::AllocResult plan = core.allocate(users, lengths, dev, versions, host);
    const bool fits = plan.status == gr_kv_core::AllocStatus::kOk;
    if (!fits && plan.status != gr_kv_core::AllocStatus::kNoFit && plan.status != gr_kv_core::AllocStatus::kTooBig) {
      throw std::runtime_error("batch " + std::to_string(t) + " (" + std::to_string(B) + " users): allocate failed "
                               "with status " + std::to_string(static_cast<int64_t>(plan.status)));
    }
    // A batch that does not fit (nothing in the cache changed): a full pass, its own pages in a scratch table.
    gr_kv_core::BatchMetadata full_meta;
    at::Tensor table = kv_table;
    if (!fits) {
      std::vector<int64_t> counts(B), none(B, 0), indices;
      for (size_t b = 0; b < B; ++b) {
        counts[b] = (lengths[b] + P - 1) / P;
        for (int64_t p = 0; p < counts[b]; ++p) indices.push_back(static_cast<int64_t>(indices.size()));
      }
      full_meta = gr_kv_core::build_metadata(indices.data(), counts, none, lengths, P);
      std::vector<int64_t> shape(kv_table.sizes().begin(), kv_table.sizes().end());
      shape[1] = std::max<int64_t>(1, static_cast<int64_t>(indices.size()));
      table = at::zeros(shape, kv_table.options());
      tot.fell_back += 1;
    }
    at::Tensor logits;
    gr_runner::StepInputs in;
    Clock::time_point t1, t2;
    try {
      if (fits && host_tier) tot.host_tokens += host_tier->onboard(plan, users, kv_table);
      in = gr_runner::build_step_inputs(batch, fits ? plan.metadata : full_meta, P, max_positions);
      auto& v = in.values;
      std::vector<at::Tensor> args{as_tensor(v[0], {4, in.num_query_tokens}).to(device)};
      for (int i = 1; i < gr_runner::kNumIntInputs; ++i) {
        args.push_back(as_tensor(v[i], {static_cast<int64_t>(v[i].size())}).to(device));
      }
      args.push_back(table);
      t1 = Clock::now();
      std::vector<at::Tensor> out = loader->run(args);
      if (out.size() != 1) throw std::runtime_error("the package returned " + std::to_string(out.size()) + " outputs");
      // NOTE: the copy to the host waits for the device, so run_ms covers the package's work on a GPU too.
      logits = out[0].to(at::kFloat).to(at::kCPU).contiguous();
      t2 = Clock::now();
    } catch (...) {
      if (fits) core.abort(plan.plan_id);
      throw;
    }
    if (fits && hit) {
      core.commit(plan.plan_id, refs);
      if (host_tier) host_tier->write_through(core, users, kv_table);
    } else if (fits) {
      core.abort(plan.plan_id);
    }
    const auto t3 = Clock::now();
    if (logits.dim() != 2 || logits.size(0) != batch.num_candidates || logits.size(1) != num_tasks) {
      throw std::runtime_error("batch " + std::to_string(t) + ": the package returned logits of shape " +
                               c10::str(logits.sizes()) + ", expected [" + std::to_string(batch.num_candidates) + ", " +
                               std::to_string(num_tasks) + "]");
    }
    const float* got = logits.data_ptr<float>();
    double diff = 0.0;
    for (int64_t i = 0; i < batch.num_candidates * num_tasks; ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(got[i] - batch.scores[i])));
    }
    scores_out.insert(scores_out.end(), got, got + batch.num_candidates * num_tasks);
    tot.max_abs_diff = std::max(tot.max_abs_diff, diff);
    int64_t cached = 0;
    bool cached_equal = true;
    for (size_t b = 0; b < B; ++b) {
      const int64_t c = fits ? plan.cached_lengths[b] : 0;
      cached += c;
      cached_equal &= c == batch.cached_lengths[b];
    }
    tot.users += static_cast<int64_t>(B);
    tot.history_tokens += batch.num_events;
    tot.cached_tokens += cached;
    tot.candidates += batch.num_candidates;
    if (hit) {
      tot.cached_equal += cached_equal;
      if (stream.has_inputs()) {
        std::string what;
        const int bad = compare_inputs(in, batch, &what);
        tot.inputs_compared += 1;
        tot.inputs_equal += bad < 0;
        if (bad >= 0) {
          std::fprintf(stderr, "gr_runner: batch %lld: input %s differs from Python's: %s\n", static_cast<long long>(t),
                       gr_runner::kInputNames[bad], what.c_str());
        }
      }
    }
    if (t >= o.warmup) {
      tot.step_ms.push_back(ms(t0, t3));
      tot.run_ms.push_back(ms(t1, t2));
    }
    if (o.verbose) {
      std::fprintf(stderr, "batch %lld: %zu users, %lld query tokens, %lld/%lld cached, step %.3f ms (run %.3f ms), "
                   "max abs diff %.3g\n", static_cast<long long>(t), B, static_cast<long long>(in.num_query_tokens),
                   static_cast<long long>(cached), static_cast<long long>(batch.num_events), ms(t0, t3), ms(t1, t2), diff);
    }
  }
  std::string problems = core.check();
  if (problems.empty() && host_tier) problems = host_tier->core().check();
  if (!problems.empty()) throw std::runtime_error("cache accounting broken after the stream: " + problems);
  if (!o.scores_out.empty()) {
    std::ofstream f(o.scores_out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(scores_out.data()), static_cast<std::streamsize>(scores_out.size() * sizeof(float)));
    if (!f) throw std::runtime_error("cannot write " + o.scores_out);
  }
  const bool scores_ok = tot.max_abs_diff <= o.tolerance;
  // NOTE: with hits, the same cached lengths as Python's too (e.g. both fell back on the same batches)
  const bool inputs_ok = tot.inputs_equal == tot.inputs_compared &&
                         (!hit || tot.cached_equal == static_cast<int64_t>(stream.num_batches()));
  std::vector<std::pair<std::string, std::string>> report;
  auto add = [&](const std::string& k, double v, bool integer = false) {
    std::ostringstream s;
    if (integer) s << static_cast<long long>(v); else s << v;
    report.emplace_back(k, s.str());
  };
  report.emplace_back("mode", "\"" + o.mode + "\"");
  report.emplace_back("device", "\"" + o.device + "\"");
  add("batches", static_cast<double>(stream.num_batches()), true);
  add("timed_batches", static_cast<double>(tot.step_ms.size()), true);
  add("user_visits", static_cast<double>(tot.users), true);
  add("candidates", static_cast<double>(tot.candidates), true);
  add("history_tokens", static_cast<double>(tot.history_tokens), true);
  add("cached_tokens", static_cast<double>(tot.cached_tokens), true);
  add("full_pass_batches", static_cast<double>(tot.fell_back), true);
  add("host_slots", static_cast<double>(host_slots), true);
  add("host_hit_tokens", static_cast<double>(tot.host_tokens), true);
  add("host_pages_written", static_cast<double>(host_tier ? host_tier->pages_written() : 0), true);
  add("hit_rate", tot.history_tokens ? static_cast<double>(tot.cached_tokens) / static_cast<double>(tot.history_tokens) : 0.0);
  add("step_ms_p50", percentile(tot.step_ms, 0.5));
  add("step_ms_p90", percentile(tot.step_ms, 0.9));
  add("step_ms_p99", percentile(tot.step_ms, 0.99));
  add("run_ms_p50", percentile(tot.run_ms, 0.5));
  add("run_ms_p90", percentile(tot.run_ms, 0.9));
  add("run_ms_p99", percentile(tot.run_ms, 0.99));
  add("max_abs_diff", tot.max_abs_diff);
  add("tolerance", o.tolerance);
  add("inputs_compared", static_cast<double>(tot.inputs_compared), true);
  add("inputs_equal", static_cast<double>(tot.inputs_equal), true);
  add("cached_lengths_equal_batches", static_cast<double>(tot.cached_equal), true);
  report.emplace_back("ok", scores_ok && inputs_ok ? "true" : "false");
  for (const auto& [k, v] : report) std::printf("%-30s %s\n", k.c_str(), v.c_str());
  if (!o.report.empty()) {
    std::ofstream f(o.report);
    f << "{";
    for (size_t i = 0; i < report.size(); ++i) f << (i ? ", " : "") << "\"" << report[i].first << "\": " << report[i].second;
    f << "}\n";
    if (!f) throw std::runtime_error("cannot write " + o.report);
  }
  if (!scores_ok) {
    std::fprintf(stderr, "gr_runner: max abs diff %.3g vs the Python scores exceeds the tolerance %.3g\n", tot.max_abs_diff,
                 o.tolerance);
  }
  if (!inputs_ok) {
    std::fprintf(stderr, "gr_runner: %lld of %lld batches' inputs and %lld of %lld batches' cached lengths differ "
                 "from Python's\n", static_cast<long long>(tot.inputs_compared - tot.inputs_equal),
                 static_cast<long long>(tot.inputs_compared),
                 static_cast<long long>(hit ? stream.num_batches() - tot.cached_equal : 0),
                 static_cast<long long>(stream.num_batches()));
  }
  return scores_ok && inputs_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    if (*e.what()) std::fprintf(stderr, "gr_runner: %s\n", e.what());
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  try {
    return run(o);
  } catch (const gr_runner::StreamError& e) {
    std::fprintf(stderr, "gr_runner: invalid stream %s: %s\n", o.stream.c_str(), e.what());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "gr_runner: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gr_runner: %s\n", e.what());
  }
  return 2;
}
