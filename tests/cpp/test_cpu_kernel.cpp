// The fused CPU kernel against a float64 ATen reference, from C++ alone (ctest): its statistics and, through the
// histogram overload's kernel, the exponent histogram against std::frexp.
#include "multi_tensor_stats.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::cerr << "FAILED: " << what << "\n";
  }
}

bool same(double got, double want, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= rtol * std::abs(want);
}

// The exponent histogram row of x (float64 values): floor(log2 |v|) from std::frexp, clamped to the buckets.
std::vector<int64_t> reference_histogram(const at::Tensor& x) {
  std::vector<int64_t> row(torch_gradstats::kHistogramBuckets, 0);
  const double* v = x.data_ptr<double>();
  for (int64_t k = 0; k < x.numel(); ++k) {
    if (std::isfinite(v[k]) && v[k] != 0.0) {
      int e = 0;
      std::frexp(v[k], &e);  // |v| = m * 2**e, 0.5 <= m < 1
      const int64_t b = int64_t{e} - 1 - torch_gradstats::kHistogramMinExponent;
      ++row[std::clamp<int64_t>(b, 0, torch_gradstats::kHistogramBuckets - 1)];
    }
  }
  return row;
}

void check_against_reference(const std::vector<at::Tensor>& tensors, const std::string& name) {
  at::Tensor histogram;
  auto [sumsq, amax, counts] = torch_gradstats::multi_tensor_stats_cpu(tensors, &histogram);
  const auto plain = torch_gradstats::multi_tensor_stats_cpu(tensors, nullptr);
  expect(at::equal(std::get<2>(plain), counts), name + ": the histogram overload changes no count");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor x = tensors[i].to(at::kDouble).reshape(-1);
    const bool any_nan = x.isnan().any().item<bool>();
    const bool any_inf = x.isinf().any().item<bool>();
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    const double want_sumsq = any_nan ? nan : any_inf ? inf : x.square().sum().item<double>();
    const double want_amax = any_nan ? nan : x.numel() == 0 ? 0.0 : x.abs().max().item<double>();
    const double rtol = tensors[i].scalar_type() == at::kDouble ? 1e-12 : 1e-5;
    const std::string where = name + " tensor " + std::to_string(i);
    expect(same(sumsq[i].item<double>(), want_sumsq, rtol), where + " sumsq");
    expect(same(amax[i].item<double>(), want_amax, 0.0), where + " amax");
    expect(counts[i][0].item<int64_t>() == x.eq(0).sum().item<int64_t>(), where + " zeros");
    expect(counts[i][1].item<int64_t>() == x.isnan().sum().item<int64_t>(), where + " nans");
    expect(counts[i][2].item<int64_t>() == x.isinf().sum().item<int64_t>(), where + " infs");
    const std::vector<int64_t> want = reference_histogram(x.contiguous());
    const at::Tensor got = histogram[i].contiguous();
    expect(std::equal(want.begin(), want.end(), got.data_ptr<int64_t>()), where + " exponent histogram");
  }
}

}  // namespace

int main() {
  at::manual_seed(0);
  std::vector<at::Tensor> mixed;
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble}) {
    for (int64_t n : {0, 1, 17, 513, 70001}) {
      mixed.push_back(at::randn({n}).to(dtype));
    }
  }
  check_against_reference(mixed, "random");

  at::Tensor special = at::randn({1000});
  special[3] = 0.0;
  special[4] = -0.0;
  special[600] = std::numeric_limits<float>::quiet_NaN();
  special[900] = -std::numeric_limits<float>::infinity();
  at::Tensor huge = at::full({4096}, std::numeric_limits<float>::max());
  at::Tensor tiny = at::full({1000}, 1e-30f);
  check_against_reference({special, huge, tiny, at::randn({40, 30}).t(), at::randn({5, 1}).expand({5, 9})},
                          "special");

  auto [sumsq, amax, counts] = torch_gradstats::multi_tensor_stats_cpu(std::vector<at::Tensor>{huge}, nullptr);
  expect(std::isfinite(sumsq[0].item<double>()), "FLT_MAX squares stay finite");

  // Flush-denormal sets FTZ/DAZ in this thread only; neither counts nor sums may change, whatever the thread count.
  const at::Tensor sub = at::full({100000}, 1e-310, at::kDouble);
  const auto want = torch_gradstats::multi_tensor_stats_cpu(std::vector<at::Tensor>{sub}, nullptr);
  std::vector<torch_gradstats::Stats> flushed;
  if (at::globalContext().setFlushDenormal(true)) {
    for (int threads : {1, 2, 3}) {
      at::set_num_threads(threads);
      flushed.push_back(torch_gradstats::multi_tensor_stats_cpu(std::vector<at::Tensor>{sub}, nullptr));
    }
    at::globalContext().setFlushDenormal(false);
  }
  for (const auto& got : flushed) {  // compared with flush-denormal off
    expect(std::get<2>(got).equal(std::get<2>(want)) && std::get<2>(got)[0][0].item<int64_t>() == 0,
           "flush-denormal: subnormals are not zeros");
    expect(std::get<0>(got).equal(std::get<0>(want)) && std::get<1>(got).equal(std::get<1>(want)),
           "flush-denormal: same sums and amax");
  }
  const std::string capability = torch_gradstats::cpu_kernel_capability();
  expect(capability == "AVX512" || capability == "AVX2" || capability == "DEFAULT", "capability " + capability);
  std::cout << "CPU kernel: " << capability << "\n";

  bool threw = false;
  try {
    torch_gradstats::multi_tensor_stats_cpu(std::vector<at::Tensor>{at::randn({3}), at::arange(3)}, nullptr);
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("tensors[1]") != std::string::npos;
  }
  expect(threw, "an integer tensor is rejected, naming its index");

  // An expanded view is read from its distinct elements (2**34 of them would take 64 GiB); the counts are exact.
  const int64_t n = int64_t{1} << 34;
  const auto [big_sumsq, big_amax, big_counts] = torch_gradstats::multi_tensor_stats_cpu(
      std::vector<at::Tensor>{at::zeros({1}).expand({n}), at::full({2, 1}, 3.0).expand({2, n / 2})}, nullptr);
  expect(big_counts[0][0].item<int64_t>() == n && big_counts[1][0].item<int64_t>() == 0, "expanded: zeros counted");
  expect(big_sumsq[1].item<double>() == 9.0 * double(n) && big_amax[1].item<double>() == 3.0, "expanded: sums");
  threw = false;
  try {  // overlapping windows whose copy would take 4 GiB of a 4 MiB storage
    const at::Tensor base = at::randn({int64_t{1} << 20});
    const at::Tensor windows = base.as_strided({(int64_t{1} << 20) - 1023, 1024}, {1, 1});
    torch_gradstats::multi_tensor_stats_cpu(std::vector<at::Tensor>{windows}, nullptr);
  } catch (const c10::ValueError& e) {
    threw = std::string(e.what()).find("tensors[0] (shape [1047553, 1024]") != std::string::npos;
  }
  expect(threw, "an overlapping view far larger than its memory is rejected, naming it");

  std::cout << (failures == 0 ? "all checks passed" : "some checks failed") << "\n";
  return failures == 0 ? 0 : 1;
}
