/* rng.h - the project's pseudo-random generators, shared so that every module draws the
 * same documented sequences: splitmix64 (seeding, and cheap per-row streams) and
 * xoshiro256** (the per-sequence sampler RNG, load schedules). Pure, header-only; a state
 * belongs to one thread. */
#ifndef KVR_CORE_RNG_H
#define KVR_CORE_RNG_H

#include <stdint.h>

/* Advance a splitmix64 state and return the next 64 random bits. */
static inline uint64_t kvr_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Seed a xoshiro256** state from one 64-bit seed (four splitmix64 draws). */
static inline void kvr_xoshiro_seed(uint64_t s[4], uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        s[i] = kvr_splitmix64(&seed);
}

static inline uint64_t kvr_rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* Next 64 random bits of a xoshiro256** state. */
static inline uint64_t kvr_xoshiro_next(uint64_t s[4])
{
    uint64_t result = kvr_rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = kvr_rotl64(s[3], 45);
    return result;
}

#endif
