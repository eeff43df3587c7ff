// The Adam kernel body, written once over a SIMD vocabulary struct `V` (csrc/includes/simd.h).
//
// NO include guard, on purpose: cpu_adam.cpp includes this file once per instruction set, each
// time inside a `#pragma GCC target` region and a namespace that defines `using V = ...;`, so
// the same body is compiled for AVX-512, AVX2 and scalar code. It includes nothing itself.

template <class O>
static inline void store_out(O* out, typename V::vf p) {
  if constexpr (!std::is_same_v<O, simd::no_out_t>) V::store(out, p);
}

// One vector of W elements (see Hyper in cpu_adam.h for the formula).
template <class G, class O>
static inline void adam_vec(float* p, const G* g, float* m, float* v, O* out, const Hyper& h) {
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
  V::store(m, mv);
  V::store(v, vv);
  V::store(p, pv);
  store_out(out, pv);
}

// The roof: same loads and stores as adam_vec, one add per stream.
template <class G, class O>
static inline void roof_vec(float* p, const G* g, float* m, float* v, O* out, const Hyper&) {
  const typename V::vf gv = V::load(g);
  const typename V::vf pv = V::add(V::load(p), gv);
  V::store(m, V::add(V::load(m), gv));
  V::store(v, V::add(V::load(v), gv));
  V::store(p, pv);
  store_out(out, pv);
}

// A contiguous range: full vectors, then the tail through zero-padded stack buffers, so the tail
// runs the very same vector code (same bits) and never reads or writes past the end.
template <class G, class O, bool kRoof>
static void range(float* p, const void* g_, float* m, float* v, void* out_, int64_t n, const Hyper& h) {
  const G* g = static_cast<const G*>(g_);
  O* out = static_cast<O*>(out_);
  constexpr int W = V::W;
  const bool has_out = !std::is_same_v<O, simd::no_out_t>;
  int64_t i = 0;
  // No software prefetch: every stream is read in order, which the hardware prefetcher follows;
  // prefetching 2 KiB ahead on the four input streams made both the step and the roof slower on
  // an AVX-512 AMD EPYC (the extra instructions compete with demand misses for fill buffers).
  for (; i + W <= n; i += W) {
    if constexpr (kRoof) roof_vec(p + i, g + i, m + i, v + i, has_out ? out + i : out, h);
    else adam_vec(p + i, g + i, m + i, v + i, has_out ? out + i : out, h);
  }
  const int64_t rest = n - i;
  if (rest > 0) {
    alignas(64) float pb[W] = {}, mb[W] = {}, vb[W] = {};
    alignas(64) G gb[W] = {};
    alignas(64) O ob[W] = {};
    std::memcpy(pb, p + i, rest * sizeof(float));
    std::memcpy(mb, m + i, rest * sizeof(float));
    std::memcpy(vb, v + i, rest * sizeof(float));
    std::memcpy(gb, g + i, rest * sizeof(G));
    if constexpr (kRoof) roof_vec(pb, gb, mb, vb, ob, h);
    else adam_vec(pb, gb, mb, vb, ob, h);
    std::memcpy(p + i, pb, rest * sizeof(float));
    std::memcpy(m + i, mb, rest * sizeof(float));
    std::memcpy(v + i, vb, rest * sizeof(float));
    if (has_out) std::memcpy(out + i, ob, rest * sizeof(O));
  }
}
