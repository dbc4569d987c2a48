// The built-in rollout on the CPU in two calls: the prefill of a batch's
// prompts (every real token in one pass per layer), then every decode step
// after it, with keyed (or greedy) sampling. Both run the same layer code
// (run_layers) over token rows that each name their cache row and slot.
//
// The Python loop (hybridflow/rollout/generator.py) runs ~100 small torch ops
// per step (the layers, the sampler, the bookkeeping), and for a small model
// or a small batch their dispatch costs more than their arithmetic. Here the
// matmuls stay ATen's (MKL/oneDNN GEMMs, into buffers allocated once) and
// everything between them is a plain loop over the token rows: RMSNorm, RoPE,
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

// The model's shapes, weights and KV cache, as the decode loop and the prefill read them.
struct Model {
  const std::vector<at::Tensor>& w;
  int64_t layers, rows, groups, capacity, hd, half, hpg, heads, per_group, hidden, inter;
  double eps;
  float scale;
  float* kc;
  float* vc;
  bool* kmask;
  int64_t* seen;
  const float* inv;

  Model(const std::vector<at::Tensor>& weights, at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& key_mask,
        at::Tensor& seen_t, const at::Tensor& inv_freq, int64_t heads_per_group, double eps_)
      : w(weights), eps(eps_) {
    TORCH_CHECK(k_cache.dtype() == at::kFloat, "the C++ decode loop runs float32 models");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && key_mask.is_contiguous() && seen_t.is_contiguous(),
                "the C++ decode loop needs the cache's own contiguous tensors");
    layers = k_cache.size(0), rows = k_cache.size(1), groups = k_cache.size(2);
    capacity = k_cache.size(3), hd = k_cache.size(4), half = hd / 2;
    hpg = heads_per_group, heads = groups * hpg, per_group = (hpg + 2) * hd;
    TORCH_CHECK(static_cast<int64_t>(w.size()) == layers * kPerLayer + 3, "the C++ decode loop: weights per layer");
    hidden = embed().size(1), inter = w[5].size(0) / 2;
    scale = 1.0f / std::sqrt(static_cast<float>(hd));
    kc = k_cache.data_ptr<float>(), vc = v_cache.data_ptr<float>();
    kmask = key_mask.data_ptr<bool>(), seen = seen_t.data_ptr<int64_t>(), inv = inv_freq.data_ptr<float>();
  }
  const at::Tensor& embed() const { return w[layers * kPerLayer]; }
  const at::Tensor& final_norm() const { return w[layers * kPerLayer + 1]; }
  const at::Tensor& output() const { return w[layers * kPerLayer + 2]; }
};

// Activations for up to `cap` token rows, allocated once per call.
struct Scratch {
  at::Tensor x, h, qkv, attn, fc1, act, delta, cos, sin;
  Scratch(const Model& m, int64_t cap, const at::TensorOptions& o)
      : x(at::empty({cap, m.hidden}, o)), h(at::empty({cap, m.hidden}, o)),
        qkv(at::empty({cap, m.groups * m.per_group}, o)), attn(at::empty({cap, m.heads * m.hd}, o)),
        fc1(at::empty({cap, 2 * m.inter}, o)), act(at::empty({cap, m.inter}, o)),
        delta(at::empty({cap, m.hidden}, o)), cos(at::empty({cap, m.hd}, o)), sin(at::empty({cap, m.hd}, o)) {}
};

// Token row i: its embedding into x, the rope angles of its position (the cache row's next one), and the
// cache rows crow .. crow + rep - 1 (one prompt's samples) count the token and may attend to its slot.
void place_token(const Model& m, Scratch& s, int64_t i, int64_t token, int64_t crow, int64_t rep, int64_t slot) {
  const float* emb = m.embed().data_ptr<float>();
  std::copy(emb + token * m.hidden, emb + (token + 1) * m.hidden, s.x.data_ptr<float>() + i * m.hidden);
  const float pos = static_cast<float>(m.seen[crow]);
  for (int64_t c = 0; c < rep; ++c) {
    m.kmask[(crow + c) * m.capacity + slot] = true;
    ++m.seen[crow + c];
  }
  float* cs = s.cos.data_ptr<float>() + i * m.hd;
  float* sn = s.sin.data_ptr<float>() + i * m.hd;
  for (int64_t j = 0; j < m.half; ++j) {
    const float f = pos * m.inv[j];
    cs[j] = cs[j + m.half] = std::cos(f);
    sn[j] = sn[j + m.half] = std::sin(f);
  }
}

