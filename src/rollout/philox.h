#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// rollouts' uniform draw for (seed, position), header-only and host/device: the CPU sampler
// (rollout/sampler.cpp) and the GPU one (cuda/sample.cu) run these very integer operations, so a
// draw's u is the same bits on both. See rollout/sampler.h for how draws are keyed.
#include <cstdint>

#if defined(__CUDACC__)
#define QUADS_PHILOX_HD __host__ __device__
#else
#define QUADS_PHILOX_HD
#endif

namespace quads::rollout {

struct Philox4x32 {
  uint32_t v[4];
};

QUADS_PHILOX_HD inline Philox4x32 philox4x32_10(const uint32_t counter[4], const uint32_t key[2]) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // Weyl key increments
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return {{c0, c1, c2, c3}};
}

// Uniform double in [0, 1) with 53 random bits: the draw for (seed, pos).
QUADS_PHILOX_HD inline double uniform_draw(uint64_t seed, uint64_t pos) {
  const uint32_t ctr[4] = {uint32_t(pos), uint32_t(pos >> 32), 0u, 0u};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  const Philox4x32 r = philox4x32_10(ctr, key);
  const uint64_t bits = (uint64_t(r.v[0]) << 21) ^ (uint64_t(r.v[1]) >> 11);  // 53 bits
  return double(bits & ((uint64_t(1) << 53) - 1)) * 0x1.0p-53;
}

}  // namespace quads::rollout
