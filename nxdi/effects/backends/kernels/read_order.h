// The order in which the decode linears (bf16_linear.cpp, quantized_linear.cpp) read a weight's
// rows: R rows at once (R interleaved streams), those R rows `spacing` rows apart (a group of
// spacing x R rows is read as `spacing` blocks: rows j, j + spacing, ..., j + (R - 1) * spacing),
// whether the next block's rows are prefetched in software while one is read, and, where they are
// not, how far ahead in each of the R streams lines are fetched into L2.
//
// Chosen per CPU by measurement (docs/cpu-backend.md, "Decode linears on AMD CPUs"):
// - "intel" (Ice Lake; Sapphire Rapids with AMX): spacing 4, and the prefetch always. The hardware
//   prefetcher restarts at every short block and the software prefetch took a linear from 13-20
//   to 25-30 GB/s; spacing 4 read 1.03-1.4x faster than adjacent rows for int8 and -2 to +6 %
//   for bf16.
// - "amd" (Zen 4): a block's rows 32 KB apart at K = 2048 (spacing 16 for 1-byte weights, 8 for
//   bf16), the next-block prefetch only for 3-4 rows of x, and for 1-2 rows each stream fetched
//   into L2 2 KB ahead. Side by side, a batch-1 decode step of the 1.1B shape took 1.10x (bf16)
//   and 1.14x (int8) longer with the next-block prefetch, which still made 3-4 rows 1.05-1.25x
//   faster; spacing 16 over 4 made the int8 step 1.04-1.09x faster, and bf16's spacing 4 over
//   adjacent rows 1.13-1.20x, 8 over 4 1.07x; the L2 fetch 2 KB ahead 1.10x (int8, 1-8 KB ahead:
//   1.08-1.10x) and 1.04x (bf16).
// "auto" (the default) is "amd" on AMD CPUs and "intel" elsewhere; `nxdi_kernels::read_order(name)`
// sets one for the process (the tests run each; side-by-side measurements compare them). Results
// do not depend on it: each output row's sum is taken in the same order.
#pragma once

#include <cstdint>

namespace nxdi_read_order {

struct Order {
  bool prefetch;    // the next block's rows, one cache line per row per step
  int64_t spacing;  // rows between a block's rows
  int64_t ahead;    // bytes ahead in each stream fetched into L2 (0: none; 0 wherever `prefetch`);
                    // the widened bf16 path (CPUs without AVX512-BF16, none of them AMD) leaves it
};

// The order for a call with `rows` rows of x and weights of `bytes` bytes each (read once per call).
Order of(int64_t rows, int bytes);

}  // namespace nxdi_read_order