// The decoder's layers for n token rows placed by place_token: row i is a token of cache row crow[i] at
// slot slot[i]; its key and value are written to cache rows crow[i] .. crow[i] + rep - 1, and it attends
// to crow[i]'s slots up to its own whose key mask is set. All rows' keys and values of a layer are written
// before any row attends, so a prompt's tokens can run together. x [n, hidden] becomes the last layer's output.
void run_layers(const Model& m, Scratch& s, int64_t n, const int64_t* crow, const int64_t* slot, int64_t rep) {
  at::Tensor xs = s.x.narrow(0, 0, n), hs = s.h.narrow(0, 0, n), qs = s.qkv.narrow(0, 0, n);
  at::Tensor as = s.attn.narrow(0, 0, n), f1 = s.fc1.narrow(0, 0, n), ac = s.act.narrow(0, 0, n);
  at::Tensor ds = s.delta.narrow(0, 0, n);
  float* xp = xs.data_ptr<float>();
  const float* cs = s.cos.data_ptr<float>();
  const float* sn = s.sin.data_ptr<float>();
  const int64_t groups = m.groups, hd = m.hd, hpg = m.hpg, per_group = m.per_group, capacity = m.capacity;
  const int64_t last = *std::max_element(slot, slot + n);
  for (int64_t layer = 0; layer < m.layers; ++layer) {
    const at::Tensor* w = &m.w[layer * kPerLayer];
    rms_norm(xp, w[0].data_ptr<float>(), hs.data_ptr<float>(), n, m.hidden, m.eps);
    if (w[2].defined() && w[2].numel())
      at::addmm_out(qs, w[2], hs, w[1].t());
    else
      at::mm_out(qs, hs, w[1].t());
    float* q = qs.data_ptr<float>();
    float* out = as.data_ptr<float>();
    const int64_t layer_off = layer * m.rows * groups * capacity * hd;
    at::parallel_for(0, n * groups, std::max<int64_t>(1, 16384 / (rep * per_group)), [&](int64_t begin, int64_t end) {
      for (int64_t ig = begin; ig < end; ++ig) {
        const int64_t i = ig / groups, g = ig % groups;
        float* grp = q + i * groups * per_group + g * per_group;  // [q_0 .. q_{hpg-1}, k, v]
        for (int64_t j = 0; j <= hpg; ++j) hybridflow_cpu::rope_row(grp + j * hd, grp + j * hd, cs + i * hd, sn + i * hd, m.half);
        for (int64_t c = 0; c < rep; ++c) {
          const int64_t base = layer_off + ((crow[i] + c) * groups + g) * capacity * hd + slot[i] * hd;
          std::copy(grp + hpg * hd, grp + (hpg + 1) * hd, m.kc + base);
          std::copy(grp + (hpg + 1) * hd, grp + (hpg + 2) * hd, m.vc + base);
        }
      }
    });
    // Each (row, KV group) is hpg queries over up to last + 1 keys: split over threads only when that is real work.
    const int64_t work = hpg * (last + 1) * hd * 4;
    at::parallel_for(0, n * groups, std::max<int64_t>(1, 65536 / work), [&](int64_t begin, int64_t end) {
      std::vector<float> score(last + 1);
      for (int64_t ig = begin; ig < end; ++ig) {
        const int64_t i = ig / groups, g = ig % groups, r = crow[i], top = slot[i];
        const float* grp = q + i * groups * per_group + g * per_group;
        const int64_t base = layer_off + (r * groups + g) * capacity * hd;
        const bool* km = m.kmask + r * capacity;
        for (int64_t j = 0; j < hpg; ++j) {
          const float* qh = grp + j * hd;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t <= top; ++t) {
            if (!km[t]) continue;
            const float* kh = m.kc + base + t * hd;
            float dot = 0.f;
            for (int64_t d = 0; d < hd; ++d) dot += qh[d] * kh[d];
            score[t] = dot * m.scale;
            mx = std::max(mx, score[t]);
          }
          float* o = out + i * m.heads * hd + (g * hpg + j) * hd;
          std::fill(o, o + hd, 0.f);
          float sum = 0.f;
          for (int64_t t = 0; t <= top; ++t) {
            if (!km[t]) continue;
            const float p = std::exp(score[t] - mx);
            sum += p;
            const float* vh = m.vc + base + t * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] += p * vh[d];
          }
          for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
        }
      }
    });
    at::mm_out(ds, as, w[3].t());
    xs.add_(ds);
    rms_norm(xp, w[4].data_ptr<float>(), hs.data_ptr<float>(), n, m.hidden, m.eps);
    at::mm_out(f1, hs, w[5].t());
    const float* gu = f1.data_ptr<float>();
    float* a = ac.data_ptr<float>();
    const int64_t inter = m.inter;
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / (2 * inter)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) hybridflow_cpu::swiglu_row(gu + i * 2 * inter, a + i * inter, inter);
    });
    at::mm_out(ds, ac, w[6].t());
    xs.add_(ds);
  }
}

