// The packed 16-bit word tricks of the CUDA kernel (csrc/cuda/packed16.h) on the CPU, against a per-element
// reference that uses c10's own float16/bfloat16 conversions: every 16-bit pattern in each half of a word, then
// random runs with zeros, subnormals, huge values, Inf and NaN mixed in (ctest; no GPU needed).
#include "cuda/packed16.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace torch_gradstats::packed16;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok && ++failures <= 20) std::cerr << "FAILED: " << what << "\n";
}

double to_double(uint16_t h, bool bf16) {
  return bf16 ? double(float(c10::BFloat16(h, c10::BFloat16::from_bits()))) : double(float(c10::Half(h, c10::Half::from_bits())));
}

// What a run holds, element by element in float64.
struct Reference {
  double sumsq = 0.0;
  uint32_t zeros = 0, amax = 0;
  bool special = false;
};

Reference reference(const std::vector<uint32_t>& words, bool bf16) {
  const uint32_t inf_bits = bf16 ? 0x7f80u : 0x7c00u;
  Reference r;
  for (uint32_t w : words) {
    for (uint16_t h : {uint16_t(w & 0xffffu), uint16_t(w >> 16)}) {
      const uint32_t a = h & 0x7fffu;
      r.zeros += a == 0;
      r.special = r.special || a >= inf_bits;
      r.amax = a > r.amax ? a : r.amax;
      const double v = to_double(h, bf16);
      r.sumsq += v * v;
    }
  }
  return r;
}

template <class Words>
void check_run(const std::vector<uint32_t>& words, bool bf16, const std::string& what) {
  // The kernel's runs: 16 words (4 vectors in flight), 4 words (one vector of the remainder loop); 1 for the
  // exhaustive per-half checks.
  const Run got = words.size() == 1   ? scan_run<1, Words>(words.data())
                  : words.size() == 4 ? scan_run<4, Words>(words.data())
                                      : scan_run<16, Words>(words.data());
  const Reference want = reference(words, bf16);
  expect(got.special == want.special, what + ": special");
  if (want.special) return;  // the kernel reads such a run again element by element
  expect(got.zeros == want.zeros, what + ": zeros " + std::to_string(got.zeros) + " vs " + std::to_string(want.zeros));
  expect(got.amax == want.amax, what + ": amax");
  if (run_sum_is_kept(got.sum)) {
    // 32 exactly squared elements, rounded once per add in float32: well inside the op's 1e-5.
    expect(std::abs(double(got.sum) - want.sumsq) <= 4e-6 * want.sumsq, what + ": sum");
  } else {
    // Not kept: an overflow, or so small that float32 squares may have lost bits; the kernel redoes the squares.
    expect(want.sumsq > 0x1.fffffep127 || want.sumsq < 0x1p-99, what + ": sum rejected without a reason");
  }
}

template <class Words>
void check_dtype(bool bf16) {
  const std::string name = bf16 ? "bfloat16" : "float16";
  // Every pattern in each half, beside a plain value (1.0) and beside a zero.
  const uint32_t one = bf16 ? 0x3f80u : 0x3c00u;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    for (uint32_t other : {one, 0x0000u, 0x8000u}) {
      check_run<Words>({h | (other << 16)}, bf16, name + " low half " + std::to_string(h));
      check_run<Words>({other | (h << 16)}, bf16, name + " high half " + std::to_string(h));
    }
  }
  // Random runs of 16 and 4 words (the kernel's runs), drawn from typical and edge values.
  std::mt19937 rng(1234);
  const uint16_t inf_bits = bf16 ? 0x7f80 : 0x7c00;
  const std::vector<uint16_t> edges = {0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, uint16_t(inf_bits - 1),
                                       inf_bits, uint16_t(inf_bits | 0x8000), uint16_t(inf_bits + 1), 0x7fff, 0xffff};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 200000; ++trial) {
    std::vector<uint32_t> words(trial % 5 == 4 ? 4 : 16);
    const int mode = trial % 4;  // plain, with edge values, all tiny, all huge
    for (uint32_t& w : words) {
      uint16_t half[2];
      for (uint16_t& h : half) {
        float x = normal(rng);
        if (mode == 2) x = std::ldexp(x, bf16 ? -70 : -14);
        if (mode == 3) x = std::ldexp(x, bf16 ? 62 : 14);
        h = bf16 ? c10::BFloat16(x).x : c10::Half(x).x;
        if (mode == 1 && rng() % 8 == 0) h = edges[rng() % edges.size()];
      }
      w = uint32_t(half[0]) | (uint32_t(half[1]) << 16);
    }
    check_run<Words>(words, bf16, name + " random run " + std::to_string(trial));
  }
}

}  // namespace

int main() {
  check_dtype<BFloat16Words>(true);
  check_dtype<HalfWords>(false);
  if (failures) {
    std::cerr << failures << " checks failed\n";
    return 1;
  }
  std::cout << "packed 16-bit words: all checks passed\n";
  return 0;
}
