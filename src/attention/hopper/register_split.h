// The register split between the producer and consumer warpgroups of a warp-specialized kernel.
#pragma once

namespace flare::hopper {

// setmaxnreg moves registers within the CTA's allocation at launch (the per-thread count the
// compiler picks under __launch_bounds__(threads, 1), a multiple of 8, times the threads). An
// increase the pool cannot cover blocks forever, so the split must fit it.
constexpr bool fits_register_file(int threads, int producer_regs, int consumer_regs) {
  const int per_thread = (65536 / threads) / 8 * 8 > 255 ? 255 : (65536 / threads) / 8 * 8;
  return 128 * producer_regs + (threads - 128) * consumer_regs <= per_thread * threads;
}

}  // namespace flare::hopper