// Logits [n, V] of the first n rows of x into out [n, V]: the output layer's first V rows (the decode loop's
// logits have the vocabulary the prefill's had).
void output_logits(const Model& m, Scratch& s, int64_t n, at::Tensor out) {
  rms_norm(s.x.data_ptr<float>(), m.final_norm().data_ptr<float>(), s.h.data_ptr<float>(), n, m.hidden, m.eps);
  at::mm_out(out, s.h.narrow(0, 0, n), m.output().narrow(0, 0, out.size(1)).t());
}

}  // namespace

// The prefill of a generation call into an empty KV cache: prompts ids [b, T] (left-padded; mask [b, T],
// 1 on real tokens, the last column all real), each filling cache rows i*rep .. i*rep + rep - 1 (its rep
// samples), as Decoder.forward_cached does on a first append. Every real token of every prompt runs in one
// pass per layer; padding is not computed (its slots stay masked). Returns the logits [b, vocab] after each
// prompt's last token. The caller sets the cache's write positions (start 0, length T).
at::Tensor prefill(at::Tensor ids, at::Tensor mask, int64_t rep, std::vector<at::Tensor> weights, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor key_mask, at::Tensor seen, at::Tensor inv_freq,
                   int64_t heads_per_group, double eps) {
  Model m(weights, k_cache, v_cache, key_mask, seen, inv_freq, heads_per_group, eps);
  ids = ids.contiguous(), mask = mask.to(at::kBool).contiguous();
  const int64_t b = ids.size(0), t = ids.size(1);
  TORCH_CHECK(b * rep == m.rows && t <= m.capacity, "prefill: ", b, " prompts x ", rep, " rows of ", t,
              " tokens do not fit a cache of ", m.rows, " rows and ", m.capacity, " slots");
  const int64_t* tok = ids.data_ptr<int64_t>();
  const bool* real = mask.data_ptr<bool>();
  std::vector<int64_t> crow, slot, last(b);
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(real[r * t + t - 1], "prefill: prompt ", r, " does not end in a real token (left padding only)");
    for (int64_t p = 0; p < t; ++p) {
      if (!real[r * t + p]) continue;
      crow.push_back(r * rep);
      slot.push_back(p);
    }
    last[r] = static_cast<int64_t>(slot.size()) - 1;
  }
  const int64_t n = static_cast<int64_t>(crow.size());
  Scratch s(m, n, k_cache.options());
  for (int64_t i = 0; i < n; ++i) place_token(m, s, i, tok[(crow[i] / rep) * t + slot[i]], crow[i], rep, slot[i]);
  run_layers(m, s, n, crow.data(), slot.data(), rep);
  // Each prompt's last token row to row r of x (last[r] >= r, so no row is overwritten before it is read).
  float* xp = s.x.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r)
    if (last[r] != r) std::copy(xp + last[r] * m.hidden, xp + (last[r] + 1) * m.hidden, xp + r * m.hidden);
  at::Tensor logits = at::empty({b, m.output().size(0)}, k_cache.options());
  output_logits(m, s, b, logits);
  return logits;
}

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
  TORCH_CHECK(logits.dtype() == at::kFloat, "decode_loop runs float32 models");
  Model m(weights, k_cache, v_cache, key_mask, seen, inv_freq, heads_per_group, eps);
  const int64_t rows = m.rows, vocab = logits.size(1);
  TORCH_CHECK(filled + steps - 1 <= m.capacity, "decode_loop: the cache cannot hold ", steps, " more tokens");
  const float temp = static_cast<float>(temperature);

  at::Tensor tokens = at::full({rows, steps}, pad_id, at::kLong);
  at::Tensor log_probs = at::zeros({rows, steps}, at::kFloat);
  at::Tensor mask = at::zeros({rows, steps}, at::kLong);
  Scratch s(m, rows, logits.options());
  at::Tensor next_logits = logits.contiguous().clone();

  std::vector<int64_t> live(rows);
  for (int64_t r = 0; r < rows; ++r) live[r] = r;
  std::vector<int64_t> stops(stop_ids.data_ptr<int64_t>(), stop_ids.data_ptr<int64_t>() + stop_ids.numel());
  std::vector<int64_t> next_token(rows), slots;
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = log_probs.data_ptr<float>();
  int64_t* msk = mask.data_ptr<int64_t>();
  const int64_t* key = greedy ? nullptr : keys.data_ptr<int64_t>();

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
        const Sampled sm = sample_row(lg + i * vocab, vocab, greedy, temp, counter, scaled);
        tok[r * steps + length] = sm.token;
        lp[r * steps + length] = sm.log_prob;
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
    slots.assign(n, slot);
    for (int64_t i = 0; i < n; ++i) place_token(m, s, i, next_token[live[i]], live[i], 1, slot);
    run_layers(m, s, n, live.data(), slots.data(), 1);
    output_logits(m, s, n, next_logits.narrow(0, 0, n));
  }
  return {tokens, log_probs, mask, at::scalar_tensor(length, at::kLong)};
}
