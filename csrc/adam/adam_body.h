// The Adam kernel body, written once over a SIMD vocabulary struct `V` (csrc/includes/simd.h).
//
// NO include guard, on purpose: cpu_adam.cpp includes this file once per instruction set, each
// time inside a `#pragma GCC target` region and a namespace that defines `using V = ...;`, so
// the same body is compiled for AVX-512, AVX2 and scalar code. It includes nothing itself.

template <class O>
static inline void store_out(O* out, typename V::vf p) {
  if constexpr (!std::is_same_v<O, simd::no_out_t>) V::store(out, p);
}

// One vector of W elements, indices idx .. idx + W - 1 of their tensor (see Hyper in cpu_adam.h for
// the formula). M is the moments' storage type: float, or bf16_t, which is read exactly and
// written with stochastic rounding from the element's random bits (simd.h): the low 16 bits for
// exp_avg, the high 16 for exp_avg_sq.
template <class G, class O, class M>
static inline void adam_vec(float* p, const G* g, M* m, M* v, O* out, const Hyper& h, uint32_t idx, uint32_t key) {
  using vf = typename V::vf;
  vf gv = V::load(g);
  if (h.divide_grad) gv = V::div(gv, V::set1(h.grad_scale));
  vf pv = V::load(p);
  if (h.use_decay) pv = V::mul(pv, V::set1(h.decay));
  if (h.use_l2) gv = V::add(gv, V::mul(pv, V::set1(h.l2)));
  const vf mv = V::add(V::mul(V::load(m), V::set1(h.beta1)), V::mul(gv, V::set1(h.one_minus_beta1)));
  const vf vv = V::add(V::mul(V::load(v), V::set1(h.beta2)),
                       V::mul(V::mul(gv, V::set1(h.one_minus_beta2)), gv));
  const vf den = V::add(V::mul(V::sqrt(vv), V::set1(h.inv_bc2_sqrt)), V::set1(h.eps));
  pv = V::sub(pv, V::mul(V::set1(h.step_size), V::div(mv, den)));
  if constexpr (std::is_same_v<M, simd::bf16_t>) {
    const typename V::vi r = V::hash_index(idx, key);
    V::store_sr(m, mv, V::lo16(r));
    V::store_sr(v, vv, V::hi16(r));
  } else {
    V::store(m, mv);
    V::store(v, vv);
  }
  V::store(p, pv);
  store_out(out, pv);
}

// Stochastic rounding alone, as adam_vec rounds exp_avg: W elements, indices idx .. idx + W - 1.
static inline void round_sr_vec(const float* src, simd::bf16_t* dst, uint32_t idx, uint32_t key) {
  V::store_sr(dst, V::load(src), V::lo16(V::hash_index(idx, key)));
}

// The roof: same loads and stores as adam_vec, one add per stream.
template <class G, class O, class M>
static inline void roof_vec(float* p, const G* g, M* m, M* v, O* out, const Hyper&, uint32_t, uint32_t) {
  const typename V::vf gv = V::load(g);
  const typename V::vf pv = V::add(V::load(p), gv);
  V::store(m, V::add(V::load(m), gv));
  V::store(v, V::add(V::load(v), gv));
  V::store(p, pv);
  store_out(out, pv);
}

// A contiguous range of elements idx0 .. idx0 + n - 1 of one tensor: full vectors, then the tail
// through zero-padded stack buffers, so the tail runs the very same vector code (same bits) and
// never reads or writes past the end. Element indices are 32-bit (the caller checks n < 2^32 where
// they matter: bf16 moments).
template <class G, class O, class M, bool kRoof>
static void range(float* p, const void* g_, void* m_, void* v_, void* out_, int64_t n, uint32_t idx0, uint32_t key,
                  const Hyper& hyper) {
  // A local copy: the stores through p, m and v may alias the caller's floats as far as the
  // compiler knows, which would reload and re-broadcast every coefficient in every iteration;
  // nothing aliases a local, so they stay in registers.
  const Hyper h = hyper;
  const G* g = static_cast<const G*>(g_);
  M* m = static_cast<M*>(m_);
  M* v = static_cast<M*>(v_);
  O* out = static_cast<O*>(out_);
  constexpr int W = V::W;
  const bool has_out = !std::is_same_v<O, simd::no_out_t>;
  int64_t i = 0;
  // No software prefetch: every stream is read in order, which the hardware prefetcher follows;
  // prefetching 2 KiB ahead on the four input streams made both the step and the roof slower on
  // an AVX-512 AMD EPYC (the extra instructions compete with demand misses for fill buffers).
  for (; i + W <= n; i += W) {
    const uint32_t idx = idx0 + static_cast<uint32_t>(i);
    if constexpr (kRoof) roof_vec(p + i, g + i, m + i, v + i, has_out ? out + i : out, h, idx, key);
    else adam_vec(p + i, g + i, m + i, v + i, has_out ? out + i : out, h, idx, key);
  }
  const int64_t rest = n - i;
  if (rest > 0) {
    const uint32_t idx = idx0 + static_cast<uint32_t>(i);
    alignas(64) float pb[W] = {};
    alignas(64) M mb[W] = {}, vb[W] = {};
    alignas(64) G gb[W] = {};
    alignas(64) O ob[W] = {};
    std::memcpy(pb, p + i, rest * sizeof(float));
    std::memcpy(mb, m + i, rest * sizeof(M));
    std::memcpy(vb, v + i, rest * sizeof(M));
    std::memcpy(gb, g + i, rest * sizeof(G));
    if constexpr (kRoof) roof_vec(pb, gb, mb, vb, ob, h, idx, key);
    else adam_vec(pb, gb, mb, vb, ob, h, idx, key);
    std::memcpy(p + i, pb, rest * sizeof(float));
    std::memcpy(m + i, mb, rest * sizeof(M));
    std::memcpy(v + i, vb, rest * sizeof(M));
    if (has_out) std::memcpy(out + i, ob, rest * sizeof(O));
  }
}

// round_sr_vec over elements idx0 .. idx0 + n - 1, the tail through stack buffers as in range().
static void round_sr_range(const float* src, simd::bf16_t* dst, int64_t n, uint32_t idx0, uint32_t key) {
  constexpr int W = V::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) round_sr_vec(src + i, dst + i, idx0 + static_cast<uint32_t>(i), key);
  const int64_t rest = n - i;
  if (rest > 0) {
    alignas(64) float sb[W] = {};
    alignas(64) simd::bf16_t db[W] = {};
    std::memcpy(sb, src + i, rest * sizeof(float));
    round_sr_vec(sb, db, idx0 + static_cast<uint32_t>(i), key);
    std::memcpy(dst + i, db, rest * sizeof(simd::bf16_t));
  }
}
