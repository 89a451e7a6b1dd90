// Paged decode attention for XLA's CPU backend, read where the blocks lie (tandem_engine/cpu_kernels).
//
// What attention.paged_attention computes with XLA ops (gather each row's blocks, then two dots and an
// online softmax), without the gather: for every row in use and every KV head, the row's positions
// are read block by block through its block table, straight out of the layer's pool buffer, and
// folded into an online softmax in float32. XLA CPU cannot do this itself: a gather (or a
// dynamic_slice) copies what it reads before a dot reads it again.
//
// Buffers (as paged.py holds them):
//   q          [rows, H, hd]            float32 or bfloat16 (H = groups * KV; query head h reads KV head h / groups)
//   k, v       [KV, blocks, B, hd]      float32 or bfloat16 (one layer of the pool)
//   table      int32 [rows, nb]         row r's positions [j*B, (j+1)*B) sit in block table[r, j]
//   positions  int32 [rows]             the row's newest position (its K/V already written)
//   lengths    int32 [rows]             positions the row may read (<= nb * B); 0: a free row (zeros out)
//   sinks      float32 [H]              one extra logit per head with no value (read when has_sinks)
//   out        float32 [rows, H, hd]
// Attributes: scale (the query scale), softcap (0: none; else tanh(s / cap) * cap after the scale),
// window (0: none; else only positions > position - window), has_sinks.
//
// Positions read by row r: [max(0, position - window + 1), min(position, length - 1)], the same
// mask as the XLA path. Head dims of 64, 80, 96, 128 and 256 (attend2) take two passes over a row's
// blocks: every score (8 positions at a time, each with its own accumulator, the 8 sums reduced
// together), one softmax over the span, then the values into accumulators held in registers
// (1.5-1.7x the one-pass online softmax's speed at batch 8 and 32 here, CPU time with the blocks
// in cache); other head dims take the one pass (attend). A table entry outside the pool is clamped into it (as jnp.take's "clip").
// One thread: the decode pod's XLA pool is one thread by default (cpu_pool.py); rows are
// independent, so a threaded version would split them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A masked score, as the XLA path's: finite (the kernel is built with -ffast-math, which assumes no infinities).
constexpr float kNeg = -1e30f;

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// GCC/Clang vector extensions: 8 floats, lowered to whatever the -march level has (one AVX register,
// two SSE ones), so the kernel still builds for any x86-64 level.
typedef float v8f __attribute__((vector_size(32)));

