// stdin helpers shared by the CUDA kernels' CPU harnesses.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace harness {

// Read exactly `bytes` from stdin into `dst`, or exit(2).
inline void read_exact(void* dst, size_t bytes) {
  if (bytes && std::fread(dst, 1, bytes, stdin) != bytes) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
}

}  // namespace harness
