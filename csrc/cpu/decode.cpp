// The built-in rollout's decode loop on the CPU, in one call: every decode
// step of a batch after its prefill, with keyed (or greedy) sampling.
//
// The Python loop (hybridflow/rollout/generator.py) runs ~100 small torch ops
// per step (the layers, the sampler, the bookkeeping), and for a small model
// or a small batch their dispatch costs more than their arithmetic. Here the
// matmuls stay ATen's (MKL/oneDNN GEMMs, into buffers allocated once) and
// everything between them is a plain loop over the live rows: RMSNorm, RoPE,
// the cache write, attention over the cached slots, SiLU, the sampler.
//
// It computes what Decoder.forward_cached + sample compute, in float32, for
// a model the Python path would run at tensor-parallel size 1 with full
// attention: the same tokens up to float rounding (a near-tie may break the
// other way) and the same log-probs within ~1e-6. Rows that end are dropped
// from the step at once (the Python loop drops them in bulk). The KV cache,
// its key mask and per-row token counts are the Python KVCache's tensors,
// updated in place as forward_cached would. Bound in kernels.cpp (one extension, compiled once).
#include <ATen/core/Tensor.h>  // per-operator headers, as in kernels.cpp
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "layers.h"

namespace {

constexpr int kPerLayer = 7;  // attn_norm, qkv weight, qkv bias (may be empty), proj, mlp_norm, fc1, fc2

// The sampler's keyed uniforms (hybridflow.rollout.sampling.counter_uniform):
// a splitmix64-style hash of key * width + column, 52 bits, (m + 0.5) / 2^52.
inline double counter_uniform(uint64_t key, uint64_t width, uint64_t column) {
  uint64_t z = key * width + column + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z = z ^ (z >> 31);
  return (static_cast<double>(z >> 12) + 0.5) * 0x1p-52;
}

// x [n, dim] -> out [n, dim]: x * rsqrt(mean(x^2) + eps) * weight.
void rms_norm(const float* x, const float* weight, float* out, int64_t n, int64_t dim, double eps) {
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = x + i * dim;
      hybridflow_cpu::rms_norm_row(row, weight, out + i * dim, dim, hybridflow_cpu::rms_scale(row, dim, eps));
    }
  });
}

struct Sampled {
  int64_t token;
  float log_prob;
};

// One row of logits [vocab] -> the next token and its log-prob under
// log_softmax(logits / temperature) (plain log_softmax when greedy), as `sample` does.
Sampled sample_row(const float* logits, int64_t vocab, bool greedy, float temperature, uint64_t key,
                   std::vector<float>& scaled) {
  const float* l = logits;
  if (!greedy) {
    for (int64_t j = 0; j < vocab; ++j) scaled[j] = logits[j] / temperature;
    l = scaled.data();
  }
  int64_t best = 0;
  if (greedy) {
    for (int64_t j = 1; j < vocab; ++j)
      if (l[j] > l[best]) best = j;
  } else {
    double top = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < vocab; ++j) {
      const double g = static_cast<double>(l[j]) - std::log(-std::log(counter_uniform(key, vocab, j)));
      if (g > top) top = g, best = j;
    }
  }
  float mx = l[0];
  for (int64_t j = 1; j < vocab; ++j) mx = std::max(mx, l[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(l[j] - mx);
  return {best, l[best] - (mx + std::log(sum))};
}

}  // namespace

