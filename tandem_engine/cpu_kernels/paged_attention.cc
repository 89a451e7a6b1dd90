// Paged decode attention for XLA's CPU backend, read where the blocks lie (tandem_engine/cpu_kernels).
//
// What paged.paged_attention computes with XLA ops (gather each row's blocks, then two dots and an
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
// mask as the XLA path. A table entry outside the pool is clamped into it (as jnp.take's "clip").
// One thread: the decode pod's XLA pool is one thread by default (cpu_pool.py); rows are
// independent, so a threaded version would split them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// One (row, KV head): `groups` query heads over the row's positions [lo, hi].
// HD: the head dim when it is one of the common ones (the loops over it then unroll and keep a
// query head's accumulator in registers), 0 for any other (read from head_dim).
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

template <typename QT, typename KT>
void run(const QT* q, const KT* k, const KT* v, const int32_t* table, const int32_t* positions, const int32_t* lengths,
         const float* sinks, float* out, int64_t rows, int64_t heads, int64_t kvh, int64_t blocks, int64_t bs,
         int64_t hd, int64_t nb, float scale, float softcap, int64_t window, bool has_sinks) {
  const int64_t groups = heads / kvh;
  std::vector<float> qs(groups * hd), scores(groups * bs), kbuf(bs * hd), vbuf(bs * hd);
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
      switch (hd) {
        case 64:
          attend<KT, 64>(qs.data(), groups, hd, k_head, v_head, tr, nb, bs, blocks, lo, hi, softcap, sink, o,
                         scores.data(), kbuf.data(), vbuf.data());
          break;
        case 128:
          attend<KT, 128>(qs.data(), groups, hd, k_head, v_head, tr, nb, bs, blocks, lo, hi, softcap, sink, o,
                          scores.data(), kbuf.data(), vbuf.data());
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
