// The delta encodings (lib/backend/delta.h) on one core: encode and decode rates in
// GB/s of model bytes, and the wire bytes they give, per change fraction.
//
// A synthetic bf16 model (values ~N(0, 0.02)); each update changes a fraction F of
// its elements, scattered uniformly, by +-1 or 2 units in the last place (what an
// Adam step at RL learning rates does to the elements it moves: docs/delta.md). The
// model is cut into buckets of --bucket-mib; each bucket is encoded against the
// previous update's bytes (the smallest encoding wins, per bucket) and decoded
// in place. Per fraction, medians of --rounds rounds [min-max] of:
//
//   encode_gbps, decode_gbps   model bytes per second, one thread
//   memcpy_gbps                the model copied once, same round (the limit)
//   wire_fraction              encoded bytes / model bytes, bucket headers included
//   ideal_fraction             the best single encoding of the whole model at once
//                              (no bucket boundaries, no per-bucket choice; of
//                              sparse, bitmap, xor_zstd and xor_planes at both
//                              stream settings)
//   wire_vs_ideal              wire / ideal (target <= 1.2)
//
// Every decode is checked against the encoded bytes. Prints a table and, with
// --json FILE, the numbers.
//   bazel run -c opt //tests/bench:delta_bench -- [--model-mib 256] [--bucket-mib 16]
//       [--fractions 0.01,0.042,0.1,0.2,0.5,1] [--rounds 3] [--zstd-level 1] [--planes 0|1]
//       [--fast-planes 0|1] [--json FILE]
// (--planes 0: the encoder without xor_planes, xor_zstd in its place; --fast-planes 0:
// xor_planes' streams at --zstd-level instead of the parameters tuned for them.)
#include <refit/backend/delta.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace refit::backend;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