// Decode up to `steps` tokens per row after a prefill. logits [rows, V]: the
// prefill's last logits, one row per (prompt, sample). weights: per layer the
// kPerLayer tensors above, then the embedding, the final norm and the output
// layer. k_cache / v_cache [layers, rows, groups, capacity, hd], key_mask
// [rows, capacity] and seen [rows] belong to the KVCache, whose first
// `filled` slots the prefill wrote. keys [rows] (int64, each row's first
// counter; the step is added) or an empty tensor when greedy.
// Returns tokens [rows, steps] (pad after the end), log_probs, mask and the
// number of steps run.
std::vector<at::Tensor> decode_loop(at::Tensor logits, std::vector<at::Tensor> weights, at::Tensor k_cache,
                                    at::Tensor v_cache, at::Tensor key_mask, at::Tensor seen, int64_t filled,
                                    at::Tensor inv_freq, int64_t heads_per_group, double eps, int64_t steps,
                                    bool greedy, double temperature, at::Tensor keys, at::Tensor stop_ids,
                                    int64_t pad_id) {
  TORCH_CHECK(logits.dtype() == at::kFloat && k_cache.dtype() == at::kFloat, "decode_loop runs float32 models");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && key_mask.is_contiguous() && seen.is_contiguous(),
              "decode_loop needs the cache's own contiguous tensors");
  const int64_t layers = k_cache.size(0), rows = k_cache.size(1), groups = k_cache.size(2);
  const int64_t capacity = k_cache.size(3), hd = k_cache.size(4), half = hd / 2;
  const int64_t hpg = heads_per_group, heads = groups * hpg, per_group = (hpg + 2) * hd;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer + 3, "decode_loop: weights per layer");
  TORCH_CHECK(filled + steps - 1 <= capacity, "decode_loop: the cache cannot hold ", steps, " more tokens");
  const at::Tensor& embed = weights[layers * kPerLayer];
  const at::Tensor& final_norm = weights[layers * kPerLayer + 1];
  const at::Tensor& output = weights[layers * kPerLayer + 2];
  const int64_t hidden = embed.size(1), vocab = logits.size(1);
  const int64_t inter = weights[5].size(0) / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float temp = static_cast<float>(temperature);

  auto opts = logits.options();
  at::Tensor tokens = at::full({rows, steps}, pad_id, at::kLong);
  at::Tensor log_probs = at::zeros({rows, steps}, at::kFloat);
  at::Tensor mask = at::zeros({rows, steps}, at::kLong);
  at::Tensor x = at::empty({rows, hidden}, opts), h = at::empty({rows, hidden}, opts);
  at::Tensor qkv = at::empty({rows, groups * per_group}, opts), attn = at::empty({rows, heads * hd}, opts);
  at::Tensor fc1 = at::empty({rows, 2 * inter}, opts), act = at::empty({rows, inter}, opts);
  at::Tensor delta = at::empty({rows, hidden}, opts);
  at::Tensor next_logits = logits.contiguous().clone();
  at::Tensor cos_t = at::empty({rows, hd}, opts), sin_t = at::empty({rows, hd}, opts);  // per live row

  std::vector<int64_t> live(rows);
  for (int64_t r = 0; r < rows; ++r) live[r] = r;
  std::vector<int64_t> stops(stop_ids.data_ptr<int64_t>(), stop_ids.data_ptr<int64_t>() + stop_ids.numel());
  std::vector<int64_t> next_token(rows);
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = log_probs.data_ptr<float>();
  int64_t* msk = mask.data_ptr<int64_t>();
  const int64_t* key = greedy ? nullptr : keys.data_ptr<int64_t>();
  bool* kmask = key_mask.data_ptr<bool>();
  int64_t* seen_p = seen.data_ptr<int64_t>();
  const float* inv = inv_freq.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();

  int64_t length = 0;
  while (true) {
    // Sample each live row's token from its logits (row i of next_logits is live[i]); rows in parallel
    // when the vocabulary makes a row's draw worth a thread.
    const float* lg = next_logits.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(live.size()), std::max<int64_t>(1, 8192 / vocab),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> scaled(vocab);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = live[i];
        const uint64_t counter = greedy ? 0 : static_cast<uint64_t>(key[r]) + static_cast<uint64_t>(length);
        const Sampled s = sample_row(lg + i * vocab, vocab, greedy, temp, counter, scaled);
        tok[r * steps + length] = s.token;
        lp[r * steps + length] = s.log_prob;
        msk[r * steps + length] = 1;
      }
    });
    std::vector<int64_t> still;
    for (const int64_t r : live) {
      const int64_t t = tok[r * steps + length];
      if (std::find(stops.begin(), stops.end(), t) == stops.end()) {
        still.push_back(r);
        next_token[r] = t;
      }
    }
    ++length;
    live.swap(still);
    const int64_t n = static_cast<int64_t>(live.size());
    if (length == steps || n == 0) break;

    // One decode step for the live rows: their tokens into slot `slot` of the cache.
    const int64_t slot = filled + length - 1;
    float* xp = x.data_ptr<float>();
    const float* emb = embed.data_ptr<float>();
    float* cs = cos_t.data_ptr<float>();
    float* sn = sin_t.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = live[i];
      std::copy(emb + next_token[r] * hidden, emb + (next_token[r] + 1) * hidden, xp + i * hidden);
      kmask[r * capacity + slot] = true;
      const float pos = static_cast<float>(seen_p[r]++);
      for (int64_t j = 0; j < half; ++j) {
        const float f = pos * inv[j];
        cs[i * hd + j] = cs[i * hd + j + half] = std::cos(f);
        sn[i * hd + j] = sn[i * hd + j + half] = std::sin(f);
      }
    }
    at::Tensor xs = x.narrow(0, 0, n), hs = h.narrow(0, 0, n), qs = qkv.narrow(0, 0, n);
    at::Tensor as = attn.narrow(0, 0, n), f1 = fc1.narrow(0, 0, n), ac = act.narrow(0, 0, n);
    at::Tensor ds = delta.narrow(0, 0, n);
    for (int64_t layer = 0; layer < layers; ++layer) {
      const at::Tensor* w = &weights[layer * kPerLayer];
      rms_norm(xp, w[0].data_ptr<float>(), hs.data_ptr<float>(), n, hidden, eps);
      if (w[2].defined() && w[2].numel())
        at::addmm_out(qs, w[2], hs, w[1].t());
      else
        at::mm_out(qs, hs, w[1].t());
      float* q = qs.data_ptr<float>();
      float* out = as.data_ptr<float>();
      const int64_t layer_off = layer * rows * groups * capacity * hd;
      // Each (row, KV group) is hpg queries over slot + 1 keys: split over threads only when that is real work.
      const int64_t work = hpg * (slot + 1) * hd * 4;
      at::parallel_for(0, n * groups, std::max<int64_t>(1, 65536 / work), [&](int64_t begin, int64_t end) {
        std::vector<float> score(slot + 1);
        for (int64_t ig = begin; ig < end; ++ig) {
          const int64_t i = ig / groups, g = ig % groups, r = live[i];
          float* grp = q + i * groups * per_group + g * per_group;  // [q_0 .. q_{hpg-1}, k, v]
          for (int64_t j = 0; j <= hpg; ++j) {
            hybridflow_cpu::rope_row(grp + j * hd, grp + j * hd, cs + i * hd, sn + i * hd, half);
          }
          const int64_t base = layer_off + (r * groups + g) * capacity * hd;
          std::copy(grp + hpg * hd, grp + (hpg + 1) * hd, kc + base + slot * hd);
          std::copy(grp + (hpg + 1) * hd, grp + (hpg + 2) * hd, vc + base + slot * hd);
          const bool* km = kmask + r * capacity;
          for (int64_t j = 0; j < hpg; ++j) {
            const float* qh = grp + j * hd;
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t s = 0; s <= slot; ++s) {
              if (!km[s]) continue;
              const float* kh = kc + base + s * hd;
              float dot = 0.f;
              for (int64_t d = 0; d < hd; ++d) dot += qh[d] * kh[d];
              score[s] = dot * scale;
              mx = std::max(mx, score[s]);
            }
            float* o = out + i * heads * hd + (g * hpg + j) * hd;
            std::fill(o, o + hd, 0.f);
            float sum = 0.f;
            for (int64_t s = 0; s <= slot; ++s) {
              if (!km[s]) continue;
              const float p = std::exp(score[s] - mx);
              sum += p;
              const float* vh = vc + base + s * hd;
              for (int64_t d = 0; d < hd; ++d) o[d] += p * vh[d];
            }
            for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
          }
        }
      });
      at::mm_out(ds, as, w[3].t());
      xs.add_(ds);
      rms_norm(xp, w[4].data_ptr<float>(), hs.data_ptr<float>(), n, hidden, eps);
      at::mm_out(f1, hs, w[5].t());
      const float* gu = f1.data_ptr<float>();
      float* a = ac.data_ptr<float>();
      at::parallel_for(0, n, std::max<int64_t>(1, 16384 / (2 * inter)), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) hybridflow_cpu::swiglu_row(gu + i * 2 * inter, a + i * inter, inter);
      });
      at::mm_out(ds, ac, w[6].t());
      xs.add_(ds);
    }
    rms_norm(xp, final_norm.data_ptr<float>(), hs.data_ptr<float>(), n, hidden, eps);
    at::Tensor ls = next_logits.narrow(0, 0, n);
    at::mm_out(ls, hs, output.narrow(0, 0, vocab).t());
  }
  return {tokens, log_probs, mask, at::scalar_tensor(length, at::kLong)};
}
