// The AVX2 build of XXH3-64 (lib/internal/checksum_avx2.cc); only
// lib/backend/checksum.cc calls it, and only on CPUs with AVX2. Plain types: this header is included by a file built
// with -mavx2 and must pull in nothing else.
#pragma once

namespace refit::detail {

/// XXH3-64 of the concatenation of `count` ranges.
unsigned long long xxh3_avx2(const void* const* data, const unsigned long* sizes, unsigned long count);

}  // namespace refit::detail
