// The consumer's OWN lib/config.h: a very common layout. refit's headers include
// <refit/config.h>, so they can never pick this file up by mistake (they did when
// they were included as "lib/config.h").
#pragma once

#include <cstdint>

namespace consumer {

struct config {
  std::uint64_t tensors = 8;
  std::uint64_t tensor_bytes = 1 << 20;
  int updates = 2;
};

}  // namespace consumer
