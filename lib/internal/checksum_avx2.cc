// XXH3-64 compiled for AVX2 (this file alone is built with -mavx2): about 1.6x the
// speed of Debian's libxxhash, which is built for baseline x86-64 (SSE2). Called
// only where the CPU has AVX2 (lib/backend/checksum.cc checks). Nothing here but xxhash's
// own static inline functions and one plain function, so no AVX2 code can stand in
// for an inline function shared with other files.
#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <refit/internal/checksum_avx2.h>

namespace refit::detail {

unsigned long long xxh3_avx2(const void* const* data, const unsigned long* sizes, unsigned long count) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (unsigned long i = 0; i < count; ++i) XXH3_64bits_update(&state, data[i], sizes[i]);
  return XXH3_64bits_digest(&state);
}

}  // namespace refit::detail
