// Picks the recurrent step's instantiation: q's dtype and the value-slice width of a CTA.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"
#include "src/kda/kda_recurrent_params.h"

namespace flare::kda {
cudaError_t launch_recurrent_bf16(const detail::KdaRecurrentArgs& a, int bv, cudaStream_t stream);
cudaError_t launch_recurrent_fp16(const detail::KdaRecurrentArgs& a, int bv, cudaStream_t stream);
}  // namespace flare::kda

namespace flare::detail {
namespace {

// FLARE_KDA_RECURRENT_BV (16, 32 or 64; tuning), read once.
int width_override() {
  static const int bv = [] {
    const char* env = std::getenv("FLARE_KDA_RECURRENT_BV");
    const int x = env ? std::atoi(env) : 0;
    return x == 16 || x == 32 || x == 64 ? x : 0;
  }();
  return bv;
}

}  // namespace

// Value columns per CTA: 64 while that still gives every SM two CTAs (the staged tokens are read
// by fewer CTAs), narrower slices for the small batches that would leave SMs idle (batch 1 with
// 32 value heads: 256 one-warp CTAs instead of 64 four-warp ones).
int recurrent_slice_width(int64_t heads, int value_dim, int num_sms) {
  const int forced = width_override();
  if (forced != 0 && forced <= value_dim) return forced;
  for (int bv : {64, 32})
    if (heads * (value_dim / bv) >= 2 * int64_t{num_sms}) return bv;
  return 16;
}

Status launch_kda_recurrent(const KdaRecurrentArgs& a, DType dtype, Stream stream) {
  const int bv =
      recurrent_slice_width(int64_t{a.num_seqs} * a.heads_v, a.value_dim, current_device_facts().num_sms);
  const bool bf16 = dtype == DType::kBFloat16;
  FLARE_CUDA_RETURN(bf16 ? kda::launch_recurrent_bf16(a, bv, stream) : kda::launch_recurrent_fp16(a, bv, stream));
  return Status::Ok();
}

}  // namespace flare::detail
