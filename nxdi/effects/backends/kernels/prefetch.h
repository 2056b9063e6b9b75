// Whether the decode linears (bf16_linear.cpp, quantized_linear.cpp) prefetch the next block of
// weight rows in software while they read one. Measured per CPU (docs/cpu-backend.md, "Decode
// linears on AMD CPUs"): on the Intel machines (Ice Lake, and Sapphire Rapids with AMX) the
// hardware prefetcher restarts at every short block of rows and the software prefetch took a
// linear from 13-20 to 25-30 GB/s. On AMD Zen 4, with 1-2 rows of x (blocks of 8 weight rows) the
// same prefetches made the linears up to 1.1x slower and a batch-1 decode step 1.10-1.14x slower
// than leaving the reads to the hardware, while with 3-4 rows (blocks of 4) they still made the
// linears 1.05-1.25x faster. So the default ("auto") prefetches except for 1-2 rows on AMD CPUs;
// `nxdi_kernels::next_block_prefetch(mode)` sets "on", "off" or "auto" (for the tests and
// side-by-side measurements). Results do not depend on it.
#pragma once

#include <cstdint>

namespace nxdi_prefetch {

// Whether a call with `rows` rows of x prefetches (the setting is read once per call).
bool next_block(int64_t rows);

}  // namespace nxdi_prefetch