inline v8f loadu8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storeu8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// r[i] = the sum of a[i]'s lanes, for 8 vectors at once (a transposing add tree: 14 shuffles and
// 7 adds where 8 separate horizontal sums take about 48 operations).
inline v8f hsum8(const v8f* a) {
  v8f p0 = __builtin_shufflevector(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f p1 = __builtin_shufflevector(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f p2 = __builtin_shufflevector(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f p3 = __builtin_shufflevector(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f e0 = __builtin_shufflevector(p0, p1, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(p0, p1, 2, 3, 10, 11, 6, 7, 14, 15);
  v8f e1 = __builtin_shufflevector(p2, p3, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(p2, p3, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(e0, e1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(e0, e1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of query head q over positions k[0, n) (rows of HD floats): 8 positions at a time, each
// with its own accumulator (independent chains), the 8 sums reduced together.
template <int64_t HD>
inline void scores_v(const float* q, const float* k, int64_t n, float* s) {
  constexpr int64_t NV = HD / 8;
  v8f qv[NV];
  for (int64_t i = 0; i < NV; ++i) qv[i] = loadu8(q + 8 * i);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    v8f acc[8] = {};
    for (int64_t i = 0; i < NV; ++i)
      for (int64_t u = 0; u < 8; ++u) acc[u] += qv[i] * loadu8(k + (t + u) * HD + 8 * i);
    storeu8(s + t, hsum8(acc));
  }
  for (; t < n; ++t) {
    v8f acc = {};
    for (int64_t i = 0; i < NV; ++i) acc += qv[i] * loadu8(k + t * HD + 8 * i);
    float x = 0.0f;
    for (int u = 0; u < 8; ++u) x += acc[u];
    s[t] = x;
  }
}

// o = o * alpha + sum_t p[t] * v[t] for rows v[0, n) of HD floats, o held in registers.
template <int64_t HD>
inline void pv_v(const float* p, const float* v, int64_t n, float alpha, float* o) {
  constexpr int64_t NV = HD / 8;
  v8f acc[NV];
  for (int64_t i = 0; i < NV; ++i) acc[i] = loadu8(o + 8 * i) * alpha;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    for (int64_t i = 0; i < NV; ++i) acc[i] += pt * loadu8(v + t * HD + 8 * i);
  }
  for (int64_t i = 0; i < NV; ++i) storeu8(o + 8 * i, acc[i]);
}

// One (row, KV head): `groups` query heads over the row's positions [lo, hi], block by block in
// one pass (an online softmax): the head dims that are not whole 8-float vectors (attend2 serves
// the others). HD: 0 (read from head_dim).
template <typename KT, int64_t HD>
void attend(const float* qs, int64_t groups, int64_t head_dim, const KT* k_head, const KT* v_head, const int32_t* table_row,
            int64_t nb, int64_t bs, int64_t blocks, int64_t lo, int64_t hi, float softcap, const float* sink,
            float* out, float* scores, float* kbuf, float* vbuf) {
  const int64_t hd = HD ? HD : head_dim;
  float m[64], denom[64];  // groups <= 64 (checked by the caller)
  for (int64_t g = 0; g < groups; ++g) {
    m[g] = sink ? sink[g] : kNeg;
    denom[g] = sink ? 1.0f : 0.0f;
  }
  std::fill(out, out + groups * hd, 0.0f);
  for (int64_t j = lo / bs; j <= hi / bs && j < nb; ++j) {
    int64_t block = std::clamp<int64_t>(table_row[j], 0, blocks - 1);
    if (j + 1 < nb && (j + 1) * bs <= hi) {  // the next block's K and V, fetched while this one is read
      int64_t next = std::clamp<int64_t>(table_row[j + 1], 0, blocks - 1);
      const char* kn = reinterpret_cast<const char*>(k_head + next * bs * hd);
      const char* vn = reinterpret_cast<const char*>(v_head + next * bs * hd);
      for (int64_t off = 0; off < static_cast<int64_t>(bs * hd * sizeof(KT)); off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    int64_t first = std::max(lo, j * bs), last = std::min(hi, j * bs + bs - 1);
    int64_t n = last - first + 1;
    const KT* kb = k_head + (block * bs + (first - j * bs)) * hd;
    const KT* vb = v_head + (block * bs + (first - j * bs)) * hd;
    const float* kf;
    const float* vf;
    if constexpr (std::is_same_v<KT, float>) {
      kf = kb;
      vf = vb;
    } else {
      for (int64_t i = 0; i < n * hd; ++i) kbuf[i] = load(kb, i);
      for (int64_t i = 0; i < n * hd; ++i) vbuf[i] = load(vb, i);
      kf = kbuf;
      vf = vbuf;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = qs + g * hd;
      float* sg = scores + g * bs;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kf + t * hd;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hd; ++d) s += qg[d] * kt[d];
        sg[t] = s;
      }
      if (softcap > 0.0f)
        for (int64_t t = 0; t < n; ++t) sg[t] = std::tanh(sg[t] / softcap) * softcap;
      float best = m[g];
      for (int64_t t = 0; t < n; ++t) best = std::max(best, sg[t]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - best);
        sum += sg[t];
      }
      float alpha = std::exp(m[g] - best);  // m[g] = kNeg the first time: alpha 0, nothing to rescale
      float* og = out + g * hd;
      if (alpha != 1.0f) {
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) og[d] *= alpha;
      }
      for (int64_t t = 0; t < n; ++t) {
        const float p = sg[t];
        const float* vt = vf + t * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) og[d] += p * vt[d];
      }
      denom[g] = denom[g] * alpha + sum;
      m[g] = best;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 0.0f;
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] *= inv;
  }
}

// The next block's first lines (the hardware prefetcher follows a block once it is being read).
template <typename KT>
inline void prefetch_block(const KT* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 1024) __builtin_prefetch(c + off);
}

// attend() in two passes for head dims of whole 8-float vectors: every position's score first
// (`scores`: groups * (hi - lo + 1) floats), one softmax over them, then the values: no per-block
// rescaling, and the exps, maxima and sums run over the whole span at once.
template <typename KT, int64_t HD>
void attend2(const float* qs, int64_t groups, const KT* k_head, const KT* v_head, const int32_t* table_row,
             int64_t nb, int64_t bs, int64_t blocks, int64_t lo, int64_t hi, float softcap, const float* sink,
             float* out, float* scores, float* buf) {
  const int64_t span = hi - lo + 1, jlo = lo / bs, jhi = std::min(hi / bs, nb - 1);
  // f(first, n, rows): every block's positions [first, first + n) of `head` in [lo, hi], as float rows
  auto each_block = [&](const KT* head, auto f) {
    for (int64_t j = jlo; j <= jhi; ++j) {
      if (j < jhi)
        prefetch_block(head + std::clamp<int64_t>(table_row[j + 1], 0, blocks - 1) * bs * HD,
                       bs * HD * static_cast<int64_t>(sizeof(KT)));
      int64_t first = std::max(lo, j * bs), n = std::min(hi, j * bs + bs - 1) - first + 1;
      const KT* rows = head + (std::clamp<int64_t>(table_row[j], 0, blocks - 1) * bs + (first - j * bs)) * HD;
      if constexpr (std::is_same_v<KT, float>) {
        f(first, n, rows);
      } else {
        for (int64_t i = 0; i < n * HD; ++i) buf[i] = load(rows, i);
        f(first, n, static_cast<const float*>(buf));
      }
    }
  };
  each_block(k_head, [&](int64_t first, int64_t n, const float* k) {  // pass 1: scores
    for (int64_t g = 0; g < groups; ++g) scores_v<HD>(qs + g * HD, k, n, scores + g * span + (first - lo));
  });
  float inv[64];
  for (int64_t g = 0; g < groups; ++g) {  // one softmax per query head
    float* sg = scores + g * span;
    if (softcap > 0.0f)
      for (int64_t t = 0; t < span; ++t) sg[t] = std::tanh(sg[t] / softcap) * softcap;
    float best = sink ? sink[g] : kNeg;
    for (int64_t t = 0; t < span; ++t) best = std::max(best, sg[t]);
    float sum = sink ? std::exp(sink[g] - best) : 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < span; ++t) {
      sg[t] = std::exp(sg[t] - best);
      sum += sg[t];
    }
    inv[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  std::fill(out, out + groups * HD, 0.0f);
  each_block(v_head, [&](int64_t first, int64_t n, const float* v) {  // pass 2: values
    for (int64_t g = 0; g < groups; ++g) pv_v<HD>(scores + g * span + (first - lo), v, n, 1.0f, out + g * HD);
  });
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < HD; ++d) out[g * HD + d] *= inv[g];
}

template <typename QT, typename KT>
void run(const QT* q, const KT* k, const KT* v, const int32_t* table, const int32_t* positions, const int32_t* lengths,
         const float* sinks, float* out, int64_t rows, int64_t heads, int64_t kvh, int64_t blocks, int64_t bs,
         int64_t hd, int64_t nb, float scale, float softcap, int64_t window, bool has_sinks) {
  const int64_t groups = heads / kvh;
  std::vector<float> qs(groups * hd), kbuf(bs * hd), vbuf(bs * hd);
  // every position's score of a row's KV head (attend2): kept between calls, so a long context's
  // buffer is allocated (and its pages touched) once per thread, not per layer and step
  thread_local std::vector<float> scores;
  if (scores.size() < static_cast<size_t>(groups * std::max(bs, nb * bs))) scores.resize(groups * std::max(bs, nb * bs));
  for (int64_t r = 0; r < rows; ++r) {
    int64_t length = lengths[r];
    float* out_row = out + r * heads * hd;
    if (length <= 0) {
      std::fill(out_row, out_row + heads * hd, 0.0f);
      continue;
    }
    int64_t hi = std::min<int64_t>(positions[r], length - 1);
    int64_t lo = window > 0 ? std::max<int64_t>(0, positions[r] - window + 1) : 0;
    if (hi < lo) {
      std::fill(out_row, out_row + heads * hd, 0.0f);
      continue;
    }
    for (int64_t kh = 0; kh < kvh; ++kh) {
      for (int64_t i = 0; i < groups * hd; ++i) qs[i] = load(q, (r * heads + kh * groups) * hd + i) * scale;
      const KT* k_head = k + kh * blocks * bs * hd;
      const KT* v_head = v + kh * blocks * bs * hd;
      const float* sink = has_sinks ? sinks + kh * groups : nullptr;
      float* o = out_row + kh * groups * hd;
      const int32_t* tr = table + r * nb;
      auto two_pass = [&](auto dim) {  // attend2 at a head dim known when compiled
        attend2<KT, decltype(dim)::value>(qs.data(), groups, k_head, v_head, tr, nb, bs, blocks, lo, hi, softcap, sink,
                                          o, scores.data(), kbuf.data());
      };
      switch (hd) {
        case 64:
          two_pass(std::integral_constant<int64_t, 64>{});
          break;
        case 80:
          two_pass(std::integral_constant<int64_t, 80>{});
          break;
        case 96:
          two_pass(std::integral_constant<int64_t, 96>{});
          break;
        case 128:
          two_pass(std::integral_constant<int64_t, 128>{});
          break;
        case 256:
          two_pass(std::integral_constant<int64_t, 256>{});
          break;
        default:
          attend<KT, 0>(qs.data(), groups, hd, k_head, v_head, tr, nb, bs, blocks, lo, hi, softcap, sink, o,
                        scores.data(), kbuf.data(), vbuf.data());
      }
    }
  }
}

ffi::Error PagedAttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float scale,
                              float softcap, int64_t window, int64_t has_sinks) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q [rows, H, hd], k/v [KV, blocks, B, hd], table [rows, nb]");
  int64_t rows = qd[0], heads = qd[1], hd = qd[2], kvh = kd[0], blocks = kd[1], bs = kd[2], nb = td[1];
  if (kd[3] != hd || td[0] != rows || heads % kvh != 0 || heads / kvh > 64 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("paged attention: shapes or element types do not agree");
  bool sink = has_sinks != 0;
  const int32_t* t = table.typed_data();
  const int32_t* p = positions.typed_data();
  const int32_t* n = lengths.typed_data();
  const float* s = sinks.typed_data();
  float* o = out->typed_data();
  auto qt = q.element_type(), kt = k.element_type();
  using DT = ffi::DataType;
  if (qt == DT::F32 && kt == DT::F32) {
    run(static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
        static_cast<const float*>(v.untyped_data()), t, p, n, s, o, rows, heads, kvh, blocks, bs, hd, nb, scale, softcap,
        window, sink);
  } else if (qt == DT::BF16 && kt == DT::BF16) {
    run(static_cast<const uint16_t*>(q.untyped_data()), static_cast<const uint16_t*>(k.untyped_data()),
        static_cast<const uint16_t*>(v.untyped_data()), t, p, n, s, o, rows, heads, kvh, blocks, bs, hd, nb, scale,
        softcap, window, sink);
  } else if (qt == DT::F32 && kt == DT::BF16) {
    run(static_cast<const float*>(q.untyped_data()), static_cast<const uint16_t*>(k.untyped_data()),
        static_cast<const uint16_t*>(v.untyped_data()), t, p, n, s, o, rows, heads, kvh, blocks, bs, hd, nb, scale,
        softcap, window, sink);
  } else {
    return ffi::Error::InvalidArgument("paged attention: q and the pool must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TandemPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("has_sinks"));