struct stat {
  std::vector<double> v;
  double median() const {
    auto s = v;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
  double min() const { return *std::min_element(v.begin(), v.end()); }
  double max() const { return *std::max_element(v.begin(), v.end()); }
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t model_mib = 256, bucket_mib = 16;
  int rounds = 3, zstd_level = 1;
  bool planes = true;  // --planes 0: xor_zstd in xor_planes' place (the encoder before it)
  bool fast_planes = true;
  std::vector<double> fractions = {0.01, 0.042, 0.1, 0.2, 0.5, 1.0};
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--model-mib")
      model_mib = std::stoul(v);
    else if (a == "--bucket-mib")
      bucket_mib = std::stoul(v);
    else if (a == "--rounds")
      rounds = std::stoi(v);
    else if (a == "--zstd-level")
      zstd_level = std::stoi(v);
    else if (a == "--planes")
      planes = v != "0";
    else if (a == "--fast-planes")
      fast_planes = v != "0";
    else if (a == "--json")
      json_path = v;
    else if (a == "--fractions") {
      fractions.clear();
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) fractions.push_back(std::stod(x));
    } else {
      std::fprintf(stderr,
                   "usage: delta_bench [--model-mib N] [--bucket-mib N] [--fractions F,F,...] [--rounds R] "
                   "[--zstd-level L] [--planes 0|1] [--fast-planes 0|1] [--json FILE]\n");
      return 2;
    }
  }
  if ((argc - 1) % 2 != 0 || rounds < 1 || bucket_mib == 0 || model_mib == 0) {
    std::fprintf(stderr, "delta_bench: flags take one value each; rounds, sizes >= 1\n");
    return 2;
  }
  const std::size_t bytes = model_mib << 20, bucket = bucket_mib << 20, n = bytes / 2;
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::byte> base(bytes), next(bytes), live(bytes), copy(bytes);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t h = to_bf16(normal(rng));
    std::memcpy(&base[2 * i], &h, 2);
  }
  std::printf("delta encodings, one thread: %zu MiB bf16 model in %zu MiB buckets, medians of %d rounds [min-max]\n",
              model_mib, bucket_mib, rounds);
  std::printf("%9s | %22s | %22s | %22s | %8s | %8s | %8s | %s\n", "fraction", "encode GB/s", "decode GB/s",
              "memcpy GB/s", "wire", "ideal", "wire/ideal", "encodings");
  std::ostringstream json;
  json << "{\"model_mib\": " << model_mib << ", \"bucket_mib\": " << bucket_mib << ", \"rounds\": " << rounds
       << ", \"planes\": " << (planes ? "true" : "false") << ", \"fast_planes\": " << (fast_planes ? "true" : "false")
       << ", \"results\": [";
  bool first = true, verified = true;
  for (double f : fractions) {
    stat enc, dec, mem, wire_f, ideal_f;
    std::map<std::string, int> kinds;
    for (int r = 0; r < rounds; ++r) {
      // The next update: F of the elements moved by 1 or 2 ulps.
      next = base;
      std::bernoulli_distribution pick(f);
      std::uniform_int_distribution<int> step(-2, 1);
      for (std::size_t i = 0; i < n; ++i) {
        if (!pick(rng)) continue;
        std::uint16_t h;
        std::memcpy(&h, &next[2 * i], 2);
        int s = step(rng);
        h = static_cast<std::uint16_t>(h + (s >= 0 ? s + 1 : s));
        std::memcpy(&next[2 * i], &h, 2);
      }
      std::vector<std::vector<std::byte>> wire((bytes + bucket - 1) / bucket);
      std::vector<delta::encoding> kind(wire.size());
      std::size_t wire_bytes = 0;
      auto t = clock_type::now();
      for (std::size_t b = 0; b < wire.size(); ++b) {
        const std::size_t at = b * bucket, len = std::min(bucket, bytes - at);
        auto res = delta::encode({base.data() + at, len}, {next.data() + at, len}, 2, wire[b],
                                 {.allow_planes = planes, .fast_planes = fast_planes, .zstd_level = zstd_level});
        kind[b] = res.kind;
        wire_bytes += res.bytes + 32;  // + a bucket header (lib/backend/links/wire.h)
      }
      enc.v.push_back(static_cast<double>(bytes) / seconds_since(t) / 1e9);
      live = base;
      t = clock_type::now();
      for (std::size_t b = 0; b < wire.size(); ++b) {
        const std::size_t at = b * bucket, len = std::min(bucket, bytes - at);
        delta::decode(kind[b], wire[b], {live.data() + at, len}, {live.data() + at, len}, 2);
      }
      dec.v.push_back(static_cast<double>(bytes) / seconds_since(t) / 1e9);
      if (live != next) verified = false;
      t = clock_type::now();
      std::memcpy(copy.data(), next.data(), bytes);
      mem.v.push_back(static_cast<double>(bytes) / seconds_since(t) / 1e9);
      // The ideal: the best of each encoding over the whole model at once.
      std::size_t ideal = bytes;
      for (const delta::encode_options& o :
           {delta::encode_options{.allow_zstd = false},
            delta::encode_options{.allow_planes = false, .zstd_level = zstd_level, .zstd_above_fraction = 0},
            delta::encode_options{.zstd_level = zstd_level, .zstd_above_fraction = 0},
            delta::encode_options{.fast_planes = false, .zstd_level = zstd_level, .zstd_above_fraction = 0}}) {
        std::vector<std::byte> whole;
        ideal = std::min(ideal, delta::encode(base, next, 2, whole, o).bytes);
      }
      wire_f.v.push_back(static_cast<double>(wire_bytes) / static_cast<double>(bytes));
      ideal_f.v.push_back(static_cast<double>(std::max<std::size_t>(ideal, 1)) / static_cast<double>(bytes));
      for (auto k : kind) ++kinds[std::string(delta::name(k))];
      base.swap(next);
    }
    std::string ks;
    for (auto& [k, c] : kinds) ks += k + ":" + std::to_string(c / rounds) + " ";
    stat ratio;
    for (std::size_t i = 0; i < wire_f.v.size(); ++i) ratio.v.push_back(wire_f.v[i] / ideal_f.v[i]);
    std::printf(
        "%9.3f | %6.2f [%5.2f-%5.2f] | %6.2f [%5.2f-%5.2f] | %6.2f [%5.2f-%5.2f] | %8.4f | %8.4f | %8.3f | %s\n", f,
        enc.median(), enc.min(), enc.max(), dec.median(), dec.min(), dec.max(), mem.median(), mem.min(), mem.max(),
        wire_f.median(), ideal_f.median(), ratio.median(), ks.c_str());
    auto s = [](const stat& x) {
      std::ostringstream o;
      o << "{\"median\": " << x.median() << ", \"min\": " << x.min() << ", \"max\": " << x.max() << "}";
      return o.str();
    };
    json << (first ? "" : ", ") << "{\"fraction\": " << f << ", \"encode_gbps\": " << s(enc)
         << ", \"decode_gbps\": " << s(dec) << ", \"memcpy_gbps\": " << s(mem) << ", \"wire_fraction\": " << s(wire_f)
         << ", \"ideal_fraction\": " << s(ideal_f) << ", \"wire_vs_ideal\": " << s(ratio) << ", \"encodings\": \"" << ks
         << "\"}";
    first = false;
  }
  json << "], \"verified\": " << (verified ? "true" : "false") << "}\n";
  std::printf("every decode equal to the encoded bytes: %s\n", verified ? "yes" : "NO");
  if (!json_path.empty()) std::ofstream(json_path) << json.str();
  return verified ? 0 : 1;
}
