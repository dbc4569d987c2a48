// Runs the CUDA GAE kernel's per-lane code on the CPU: 32 emulated lanes per
// row, the warp scan done in the kernel's order (each shuffle step reads the
// values of the step before), so a machine without a GPU checks the chunking,
// the map composition and the replay against the PyTorch reference.
//
// stdin:  int64 {rows, steps}, float32 {gamma, lam}, rewards, values, mask f32[rows * steps]
// stdout: advantages, returns f32[rows * steps]
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "harness_io.h"

#include "../../csrc/cuda/gae.cu"

namespace {

using namespace hybridflow_cuda;

using harness::read_exact;

}  // namespace

int main() {
  int64_t shape[2];
  float coef[2];
  read_exact(shape, sizeof(shape));
  read_exact(coef, sizeof(coef));
  const int64_t rows = shape[0], steps = shape[1], n = rows * steps;
  const float gamma = coef[0], gamma_lam = coef[0] * coef[1];
  std::vector<float> r(n), v(n), m(n), adv(n, -1.f), ret(n, -1.f);
  read_exact(r.data(), n * sizeof(float));
  read_exact(v.data(), n * sizeof(float));
  read_exact(m.data(), n * sizeof(float));
  const int64_t chunk = chunk_of(steps);
  for (int64_t row = 0; row < rows; ++row) {
    const float *pr = r.data() + row * steps, *pv = v.data() + row * steps, *pm = m.data() + row * steps;
    Affine scan[kLanes];
    int64_t lo[kLanes], hi[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      lo[lane] = lane * chunk < steps ? lane * chunk : steps;
      hi[lane] = lo[lane] + chunk < steps ? lo[lane] + chunk : steps;
      scan[lane] = chunk_map(pr, pv, pm, lo[lane], hi[lane], gamma, gamma_lam);
    }
    for (int delta = 1; delta < kLanes; delta <<= 1) {
      Affine before[kLanes];
      for (int lane = 0; lane < kLanes; ++lane) before[lane] = scan[lane];
      for (int lane = 0; lane + delta < kLanes; ++lane) scan[lane] = compose(before[lane], before[lane + delta]);
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      const bool last = lane == kLanes - 1;
      chunk_apply(pr, pv, pm, lo[lane], hi[lane], gamma, gamma_lam, last ? 0.f : scan[lane + 1].c0,
                  last ? 0.f : scan[lane + 1].c1, adv.data() + row * steps, ret.data() + row * steps);
    }
  }
  std::fwrite(adv.data(), sizeof(float), n, stdout);
  std::fwrite(ret.data(), sizeof(float), n, stdout);
  return 0;
}
